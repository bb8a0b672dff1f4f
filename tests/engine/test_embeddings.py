"""Decoder embedders through the engine, against sentence-transformers on the same tiny random weights.

Every case runs through the scheduler with a 32-token step budget, so the long text is pooled from
three prefill chunks, batched with the short ones."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.errors import InvalidRequestError, ModelLoadError
from pagedllm.pooling_params import PoolingParams
from tests.engine.st_models import (append_eos_in_post_processor, assert_vectors_equal, build_decoder_dir,
                                    save_st_model, st_encode)

TEXTS = ["hello world", "a", "Paged attention keeps the KV cache in fixed-size blocks. " * 8,
         "What is the capital of France?", "x y z " * 5]
ENGINE = dict(runner="pooling", dtype="float32", max_num_batched_tokens=32, kv_cache_memory="16MiB")

CASES = {  # every pooling mode once: kind, pooling mode(s), Dense (out, activation), Normalize, legacy config form
    "qwen3-lasttoken-dense-normalize": ("qwen3", "lasttoken", (32, "tanh"), True, False),
    "llama-weightedmean+mean-bare": ("llama", ("weightedmean", "mean"), None, False, False),
    "qwen2-legacy-cls+max+mean_sqrt_len-dense": ("qwen2", ("cls", "max", "mean_sqrt_len_tokens"), (48, "identity"),
                                                 True, True),
}


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {kind: build_decoder_dir(root / kind, kind, seed=i) for i, kind in enumerate(("llama", "qwen2", "qwen3"))}


@pytest.fixture(scope="module")
def last_token_model(decoders, tmp_path_factory):
    path = save_st_model(decoders["qwen3"], tmp_path_factory.mktemp("st") / "m", "lasttoken", (32, "tanh"))
    return path, LLM(str(path), **ENGINE)


@pytest.mark.parametrize("case", sorted(CASES))
def test_vectors_equal_sentence_transformers(case, decoders, tmp_path):
    kind, mode, dense, normalize, legacy = CASES[case]
    path = save_st_model(decoders[kind], tmp_path / "st", mode, dense, normalize, legacy_pooling=legacy)
    llm = LLM(str(path), **ENGINE)
    tokenizer = llm.get_tokenizer()
    assert max(len(tokenizer.encode(t)) for t in TEXTS) > 2 * ENGINE["max_num_batched_tokens"]  # chunked
    ours = llm.embed(TEXTS)
    assert_vectors_equal(ours, st_encode(path, TEXTS), case)
    if normalize:
        assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert llm.engine.core.check_kv_leaks() == []
    assert llm.engine.stats().num_running == 0


def test_token_ids_and_last_token_prefix_cache(last_token_model):
    """Token-id inputs pool like their text; a repeated long input is served from the prefix cache and
    pools to the same vector (the last position is always computed)."""
    path, llm = last_token_model
    ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
    reference = st_encode(path, TEXTS)
    assert_vectors_equal(llm.embed(ids), reference, "token ids")
    hits_before = llm.engine.stats().prefix_cache_hits
    llm.engine.add_pooling_request("again", TEXTS[2])
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    assert outputs[0].num_cached_tokens >= 16 and llm.engine.stats().prefix_cache_hits > hits_before
    assert_vectors_equal([outputs[0].embedding], reference[2:3], "prefix-cache hit")
    assert llm.engine.core.check_kv_leaks() == []


def test_eos_appended_by_the_tokenizer_is_pooled(decoders, tmp_path):
    """A tokenizer whose post-processor appends EOS (Qwen3-Embedding's): the last token pooled is that EOS,
    under sentence-transformers and here alike."""
    path = save_st_model(decoders["qwen3"], tmp_path / "st", "lasttoken", None, True)
    eos_id = append_eos_in_post_processor(path)
    llm = LLM(str(path), **ENGINE)
    assert llm.get_tokenizer().encode("hello")[-1] == eos_id
    assert_vectors_equal(llm.embed(TEXTS), st_encode(path, TEXTS), "EOS appended")


def test_mean_pooling_never_takes_prefix_hits(decoders, tmp_path):
    path = save_st_model(decoders["llama"], tmp_path / "st", "mean", None, False)
    llm = LLM(str(path), **ENGINE)
    first = llm.embed(TEXTS[2])
    llm.engine.add_pooling_request("again", TEXTS[2])
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    assert outputs[0].num_cached_tokens == 0
    assert_vectors_equal([outputs[0].embedding], first, "repeat")


def test_truncation_and_limits(last_token_model):
    path, llm = last_token_model
    ids = llm.get_tokenizer().encode(TEXTS[2])
    long_ids = (ids * 6)[:600]  # past max_position_embeddings (512)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        llm.embed([long_ids])
    kept = llm.embed([long_ids], truncate_prompt_tokens=20)[0]
    assert_vectors_equal([kept], llm.embed([long_ids[-20:]]), "last 20 tokens")
    assert len(llm.embed([long_ids], truncate_prompt_tokens=-1)[0]) == 32
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed("hi", dimensions=8)  # no Matryoshka declaration
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate("hi")
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]])
    assert llm.engine.core.check_kv_leaks() == []


def test_matryoshka_dimensions_and_prompts(decoders, tmp_path):
    path = save_st_model(decoders["qwen3"], tmp_path / "st", "lasttoken", (32, "tanh"),
                         prompts={"query": "query: ", "document": ""}, default_prompt_name="query")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 16]}))
    llm = LLM(str(path), **ENGINE)
    assert_vectors_equal(llm.embed(TEXTS), st_encode(path, TEXTS), "default prompt 'query'")
    assert_vectors_equal(llm.embed(TEXTS, prompt_name="document"), st_encode(path, TEXTS, prompt_name="document"),
                         "prompt 'document'")
    assert_vectors_equal(llm.embed(TEXTS, dimensions=16),
                         st_encode(path, TEXTS, truncate_dim=16, normalize_embeddings=True), "dimensions 16")
    with pytest.raises(InvalidRequestError, match="dimensions 8"):
        llm.embed("hi", dimensions=8)
    with pytest.raises(InvalidRequestError, match="prompt_name"):
        llm.embed("hi", prompt_name="nope")


def test_runner_mismatches_refused(decoders, last_token_model):
    path, _ = last_token_model
    with pytest.raises(ModelLoadError, match="runner='pooling'"):
        LLM(str(path), kv_cache_memory="16MiB")  # a head-less checkpoint cannot generate
    generator = LLM(str(decoders["llama"]), kv_cache_memory="16MiB")
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        generator.embed("hi")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(path), runner="pooling", tensor_parallel_size=2)



def _piece_state(token_ids, start):
    from types import SimpleNamespace

    return SimpleNamespace(req_id="r", token_ids=token_ids, num_computed_tokens=start,
                           pooling_params=PoolingParams(needs_every_position=True))


def test_pooling_runner_pools_each_position_once_across_chunks_and_recompute():
    """Pieces of a prompt arrive per chunk; a preempted request's recompute (a piece starting again at an
    earlier position) replaces what it covers, so every position is pooled exactly once; a gap fails it."""
    import torch

    from pagedllm.config.embedder import EmbedderConfig
    from pagedllm.model.layers.pooler import Pooler
    from pagedllm.worker.pooling import PoolingRunner

    runner = PoolingRunner(Pooler(EmbedderConfig(("mean",)), hidden_size=4))
    hidden = torch.randn(10, 4)
    tokens = list(range(10))
    pooled, failed = {}, {}
    for start, end in [(0, 4), (4, 7), (0, 3), (3, 6), (6, 10)]:  # preempted after 7, recomputed from 0
        runner.collect([_piece_state(tokens, start)], [end - start], hidden[start:end], pooled, failed)
    assert failed == {} and runner.num_kept_requests == 0
    torch.testing.assert_close(torch.tensor(pooled["r"]), hidden.mean(0))
    pooled.clear()
    for start, end in [(0, 4), (6, 10)]:  # positions 4 and 5 never arrived
        runner.collect([_piece_state(tokens, start)], [end - start], hidden[start:end], pooled, failed)
    assert pooled == {} and "not covering" in failed["r"]


def test_runner_both_generates_and_embeds_in_the_same_batches(decoders):
    """runner='both': a causal LM's generation is unchanged (greedy tokens equal a generate-only engine's)
    while prompts pooled in the same steps are its last hidden state, normalized, as transformers computes
    it (the head-less model of the same checkpoint)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from pagedllm import SamplingParams
    from pagedllm.outputs import PoolingRequestOutput

    path = decoders["qwen3"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference_text = [o.outputs[0].token_ids for o in LLM(str(path), **ENGINE | {"runner": "generate"})
                      .generate(TEXTS[:2], greedy)]
    llm = LLM(str(path), **ENGINE | {"runner": "both"})
    for i, text in enumerate(TEXTS):
        llm.engine.add_pooling_request(f"e{i}", text)
    for i, text in enumerate(TEXTS[:2]):
        llm.engine.add_request(f"g{i}", text, greedy)
    vectors, tokens, mixed_steps = {}, {}, 0
    while llm.engine.has_unfinished_requests():
        outputs = llm.engine.step()
        kinds = {isinstance(o, PoolingRequestOutput) for o in outputs}
        mixed_steps += kinds == {True, False}
        for out in outputs:
            if isinstance(out, PoolingRequestOutput):
                vectors[out.request_id] = out.data
            elif out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    assert mixed_steps >= 1  # some step finished a pooled prompt and advanced a generation together
    assert [tokens["g0"], tokens["g1"]] == reference_text
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [torch.nn.functional.normalize(model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, -1],
                                                  dim=-1).tolist() for t in TEXTS]
    assert_vectors_equal([vectors[f"e{i}"] for i in range(len(TEXTS))], expected, "runner both")
    assert llm.engine.core.check_kv_leaks() == []
    with pytest.raises(ValueError, match="runner 'both' does not support tensor_parallel_size"):
        LLM(str(path), runner="both", tensor_parallel_size=2)
