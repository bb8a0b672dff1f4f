"""BERT-family encoders as embedders through the engine, against sentence-transformers on tiny random
weights: bidirectional attention, absolute positions (RoBERTa's offset), CLS and mean pooling."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.errors import ModelLoadError
from tests.engine.st_models import assert_vectors_equal, build_encoder_dir, save_st_model, st_encode

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog " * 4, "what is the capital of france?"]
ENGINE = dict(runner="pooling", max_num_batched_tokens=32)

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
