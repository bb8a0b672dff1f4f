"""Beam search: the same beams, order and scores as Hugging Face `generate(num_beams=k)`, and beams
that share KV blocks copy-on-write (forks copy nothing, pruned beams free at once, only partial
last blocks are copied, nothing leaks)."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.model.loader import resolve_hf_dir
from pagedllm import LLM, SamplingParams
from pagedllm.core.beam_selection import BeamSelection
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import BeamSearchParams
from tests.model.tiny_models import make_hf_model, save_hf_model

SCORE_ATOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """HF and the engine take turns on a small, busy CPU, where extra threads mostly wait on each
    other (10x slower under load); one thread keeps the module fast."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@torch.inference_mode()
def hf_beam_search(model, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int]):
    """HF's beams for one prompt: (generated token ids with the padding cut, sequences_scores)."""
    eos = None if params.ignore_eos else list(eos_token_ids)
    pad = eos_token_ids[0]
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
        num_beams=params.beam_width, num_return_sequences=params.num_returned,
        max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
        early_stopping=params.early_stopping, eos_token_id=eos, pad_token_id=pad,
        output_scores=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None,
    )
    rows = out.sequences[:, len(prompt_ids):].tolist()
    # A finished beam's row ends in padding: its length is its number of beam indices.
    lengths = ((out.beam_indices + 1) != 0).sum(dim=1).tolist()
    return [row[:n] for row, n in zip(rows, lengths)], out.sequences_scores.tolist()


def assert_same_beams(output, hf_tokens, hf_scores, length_penalty: float, label: str) -> None:
    ours = [(s.token_ids, s.score) for s in output.sequences]
    assert [t for t, _ in ours] == hf_tokens, f"{label}: beams differ\n ours {ours}\n HF   {list(zip(hf_tokens, hf_scores))}"
    for i, ((_, score), hf_score) in enumerate(zip(ours, hf_scores)):
        assert abs(score - hf_score) < SCORE_ATOL, f"{label}: beam {i} score {score:.6f}, HF {hf_score:.6f}"
    for seq in output.sequences:  # the score is the length-penalized cumulative logprob
        assert seq.score == pytest.approx(seq.cumulative_logprob / len(seq.token_ids) ** length_penalty, abs=1e-9)


# --- the embedded default model -------------------------------------------------------------

DEFAULT_CASES = [
    # (beam_width, max_tokens, length_penalty, ignore_eos, early_stopping)
    (2, 10, 1.0, False, False),
    (4, 10, 0.5, False, False),
    (4, 8, 2.0, True, False),
    (3, 10, 1.0, False, True),
]


@pytest.fixture(scope="module")
def default_setup():
    llm = LLM(quant_activations="none")  # the exact mode: compared with transformers
    tokenizer = llm.get_tokenizer()
    prompts = [
        llm.encode_chat([{"role": "user", "content": "What is 2+2?"}]),  # answers and ends with EOS early
        llm.encode_chat([{"role": "user", "content": "Say hi."}]),
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("Once upon a time"),
    ]
    hf_model = AutoModelForCausalLM.from_pretrained(resolve_hf_dir(None), dtype=torch.float32).eval()
    yield llm, prompts, hf_model
    del hf_model


@pytest.mark.slow  # Hugging Face beam search on the default model
@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: "k{}-T{}-lp{}-{}-es{}".format(
    c[0], c[1], c[2], "ignore_eos" if c[3] else "eos", c[4]))
