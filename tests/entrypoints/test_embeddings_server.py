"""POST /v1/embeddings on a real server, through the official `openai` client, and `pagedllm embed`:
vectors equal to sentence-transformers' on the same tiny random model."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest

from tests.engine.st_models import assert_vectors_equal, build_decoder_dir, save_st_model, st_encode
from tests.entrypoints.server_helpers import REPO_ROOT, RemoteServer

pytestmark = pytest.mark.slow  # a real server in a subprocess

TEXTS = ["hello world", "a", "Paged attention keeps the KV cache in fixed-size blocks. " * 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedder")
    path = save_st_model(build_decoder_dir(root / "qwen3", "qwen3"), root / "st", "lasttoken", (32, "tanh"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 16]}))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, ["--runner", "pooling", "--dtype", "float32", "--served-model-name", "emb",
                                   "--num-kv-blocks", "64", "--max-num-batched-tokens", "32"],
                       tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_embeddings_equal_sentence_transformers(server, client, model_dir):
    reference = st_encode(model_dir, TEXTS)
    response = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in response.data] == [0, 1, 2]
    assert_vectors_equal([d.embedding for d in response.data], reference, "the client's default")
    as_floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert_vectors_equal([d.embedding for d in as_floats.data], reference, "float")
    as_base64 = client.embeddings.create(model="emb", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_base64.data]
    assert_vectors_equal(decoded, reference, "base64")
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(str(model_dir)).encode(t) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model="emb", input=ids, encoding_format="float")
    assert_vectors_equal([d.embedding for d in by_ids.data], reference, "token-id lists")
    one = client.embeddings.create(model="emb", input=ids[2], encoding_format="float")
    assert_vectors_equal([one.data[0].embedding], reference[2:], "one token-id list")
    short = client.embeddings.create(model="emb", input=TEXTS, dimensions=16, encoding_format="float")
    assert_vectors_equal([d.embedding for d in short.data],
                         st_encode(model_dir, TEXTS, truncate_dim=16, normalize_embeddings=True), "dimensions 16")
    server.wait_idle_without_leaks()


def test_bad_embedding_requests_are_400(server, client):
    with pytest.raises(openai.BadRequestError, match="dimensions 8"):
        client.embeddings.create(model="emb", input="hi", dimensions=8)
    too_long = [5] * 600
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.embeddings.create(model="emb", input=too_long)
    kept = client.embeddings.create(model="emb", input=too_long, extra_body={"truncate_prompt_tokens": 10},
                                    encoding_format="float")
    assert kept.usage.prompt_tokens == 10 and len(kept.data[0].embedding) == 32
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.embeddings.create(model="emb", input=[[10**9]])
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model="emb", input=[])
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.completions.create(model="emb", prompt="hi", max_tokens=2)
    response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi", "encoding_format": "hex"}, timeout=30)
    assert response.status_code == 400
    server.wait_idle_without_leaks()


BAD_INPUTS = [  # (body, what the 400's message must say): each names the field at fault
    ({"input": ""}, "input is an empty string"),
    ({"input": ["hello", ""]}, "input[1] is an empty string"),
    ({"input": [[5, 6], []]}, "input[1] is an empty list of token ids"),
    ({"input": 5}, "input: Input should be str or list[str]"),
    ({"input": None}, "input: Input should be"),
    ({}, "input: Field required"),
    ({"input": [{"text": "hello"}]}, "input.0: Input should be a valid string"),
    ({"input": [["hello", "world"]]}, "input.0.0: Input should be a valid integer"),
    ({"input": ["hello", 5]}, "input.1: Input should be a valid string"),
    ({"input": [True, 5]}, "input.0: Input should be a valid"),  # not token 1
    ({"input": ["a"] * 2049}, "input has 2049 items; at most 2048"),
    ({"input": "hi", "dimensions": "all"}, "dimensions: Input should be a valid integer"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ({"input": [[-1]]}, "vocabulary"),
]


@pytest.mark.parametrize("body, needle", BAD_INPUTS, ids=[n for _, n in BAD_INPUTS])
def test_bad_embedding_input_is_400_naming_the_field(server, body, needle):
    response = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"], response.text
    # the server stays up and serves the next request; nothing was left queued or holding blocks
    ok = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 32
    server.wait_idle_without_leaks()


def test_cli_embed_prints_json(model_dir):
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "embed",
                             *TEXTS[:2], "--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", "64"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert [d["text"] for d in output["data"]] == TEXTS[:2]
    assert_vectors_equal([d["embedding"] for d in output["data"]], st_encode(model_dir, TEXTS[:2]), "CLI")


def test_bf16_matmul_server_base64_equals_float(model_dir, tmp_path):
    """--dtype bf16-matmul over HTTP: the base64 answer decodes to the float answer exactly, both within cosine
    0.9999 of sentence-transformers."""
    srv = RemoteServer(model_dir, ["--runner", "pooling", "--dtype", "bf16-matmul", "--served-model-name", "emb",
                                   "--num-kv-blocks", "64"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        as_float = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
        as_base64 = client.embeddings.create(model="emb", input=TEXTS, encoding_format="base64")
        floats = np.asarray([d.embedding for d in as_float.data], dtype=np.float32)
        decoded = np.asarray([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_base64.data])
        assert np.array_equal(floats, decoded)
        reference = np.asarray(st_encode(model_dir, TEXTS), dtype=np.float64)
        cosine = (floats * reference).sum(1) / np.linalg.norm(floats, axis=1) / np.linalg.norm(reference, axis=1)
        assert cosine.min() >= 0.9999
    finally:
        srv.stop()
