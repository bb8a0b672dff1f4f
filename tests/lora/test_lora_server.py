"""LoRA adapters through a real `pagedllm serve` and the official openai client: adapters as models, greedy
outputs (decoded) equal to HF + PEFT's in one concurrent mix of the base and two adapters (max_loras 2, chunked
prefill), /v1/models, 404s, runtime load/unload behind the API key."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer
from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import ALL_PROJECTIONS, load_peft_reference, make_adapter

pytestmark = pytest.mark.slow  # a real server in a subprocess
pytest.importorskip("peft")

KEY = "lora-test-key"
MAX_TOKENS = 8
PROMPTS = [[1, 450, 7041, 310, 3444, 338], [1, 9038, 2501, 263, 931, 29892, 727, 471, 263, 2217, 7875, 20134]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-lora"), initializer_range=0.3)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    base.generation_config.eos_token_id = None
    adapters = {
        "ad-r8": make_adapter(base, tmp_path_factory.mktemp("ad-r8"), rank=8, alpha=16,
                              target_modules=ALL_PROJECTIONS, seed=0, std=0.3),
        "ad-r4": make_adapter(base, tmp_path_factory.mktemp("ad-r4"), rank=4, alpha=8,
                              target_modules=ALL_PROJECTIONS, seed=1, std=0.3, use_rslora=True),
        "ad-late": make_adapter(base, tmp_path_factory.mktemp("ad-late"), rank=8, alpha=8,
                                target_modules=["q_proj", "v_proj", "down_proj"], seed=2, std=0.3),
    }
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    references = {"tiny": [hf_greedy(base, p, MAX_TOKENS).token_ids for p in PROMPTS]}
    for name, path in adapters.items():
        peft_model = load_peft_reference(base, path)
        references[name] = [hf_greedy(peft_model, p, MAX_TOKENS).token_ids for p in PROMPTS]
        assert references[name] != references["tiny"], name
    texts = {name: [tokenizer.decode(ids) for ids in refs] for name, refs in references.items()}
    srv = RemoteServer(model_dir, [
        "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"ad-r8={adapters['ad-r8']}", "--lora-modules", f"ad-r4={adapters['ad-r4']}",
        "--allow-runtime-lora-updating", "--api-key", KEY, "--num-kv-blocks", "256", "--block-size", "4",
        "--max-num-batched-tokens", "13",
    ], tmp_path_factory.mktemp("logs") / "lora-server.log")
    yield srv, adapters, texts
    srv.stop()


def _headers():
    return {"Authorization": f"Bearer {KEY}"}


def test_models_lists_base_and_adapters_with_parent(setup):
    srv, _, _ = setup
    models = {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models", headers=_headers()).json()["data"]}
    assert set(models) == {"tiny", "ad-r8", "ad-r4"}
    assert "parent" not in models["tiny"]
    assert models["ad-r8"]["parent"] == models["ad-r4"]["parent"] == "tiny"


def test_adapters_and_base_mixed_concurrently_match_peft(setup):
    srv, _, references = setup
    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY)

    async def one(model, prompt):
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})
        return response.choices[0].text

    async def everything():
        jobs = [(model, i) for model in ("tiny", "ad-r8", "ad-r4") for i in range(len(PROMPTS))]
        results = await asyncio.gather(*(one(model, PROMPTS[i]) for model, i in jobs))
        return dict(zip(jobs, results))

    for (model, i), text in asyncio.run(everything()).items():
        assert text == references[model][i], (model, i)
    srv.wait_idle_without_leaks()
    metrics = httpx.get(f"{srv.url}/metrics").text
    for name in ("ad-r8", "ad-r4"):  # per-adapter counts; nothing left waiting or running
        labels = f'lora_name="{name}",model_name="tiny"'
        assert f"pagedllm_lora_requests_total{{{labels}}} {float(len(PROMPTS))}" in metrics, metrics
        assert f"pagedllm_lora_requests_waiting{{{labels}}} 0.0" in metrics
        assert f"pagedllm_lora_requests_running{{{labels}}} 0.0" in metrics


def test_unknown_adapter_is_404_naming_it(setup):
    srv, _, _ = setup
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
    with pytest.raises(openai.NotFoundError, match="'no-such-adapter' does not exist"):
        client.completions.create(model="no-such-adapter", prompt=PROMPTS[0], max_tokens=2)


def test_runtime_load_use_unload_then_404(setup):
    srv, adapters, references = setup
    url = f"{srv.url}/v1/load_lora_adapter"
    body = {"lora_name": "ad-late", "lora_path": adapters["ad-late"]}
    assert httpx.post(url, json=body).status_code == 401  # behind the API key
    response = httpx.post(url, json=body, headers=_headers())
    assert response.status_code == 200, response.text
    assert httpx.post(url, json=body, headers=_headers()).status_code == 400  # the name is taken
    bad = httpx.post(url, json={"lora_name": "x", "lora_path": "/no/such/dir"}, headers=_headers())
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]

    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
    out = client.completions.create(model="ad-late", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == references["ad-late"][1]

    unload = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "ad-late"}, headers=_headers())
    assert unload.status_code == 200, unload.text
    with pytest.raises(openai.NotFoundError, match="'ad-late' does not exist"):
        client.completions.create(model="ad-late", prompt=PROMPTS[1], max_tokens=2)
    again = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "ad-late"}, headers=_headers())
    assert again.status_code == 404 and "'ad-late' is not loaded" in again.json()["error"]["message"]
