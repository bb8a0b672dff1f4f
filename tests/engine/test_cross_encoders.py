"""Cross-encoders (BERT / RoBERTa *ForSequenceClassification, one label) through the engine: scores
equal to sentence-transformers' CrossEncoder.predict, rerank order equal to CrossEncoder.rank."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.errors import InvalidRequestError
from tests.engine.st_models import build_encoder_dir

QUERY = "what is the capital of france?"
DOCS = ["paris", "berlin city", "the quick brown fox jumps over the lazy dog " * 4, "a river", "hello world"]


def cross_encoder_dir(tmp_path, kind: str):
    from sentence_transformers.cross_encoder import CrossEncoder

    path = build_encoder_dir(tmp_path / "hf", kind, num_labels=1)
    CrossEncoder(str(path)).save(str(tmp_path / "ce"))
    return tmp_path / "ce"


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_scores_equal_cross_encoder_predict(kind, tmp_path):
    from sentence_transformers.cross_encoder import CrossEncoder

    path = cross_encoder_dir(tmp_path, kind)
    reference = CrossEncoder(str(path)).predict([(QUERY, d) for d in DOCS])
    assert np.ptp(reference) > 0.05  # scores far apart: equality is not a tie
    llm = LLM(str(path), runner="pooling", max_num_batched_tokens=32)
    scores = llm.score(QUERY, DOCS)
    np.testing.assert_allclose(scores, reference, atol=1e-5, rtol=0)
    pairwise = llm.score([QUERY, "hello"], ["paris", "hello world"])
    np.testing.assert_allclose(pairwise, CrossEncoder(str(path)).predict([(QUERY, "paris"), ("hello", "hello world")]),
                               atol=1e-5, rtol=0)
    ranked = llm.rerank(QUERY, DOCS, top_n=3)
    expected = CrossEncoder(str(path)).rank(QUERY, DOCS, top_k=3)
    assert [r["index"] for r in ranked] == [e["corpus_id"] for e in expected]
    assert ranked[0]["document"] == DOCS[ranked[0]["index"]]
    with pytest.raises(InvalidRequestError, match="cross-encoder"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="text_1"):
        llm.score(["a", "b"], ["c"])
    assert llm.engine.core.check_kv_leaks() == []
