"""Beam search through a real `pagedllm serve` and the official `openai` client, beside greedy
requests, with a KV cache small enough that beam groups are preempted: each beam request equals
Hugging Face `generate(num_beams=k)` (the beams' text and scores) and the offline LLM, each greedy
request equals its solo run, and /metrics shows the groups' preemptions and their shared blocks."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import BeamSearchParams
from tests.engine.test_beam_search import SCORE_ATOL, hf_beam_search
from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer

pytestmark = pytest.mark.slow  # a real server in a subprocess

MODEL = "tiny-beams"
GREEDY_TOKENS = 60
"""Long enough that the greedy requests alone outgrow the 40-block cache while the beams run."""
BEAMS = [  # (n, best_of, max_tokens, length_penalty, early_stopping)
    (3, None, 16, 1.0, False),
    (2, 4, 12, 0.5, "never"),
    (2, None, 16, 2.0, True),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"), initializer_range=0.3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = RemoteServer(model_dir, [
        "--served-model-name", MODEL, "--num-kv-blocks", "40", "--block-size", "4", "--max-model-len", "128",
        "--max-num-seqs", "16",
    ], tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    torch.set_num_threads(1)
    return LLM(str(model_dir), num_kv_blocks=512, block_size=4)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(8, 20))] for _ in range(n)]


def test_beam_requests_beside_greedy_ones_under_kv_pressure(server, offline, model_dir):
    beam_prompts, greedy_prompts = _prompts(len(BEAMS), 1), _prompts(5, 2)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

    async def greedy(prompt):
        return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})

    async def beam(prompt, n, best_of, max_tokens, length_penalty, early_stopping):
        return await client.completions.create(
            model=MODEL, prompt=prompt, n=n, best_of=best_of, max_tokens=max_tokens, logprobs=0,
            extra_body={"use_beam_search": True, "length_penalty": length_penalty, "early_stopping": early_stopping})

    async def run_all():
        tasks = []
        # greedy requests first: the beam groups are the newest, so the first ones preempted
        for prompt in greedy_prompts:
            tasks.append(asyncio.create_task(greedy(prompt)))
            await asyncio.sleep(0.01)
        for prompt, case in zip(beam_prompts, BEAMS):
            tasks.append(asyncio.create_task(beam(prompt, *case)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run_all())
    greedy_results, beam_results = results[:len(greedy_prompts)], results[len(greedy_prompts):]

    metrics = server.wait_idle_without_leaks()
    assert metrics["pagedllm_beam_search_group_preemptions_total"] > 0, f"no beam group was preempted: {metrics}"
    assert metrics["pagedllm_beam_search_requests_running"] == metrics["pagedllm_beam_search_beams_running"] == 0

    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    for prompt, result in zip(greedy_prompts, greedy_results):
        (alone,) = offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert result.choices[0].text == alone.outputs[0].text

    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = offline.engine.input_processor.eos_token_ids
    for prompt, (n, best_of, max_tokens, length_penalty, early_stopping), result in zip(beam_prompts, BEAMS,
                                                                                      beam_results):
        params = BeamSearchParams(max(n, best_of or n), max_tokens=max_tokens, length_penalty=length_penalty,
                                  early_stopping=early_stopping, num_return_sequences=n)
        hf_tokens, hf_scores = hf_beam_search(hf_model, prompt, params, eos)
        (ours,) = offline.beam_search({"prompt_token_ids": prompt}, params)
        assert [s.token_ids for s in ours.sequences] == hf_tokens
        choices = sorted(result.choices, key=lambda c: c.index)
        assert [c.index for c in choices] == list(range(n))
        for choice, seq, hf_score in zip(choices, ours.sequences, hf_scores):
            assert choice.text == seq.text
            token_logprobs = choice.logprobs.token_logprobs
            assert len(token_logprobs) == len(seq.token_ids)
            score = sum(token_logprobs) / len(token_logprobs) ** length_penalty
            assert abs(score - hf_score) < SCORE_ATOL, (score, hf_score)


def test_beam_search_streams_its_final_beams_and_works_in_chat(server, offline):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    (prompt,) = _prompts(1, 3)
    beam_body = {"use_beam_search": True, "length_penalty": 1.0}
    whole = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, extra_body=beam_body)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    num_chunks = 0
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, stream=True,
                                           extra_body=beam_body):
        num_chunks += 1
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}

    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_completion_tokens=6,
                                          extra_body=beam_body)
    (ours,) = offline.beam_search({"prompt_token_ids": offline.encode_chat(messages)},
                                  BeamSearchParams(2, max_tokens=6))
    assert [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)] == [s.text for s in ours.sequences]


@pytest.mark.parametrize("body, needle", [
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": True, "n": 11}, "10 beams"),
    ({"use_beam_search": True, "n": 2, "best_of": 1}, "best_of"),
])
def test_bad_beam_requests_are_400s(server, body, needle):
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert needle in response.text
