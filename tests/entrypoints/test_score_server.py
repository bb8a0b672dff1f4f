"""POST /v1/score and /v1/rerank on a real server with a tiny random cross-encoder: scores equal to
sentence-transformers' CrossEncoder.predict, results sorted with index and relevance_score."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.engine.st_models import build_encoder_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow  # a real server in a subprocess

QUERY = "what is the capital of france?"
DOCS = ["paris", "berlin city", "the quick brown fox jumps over the lazy dog", "a river"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sentence_transformers.cross_encoder import CrossEncoder

    root = tmp_path_factory.mktemp("cross")
    CrossEncoder(str(build_encoder_dir(root / "hf", "bert", num_labels=1))).save(str(root / "ce"))
    return root / "ce"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, ["--runner", "pooling", "--served-model-name", "ce"],
                       tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_score_and_rerank_equal_cross_encoder(server, model_dir):
    from sentence_transformers.cross_encoder import CrossEncoder

    reference = CrossEncoder(str(model_dir)).predict([(QUERY, d) for d in DOCS])
    response = post(server, "/v1/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference, atol=1e-5, rtol=0)
    assert body["usage"]["prompt_tokens"] > 0

    response = post(server, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 3})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    order = np.argsort(-reference)[:3].tolist()
    assert [r["index"] for r in results] == order
    np.testing.assert_allclose([r["relevance_score"] for r in results], reference[order], atol=1e-5, rtol=0)
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order]
    bare = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCS) and "document" not in bare["results"][0]
    server.wait_idle_without_leaks()


def test_bad_score_requests_are_400(server):
    for path, body, needle in [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents is empty"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2 is empty"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n must be an integer >= 1, got -1"),
        ("/v1/rerank", {"query": QUERY, "documents": ["paris"] * 1025}, "documents has 1025 documents"),
        ("/v1/rerank", {"query": QUERY, "documents": [{"text": "paris"}]}, "documents.0: Input should be a valid string"),
        ("/v1/rerank", {"query": QUERY, "documents": "paris"}, "documents: Input should be a valid list"),
        ("/v1/rerank", {"query": 5, "documents": DOCS}, "query: Input should be a valid string"),
        ("/v1/rerank", {"documents": DOCS}, "query: Field required"),
        ("/v1/score", {"text_1": QUERY, "text_2": 5}, "text_2: Input should be str or list[str]"),
        ("/v1/embeddings", {"input": "hello"}, "cross-encoder"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "does not generate"),
    ]:
        response = post(server, path, body)
        assert response.status_code == 400 and needle in response.json()["error"]["message"], (path, response.text)
    # the server stays up and still ranks
    ok = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1})
    assert ok.status_code == 200 and len(ok.json()["results"]) == 1, ok.text
    server.wait_idle_without_leaks()
