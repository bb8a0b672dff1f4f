"""BERT-family encoders as embedders through the engine, against sentence-transformers on tiny random
weights: bidirectional attention, absolute positions (RoBERTa's offset), CLS and mean pooling."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.errors import ModelLoadError
from tests.engine.st_models import assert_vectors_equal, build_encoder_dir, save_st_model, st_encode

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog " * 4, "what is the capital of france?"]
ENGINE = dict(runner="pooling", dtype="float32", max_num_batched_tokens=32)

CASES = {  # kind, pooling mode, Dense, Normalize
    "bert-cls-normalize": ("bert", "cls", None, True),
    "bert-mean-dense": ("bert", "mean", (16, "tanh"), False),
    "roberta-mean-normalize": ("roberta", "mean", None, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_encoder_vectors_equal_sentence_transformers(case, tmp_path):
    kind, mode, dense, normalize = CASES[case]
    path = save_st_model(build_encoder_dir(tmp_path / "hf", kind), tmp_path / "st", mode, dense, normalize)
    llm = LLM(str(path), **ENGINE)
    assert max(len(llm.get_tokenizer().encode(t)) for t in TEXTS) > ENGINE["max_num_batched_tokens"]
    assert_vectors_equal(llm.embed(TEXTS), st_encode(path, TEXTS), case)
    assert llm.engine.core.check_kv_leaks() == []


def test_encoder_refuses_generation(tmp_path):
    path = build_encoder_dir(tmp_path / "hf", "bert")
    with pytest.raises(ModelLoadError, match="runner='pooling'"):
        LLM(str(path))
    # no sentence-transformers files: mean pooling, as sentence-transformers builds around a bare encoder
    llm = LLM(str(path), **ENGINE)
    assert_vectors_equal(llm.embed(TEXTS), st_encode(path, TEXTS), "bare encoder")


def test_many_mixed_lengths_in_one_step_attend_within_their_own_sequence(tmp_path):
    """40 inputs of 1..80 words in one step: several length groups (model/bert.py AttentionGroups), each padded
    to its longest; a padded key leaking into a shorter input, or rows scattered back to the wrong input,
    would move its vector away from sentence-transformers'."""
    import random

    from pagedllm.model.bert import AttentionGroups

    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog paged attention keeps cache in fixed size blocks".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 80))) for _ in range(40)]
    rng.shuffle(texts)
    path = save_st_model(build_encoder_dir(tmp_path / "hf", "bert"), tmp_path / "st", "mean", None, True)
    llm = LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=8192)
    lengths = sorted(len(llm.get_tokenizer().encode(t)) for t in texts)
    assert len(texts) > 2 * AttentionGroups.GROUP_SIZE and lengths[0] != lengths[-1]
    assert_vectors_equal(llm.embed(texts), st_encode(path, texts), "40 mixed lengths")