def test_default_model_matches_hf(default_setup, case):
    llm, prompts, hf_model = default_setup
    width, max_tokens, length_penalty, ignore_eos, early_stopping = case
    params = BeamSearchParams(width, max_tokens=max_tokens, length_penalty=length_penalty, ignore_eos=ignore_eos,
                              early_stopping=early_stopping)
    eos = llm.engine.input_processor.eos_token_ids
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.core.check_kv_leaks() == []
    finished_early = 0
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        label = f"default model {case}, prompt {i}"
        hf_tokens, hf_scores = hf_beam_search(hf_model, prompt, params, eos)
        assert len(output.sequences) == width
        assert_same_beams(output, hf_tokens, hf_scores, length_penalty, label)
        finished_early += sum(s.finish_reason == "stop" and len(s.token_ids) < max_tokens for s in output.sequences)
        assert all((s.finish_reason == "stop") == (s.token_ids[-1] in eos and not ignore_eos) for s in output.sequences)
        assert output.sequences[0].text == llm.get_tokenizer().decode(output.sequences[0].token_ids,
                                                                       skip_special_tokens=True)
    if not ignore_eos:
        assert finished_early > 0, "the chat prompts were meant to end with EOS before max_tokens"


# --- a tiny random model with two EOS ids: EOS often among the candidates -------------------

def _tiny_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """EOS ids are the two tokens the model generates most, so beams end at every length."""
    hf_model = make_hf_model("llama", seed=5, max_position_embeddings=256)
    prompts = _tiny_prompts(8, seed=2)
    counts = collections.Counter()
    probe = BeamSearchParams(3, max_tokens=12, ignore_eos=True)
    for p in prompts:
        for tokens in hf_beam_search(hf_model, p, probe, [0])[0]:
            counts.update(tokens)
    eos = [t for t, _ in counts.most_common(2)]
    hf_model.config.eos_token_id = eos
    hf_model.generation_config.eos_token_id = eos
    hf_model.generation_config.bos_token_id = None
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("tiny-beams"))
    return hf_model, path, prompts, eos


TINY_ENGINE = dict(block_size=4, num_kv_blocks=512)
TINY_CASES = [
    (2, 12, 1.0, False), (3, 12, 1.0, False), (3, 12, 0.5, True), (3, 12, 2.0, "never"), (4, 10, -1.0, "never"),
    (3, 12, 1.0, True), (5, 9, 0.0, False),
]


@pytest.mark.parametrize("case", TINY_CASES, ids=lambda c: "k{}-T{}-lp{}-es{}".format(*c))
def test_tiny_model_with_two_eos_ids_matches_hf(tiny_setup, case):
    hf_model, path, prompts, eos = tiny_setup
    width, max_tokens, length_penalty, early_stopping = case
    llm = LLM(model=path, **TINY_ENGINE)
    assert sorted(llm.engine.input_processor.eos_token_ids) == sorted(eos)
    params = BeamSearchParams(width, max_tokens=max_tokens, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.core.check_kv_leaks() == []
    lengths = set()
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        label = f"tiny {case}, prompt {i}"
        hf_tokens, hf_scores = hf_beam_search(hf_model, prompt, params, eos)
        assert_same_beams(output, hf_tokens, hf_scores, length_penalty, label)
        lengths.update(len(s.token_ids) for s in output.sequences)
    if length_penalty <= 1.0:
        assert len(lengths) > 1, "beams were meant to end at several lengths"


def test_num_return_sequences_and_chunked_prefill_and_tight_memory(tiny_setup):
    hf_model, path, prompts, eos = tiny_setup
    params = BeamSearchParams(3, max_tokens=10, num_return_sequences=2)
    reference = LLM(model=path, **TINY_ENGINE).beam_search([{"prompt_token_ids": p} for p in prompts], params)
    # 7-token steps chunk every longer prompt; 40 blocks of 4 admit only a few prompts at a time.
    llm = LLM(model=path, block_size=4, num_kv_blocks=40, max_num_batched_tokens=7)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.core.stats().num_preemptions == 0
    assert llm.engine.core.check_kv_leaks() == []
    for prompt, ours, ref in zip(prompts, outputs, reference):
        assert len(ours.sequences) == 2
        assert [s.token_ids for s in ours.sequences] == [s.token_ids for s in ref.sequences]
        assert [s.score for s in ours.sequences] == pytest.approx([s.score for s in ref.sequences], abs=1e-5)
        hf_tokens, hf_scores = hf_beam_search(hf_model, prompt, params, eos)
        assert [s.token_ids for s in ours.sequences] == hf_tokens


def test_params_per_prompt_equal_separate_calls(tiny_setup):
    _, path, prompts, _ = tiny_setup
    llm = LLM(model=path, **TINY_ENGINE)
    inputs = [{"prompt_token_ids": p} for p in prompts[:3]]
    params = [BeamSearchParams(2, max_tokens=6), BeamSearchParams(4, max_tokens=9, length_penalty=0.0),
              BeamSearchParams(3, max_tokens=5, ignore_eos=True, num_return_sequences=1)]
    together = llm.beam_search(inputs, params)
    for prompt, p, output in zip(inputs, params, together):
        (alone,) = llm.beam_search(prompt, p)
        assert len(output.sequences) == p.num_returned
        assert [s.token_ids for s in output.sequences] == [s.token_ids for s in alone.sequences]
    with pytest.raises(InvalidRequestError, match="2 beam search params"):
        llm.beam_search(inputs, params[:2])
    assert llm.engine.core.check_kv_leaks() == []


def test_one_beam_is_greedy_decoding(tiny_setup):
    # HF runs greedy search for num_beams=1; with the default length penalty one beam is the same.
    _, path, prompts, _ = tiny_setup
    llm = LLM(model=path, **TINY_ENGINE)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    beams = llm.beam_search(inputs, BeamSearchParams(1, max_tokens=40))
    greedy = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=40, logprobs=0), use_tqdm=False)
    assert any(len(g.outputs[0].token_ids) < 40 for g in greedy)
    for beam, out in zip(beams, greedy):
        (seq,) = beam.sequences
        assert seq.token_ids == out.outputs[0].token_ids
        assert seq.cumulative_logprob == pytest.approx(out.outputs[0].cumulative_logprob, abs=1e-4)


