"""The structured-output pieces without a model: the sampler's bitmask hook against a bit-by-bit
reference, the grammar cache, and the worker's matchers (rebuilt from generated tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.model.sampling.logits_processors import apply_token_bitmask
from pagedllm.model.sampling.metadata import SamplingMetadata, SamplingRow
from pagedllm.model.sampling.sampler import Sampler
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured.grammar import GrammarCache, InvalidGrammarError, StructuredOutputManager, build_grammar


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[bool]:
    return [bool((int(bitmask_row[t // 32]) >> (t % 32)) & 1) for t in range(vocab)]


def test_bitmask_masks_exactly_the_cleared_bits_of_the_chosen_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=gen)  # 100 = 3 words + 4 bits: the last word is partial
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=gen)
    x = logits.clone()
    apply_token_bitmask(x, bitmask, [0, 2])
    for row in range(4):
        allowed = _allowed(bitmask[row], 100)
        for t in range(100):
            expected = logits[row, t] if row in (1, 3) or allowed[t] else float("-inf")
            assert x[row, t] == expected, (row, t)


def test_logits_wider_than_the_bitmask_are_masked_beyond_it():
    x = torch.zeros(1, 40)
    apply_token_bitmask(x, torch.full((1, 1), -1, dtype=torch.int32), [0])  # 32 tokens allowed, 8 padded
    assert torch.isfinite(x[0, :32]).all() and torch.isinf(x[0, 32:]).all()


def test_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone():
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # row 0: tokens 1 and 3
    bitmask[1, 1] = 0b1  # row 1: token 32
    rows = [SamplingRow(SamplingParams(temperature=1.0, seed=s), [5], []) for s in range(2)]
    rows.append(SamplingRow(SamplingParams(temperature=0.0), [5], []))
    for rows_with_generators in range(20):
        for row in rows[:2]:
            row.generator = torch.Generator().manual_seed(rows_with_generators)
        metadata = SamplingMetadata.from_requests(rows, vocab, "cpu")
        metadata.token_bitmask = (bitmask, [0, 1])
        sampled = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert sampled[0] in (1, 3) and sampled[1] == 32
        assert sampled[2] == int(logits[2].argmax())  # unconstrained greedy row: its own argmax


def test_grammar_cache_counts_hits_evicts_lru_and_keeps_errors():
    cache = GrammarCache(build_grammar, capacity=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    cache.get(a), cache.get(b), cache.get(a)
    assert (cache.hits, cache.misses) == (1, 2)
    cache.get(c)  # evicts b, the least recently used
    cache.get(a)
    cache.get(b)
    assert (cache.hits, cache.misses) == (2, 4)
    bad = StructuredOutputsParams(regex="(")
    for _ in range(2):
        with pytest.raises(InvalidGrammarError, match="invalid regex"):
            cache.get(bad).result()
    # a schema dict and its text are the same grammar; key order is part of it (properties are emitted in order)
    assert StructuredOutputsParams(json={"a": 1, "b": 2}).cache_key() != StructuredOutputsParams(json={"b": 2, "a": 1}).cache_key()
    assert StructuredOutputsParams(json={"a": 1}).cache_key() == StructuredOutputsParams(json=json.dumps({"a": 1})).cache_key()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagedllm.model.loader import resolve_hf_dir

    return AutoTokenizer.from_pretrained(str(resolve_hf_dir(None)))


def test_a_dropped_matcher_is_rebuilt_from_the_generated_tokens(tokenizer):
    eos = [tokenizer.eos_token_id]
    manager = StructuredOutputManager(tokenizer, 49152, eos, torch.device("cpu"))
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    generated = tokenizer.encode('{"k": 4')
    manager.add_sequence("r", spec, eos)
    mask, rows = manager.fill_bitmask([("free", []), ("r", [])])
    assert rows == [1]
    for token in generated:
        manager.accept("r", token)
    mask_live, _ = manager.fill_bitmask([("r", generated)])
    manager.drop("r")  # preempted: resumes as a new request carrying its output
    manager.add_sequence("r", spec, eos)
    mask_rebuilt, _ = manager.fill_bitmask([("r", generated)])
    assert torch.equal(mask_live, mask_rebuilt)
    allowed = _allowed(mask_rebuilt[0], 49152)
    assert allowed[tokenizer.encode("}")[0]] and not allowed[tokenizer.encode('"')[0]] and not allowed[eos[0]]
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        manager.accept("r", tokenizer.encode("x")[0])
    manager.shutdown()
