"""LoRA adapters behind two data-parallel replicas (`-dp 2`): an adapter named at start-up and one loaded at
run time are served by both replicas (each reads the weights the first time a request names it), greedy outputs
equal HF + PEFT's whichever replica ran them, unloading reaches every replica (404 after), no block leaks."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer
from tests.entrypoints.test_dp_server import by_replica, wait_replicas_idle
from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import ALL_PROJECTIONS, load_peft_reference, make_adapter

pytestmark = pytest.mark.slow  # a real server with two engine cores
pytest.importorskip("peft")

MAX_TOKENS = 8
PROMPTS = [[1, 450, 7041, 310, 3444, 338], [1, 9038, 2501, 263, 931, 29892, 727, 471, 263, 2217, 7875, 20134]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama-lora-dp"), initializer_range=0.3)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    base.generation_config.eos_token_id = None
    adapters = {
        "at-start": make_adapter(base, tmp_path_factory.mktemp("at-start"), rank=8, alpha=16,
                                 target_modules=ALL_PROJECTIONS, seed=3, std=0.3),
        "at-runtime": make_adapter(base, tmp_path_factory.mktemp("at-runtime"), rank=4, alpha=8,
                                   target_modules=ALL_PROJECTIONS, seed=4, std=0.3),
    }
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = {}
    for name, path in adapters.items():
        peft_model = load_peft_reference(base, path)
        texts[name] = [tokenizer.decode(hf_greedy(peft_model, p, MAX_TOKENS).token_ids) for p in PROMPTS]
    srv = RemoteServer(model_dir, [
        "--served-model-name", "tiny", "-dp", "2", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"at-start={adapters['at-start']}", "--allow-runtime-lora-updating",
        "--num-kv-blocks", "128", "--block-size", "4", "--max-num-seqs", "2",
    ], tmp_path_factory.mktemp("logs") / "lora-dp-server.log")
    yield srv, adapters, texts
    srv.stop()


def _send_all(srv: RemoteServer, model: str) -> list[str]:
    """Each prompt twice, all at once: least-loaded routing puts them on both replicas."""
    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused")

    async def one(prompt):
        response = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})
        return response.choices[0].text

    async def everything():
        return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(2 * len(PROMPTS))))

    return asyncio.run(everything())


def test_adapters_from_start_and_runtime_are_served_by_both_replicas(setup):
    srv, adapters, texts = setup
    routed_before = by_replica(srv, "pagedllm_routing_decisions_total")
    assert _send_all(srv, "at-start") == texts["at-start"] * 2

    response = httpx.post(f"{srv.url}/v1/load_lora_adapter",
                          json={"lora_name": "at-runtime", "lora_path": adapters["at-runtime"]})
    assert response.status_code == 200, response.text
    assert _send_all(srv, "at-runtime") == texts["at-runtime"] * 2

    routed = by_replica(srv, "pagedllm_routing_decisions_total")
    sent = {r: routed[r] - routed_before.get(r, 0.0) for r in routed}
    assert set(sent) == {"0", "1"} and all(n >= 2 for n in sent.values()), sent  # both replicas ran adapters
    wait_replicas_idle(srv, {"0", "1"})

    unload = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "at-runtime"})
    assert unload.status_code == 200, unload.text
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    for _ in range(2):  # whichever replica would have taken it
        with pytest.raises(openai.NotFoundError, match="'at-runtime' does not exist"):
            client.completions.create(model="at-runtime", prompt=PROMPTS[0], max_tokens=2)
    assert _send_all(srv, "at-start") == texts["at-start"] * 2  # the other adapter is untouched