def test_max_model_len_caps_the_beams(tiny_setup):
    _, path, _, _ = tiny_setup
    llm = LLM(model=path, **TINY_ENGINE, max_model_len=24)
    prompt = list(range(100, 120))  # 20 tokens: room for 4
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(2, max_tokens=16, ignore_eos=True))
    assert [len(s.token_ids) for s in output.sequences] == [4, 4]
    assert all(s.finish_reason == "length" for s in output.sequences)
    assert llm.engine.core.check_kv_leaks() == []


# --- block sharing --------------------------------------------------------------------------


def _check_ref_counts(kv) -> None:
    holders = collections.Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), f"{block}: {holders.get(block.block_id, 0)} holders"


def test_forks_share_pruned_beams_free_at_once_only_partial_blocks_copied(tiny_setup):
    _, path, prompts, _ = tiny_setup
    llm = LLM(model=path, **TINY_ENGINE, enable_prefix_caching=False)
    core = llm.engine.core
    kv = core.kv_cache_manager
    scheduler = core.scheduler
    events = collections.Counter()
    forks: list[tuple[str, str, int]] = []  # (parent, child, child's computed tokens) since the last step

    real_replace = scheduler.replace_beams

    def replace_beams(parent_ids, children):
        tables = {p: list(kv.req_to_blocks[p]) for p in parent_ids}
        chosen = {parent_ids[index] for index, _, _ in children}
        survivors = {b.block_id for p in chosen for b in tables[p]}
        survivors |= {b.block_id for rid, blocks in kv.req_to_blocks.items() if rid not in tables for b in blocks}
        pruned = {b.block_id for p in parent_ids for b in tables[p]} - survivors
        num_copies = kv.num_cow_copies
        _check_ref_counts(kv)
        kids = real_replace(parent_ids, children)
        for (index, child_id, _), kid in zip(children, kids):
            # the child's table is its parent's: the same physical blocks, one more reference each
            assert all(a is b for a, b in zip(kv.req_to_blocks[child_id], tables[parent_ids[index]]))
            assert len(kv.req_to_blocks[child_id]) == len(tables[parent_ids[index]])
            forks.append((parent_ids[index], child_id, kid.num_computed_tokens))
        assert kv.num_cow_copies == num_copies  # forking never copies
        # blocks only the dropped parents held are free the moment the parents are finished
        assert all(kv.pool.blocks[b].ref_cnt == 0 for b in pruned)
        events["forks"] += len(kids)
        events["pruned_blocks"] += len(pruned)
        _check_ref_counts(kv)
        return kids

    real_execute = core.executor.execute_model

    def execute_model(sched_output):
        # every copy is of the shared partial last block of a just-forked child; the last sharer writes in place
        expected = 0
        by_parent = collections.Counter(parent for parent, _, _ in forks)
        for parent, n in by_parent.items():
            computed = next(c for p, _, c in forks if p == parent)
            if computed % kv.block_size:
                expected += n - 1
        assert len(sched_output.block_copies) == expected
        new_reqs = {r.req_id: r for r in sched_output.scheduled_new_reqs}
        for src, dst in sched_output.block_copies:
            owner = next(r for r in new_reqs.values() if dst in r.block_ids)
            assert owner.num_computed_tokens % kv.block_size != 0, "a full block was copied"
            assert owner.block_ids.index(dst) == len(owner.block_ids) - 1 and src not in owner.block_ids
        events["copies"] += len(sched_output.block_copies)
        forks.clear()
        return real_execute(sched_output)

    scheduler.replace_beams = replace_beams
    core.executor.execute_model = execute_model
    params = BeamSearchParams(4, max_tokens=12, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:4]], params)
    assert events["forks"] > 0 and events["pruned_blocks"] > 0 and events["copies"] > 0, events
    assert kv.num_cow_copies == events["copies"]
    assert core.check_kv_leaks() == []
    for output in outputs:
        sharing = output.kv_sharing
        assert sharing.num_steps == 11 and 0 < sharing.num_blocks_held < sharing.num_blocks_unshared
        assert 0 < sharing.saved_fraction < 1


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=11), "beam_width"),
    (dict(beam_width=2.0), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, length_penalty="1"), "length_penalty"),
    (dict(beam_width=2, early_stopping="always"), "early_stopping"),
    (dict(beam_width=2, early_stopping=1), "early_stopping"),
    (dict(beam_width=2, num_return_sequences=3), "num_return_sequences"),
    (dict(beam_width=2, ignore_eos=1), "ignore_eos"),
])
def test_bad_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_bad_requests_raise_and_leave_nothing_behind(tiny_setup):
    _, path, _, eos = tiny_setup
    llm = LLM(model=path, **TINY_ENGINE, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search({"prompt_token_ids": [5, 6]}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.beam_search({"prompt_token_ids": list(range(3, 40))}, BeamSearchParams(2))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.beam_search([{"prompt_token_ids": [5]}, {"prompt_token_ids": [10**6]}], BeamSearchParams(2))
    # two EOS ids: 3 x width candidates per beam, 20 at most
    with pytest.raises(InvalidRequestError, match="logprobs"):
        llm.beam_search({"prompt_token_ids": [5, 6]}, BeamSearchParams(7))
    assert llm.beam_search({"prompt_token_ids": [5, 6]}, BeamSearchParams(7, ignore_eos=True, max_tokens=3))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.check_kv_leaks() == []


def test_only_the_top_k_ranked_eos_candidates_finish():
    group = BeamSelection(2, max_tokens=5, eos_token_ids=[0])
    assert group.num_candidates == 4
    # step 1: EOS ranks third of four -> dropped, not finished; the two best non-EOS tokens run on
    assert group.step([[(7, -0.1), (8, -0.2), (0, -0.3), (9, -0.4)]]) == [(0, 7), (0, 8)]
    assert group.finished == []
    # step 2: EOS from beam 1 ranks second -> finished with score (-0.2 - 0.05) / 2
    chosen = group.step([[(3, -1.0), (4, -1.1), (0, -2.0), (5, -2.1)], [(0, -0.05), (6, -0.8), (7, -1.2), (8, -1.3)]])
    assert chosen == [(1, 6), (0, 3)]
    assert [(h.token_ids, round(h.score, 6)) for h in group.finished] == [((8, 0), -0.125)]
    assert not group.done
