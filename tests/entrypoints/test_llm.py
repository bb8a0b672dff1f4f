"""The offline API on the embedded default model: inputs, outputs, sampling options, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, quant_activations="none")  # the exact mode: prompt logprobs vs transformers


def _assert_idle_without_leaks(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.check_kv_leaks() == []


def test_outputs_come_back_in_input_order_for_strings_and_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    prompts = ["The capital of France is", {"prompt_token_ids": tokenizer.encode("1, 2, 3,")}, "Hi"]
    params = SamplingParams(temperature=0, max_tokens=6)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    singles = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == [s.outputs[0].token_ids for s in singles]
    assert outputs[0].prompt == "The capital of France is"
    assert outputs[1].prompt_token_ids == tokenizer.encode("1, 2, 3,")
    for out in outputs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason in ("stop", "length")
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    _assert_idle_without_leaks(llm)


def test_logprobs_are_dicts_of_logprob_objects(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3)
    completion = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[:3] == [1, 1, 2] or ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 and isinstance(lp.decoded_token, str) for lp in entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
    )


def test_prompt_logprobs_match_the_model(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Paris is the capital of France")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    hf_logits = _hf_logits(llm, ids)
    expected = torch.log_softmax(hf_logits, -1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-3)


def _hf_logits(llm, ids):
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import resolve_hf_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_hf_dir(None), dtype=torch.float32)  # the float32 twin
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_stop_strings_are_cut_from_the_text(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert " 7" in base.text, base.text
    stop = " 7"
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text == base.text[: base.text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    kept = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                       include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == base.text[: base.text.index(stop) + len(stop)]
    _assert_idle_without_leaks(llm)


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[2]
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses EOS: a chat reply that would end early keeps going
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    eos = llm.engine.input_processor.eos_token_ids[0]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos and len(short.token_ids) < 20
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) > 20
    assert eos not in longer.token_ids[:20]


def test_max_tokens_gives_length(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    alone = llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(["Hello there", "Tell me a story", "Why?"], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate("Tell me a story", SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone


def test_n_returns_n_distinct_samples_and_best_of_ranks_them(llm):
    out = llm.generate("Name a color:", SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    best = llm.generate("Name a color:", SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=8, seed=5),
                        use_tqdm=False)[0]
    assert len(best.outputs) == 2
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert best.outputs[0].logprobs is None  # ranked by logprob, but none were asked for
    _assert_idle_without_leaks(llm)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(out.prompt_token_ids).startswith("<|im_start|>")
    assert "4" in out.outputs[0].text


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ({"prompt_token_ids": [1, 2, 10**6]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ("Hi", SamplingParams(stop_token_ids=[10**7]), "outside the vocabulary"),
        ("Hi", SamplingParams(logit_bias={10**7: 1.0}), "outside the vocabulary"),
        ("Hi", SamplingParams(max_tokens=10_000), "exceeds max_model_len"),
        ("word " * 600, SamplingParams(), "max_model_len"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_error_and_nothing_queued(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    _assert_idle_without_leaks(llm)


def test_a_request_bigger_than_the_whole_cache_is_refused():
    small = LLM(num_kv_blocks=4, max_model_len=512)
    with pytest.raises(InvalidRequestError, match="whole cache has 4"):
        small.generate("Hi", SamplingParams(max_tokens=100), use_tqdm=False)
    assert small.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)[0].finished


def test_invalid_sampling_params_say_what_is_wrong():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=["x"] * 100)


def test_abort_frees_blocks_immediately(llm):
    engine = llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.core.kv_cache_manager.usage > 0
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests()
    assert engine.core.check_kv_leaks() == []


@pytest.mark.slow  # the CLI in a subprocess on the default model
def test_cli_generate_prints_the_completion():
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "The capital of France is",
         "--max-tokens", "5", "--max-model-len", "256"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache:" in result.stderr and "tokens in flight" in result.stderr


def test_cli_reports_a_bad_model_path_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "x", "--model", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "nope" in result.stderr
