"""Tensor parallelism: sharded engines give the unsharded engine's and Hugging Face's greedy
outputs (chunked prefill and preemption forced together), a worker may join from a separate
`pagedllm worker` process, bad sizes are refused, and a killed worker kills the engine cleanly.

Each engine here starts N worker processes (gloo on loopback, one CPU thread each), so engines
are few and prompts short.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.model.loader import resolve_hf_dir
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.shapes import check_tp_size, valid_tp_sizes
from pagedllm.errors import EngineDeadError
from tests.hf_reference import assert_matches_reference, engine_greedy, hf_greedy
from tests.model.tiny_models import make_hf_model, save_hf_model

pytestmark = pytest.mark.slow  # tensor-parallel ranks in worker processes

MAX_NEW_TOKENS = 8
REPO_ROOT = Path(__file__).resolve().parents[2]
# Chunked prefill (an odd 37-token budget, as in tests/engine) and preemption (few KV blocks) at once.
PRESSURE = dict(max_num_batched_tokens=37, block_size=8, num_kv_blocks=14)


def _greedy(llm: LLM, prompts: list[list[int]]):
    return engine_greedy(llm, prompts, MAX_NEW_TOKENS)


def _check(llm: LLM, prompts, references, unsharded, label: str) -> None:
    results = _greedy(llm, prompts)
    assert [ids for ids, _ in results] == [ids for ids, _ in unsharded], f"{label}: differs from the unsharded engine"
    for (ids, logprobs), (_, ref_logprobs) in zip(results, unsharded):
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4), label
    verdicts = [assert_matches_reference(ids, lp, ref, f"{label}, prompt {i}")
                for i, ((ids, lp), ref) in enumerate(zip(results, references))]
    assert verdicts.count("exact") >= len(verdicts) - 1, verdicts
    assert llm.engine.core.scheduler.num_preemptions > 0, "the run was meant to preempt"
    assert llm.engine.core.check_kv_leaks() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_exited(procs, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.wait(max(0.1, deadline - time.monotonic()))


# --- shapes ------------------------------------------------------------------------------------

def test_valid_sizes_and_refusals():
    assert valid_tp_sizes(9, 3, 1536) == [1, 3]  # the default model (1536 is not a multiple of 9)
    assert valid_tp_sizes(8, 4, 128) == [1, 2, 4, 8]  # N = 8 replicates each KV head twice
    with pytest.raises(ValueError, match=r"valid sizes: 1, 3"):
        check_tp_size(2, 9, 3, 1536)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*9 query heads, 3 KV heads.*valid sizes: 1, 3"):
        LLM(tensor_parallel_size=4)  # refused before any worker starts


# --- a tiny random Llama, 8 query / 4 KV heads -------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("llama", seed=3, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=512)
    hf_model.generation_config.eos_token_id = None
    path = save_hf_model(hf_model, tmp_path_factory.mktemp("tiny84"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 70)]
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    unsharded = LLM(model=path, **PRESSURE)
    expected = _greedy(unsharded, prompts)
    assert unsharded.engine.core.scheduler.num_preemptions > 0
    return path, prompts, references, expected


def test_tiny_llama_tp4_matches_unsharded_and_hf(tiny):
    path, prompts, references, expected = tiny
    llm = LLM(model=path, tensor_parallel_size=4, **PRESSURE)
    try:
        assert not hasattr(llm.engine.core.executor, "runner") and llm.engine.core.kv_info.num_kv_heads == 1
        _check(llm, prompts, references, expected, "tiny llama, N=4")
    finally:
        llm.engine.core.shutdown()
    _assert_exited(llm.engine.core.executor.procs.values())


SECRET = "a-shared-secret-for-tests"


def _cli_worker(port: int, secret: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PAGEDLLM_DISTRIBUTED_SECRET=secret)
    return subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "worker", "--distributed-init-method",
         f"tcp://127.0.0.1:{port}", "--rank", "1", "--world-size", "2", "--num-threads", "1"], env=env, **popen,
    )


def test_tiny_llama_tp2_with_a_worker_joining_by_cli_and_an_impostor_refused(tiny):
    """Rank 1 is a separate `pagedllm worker` process, as on a second host (here: loopback). A worker
    with the wrong secret comes first: it is refused (and says so), the engine waits for the right one."""
    path, prompts, references, expected = tiny
    port = _free_port()
    impostor = _cli_worker(port, "not-the-shared-secret", stderr=subprocess.PIPE, text=True)
    remote: list[subprocess.Popen] = []

    def start_the_real_worker_once_the_impostor_is_gone():
        impostor.wait(120)
        remote.append(_cli_worker(port, SECRET))

    starter = threading.Thread(target=start_the_real_worker_once_the_impostor_is_gone, daemon=True)
    starter.start()
    try:
        llm = LLM(model=path, tensor_parallel_size=2, master_port=port, num_local_workers=1,
                  distributed_secret=SECRET, **PRESSURE)
        try:
            assert impostor.returncode == 2
            assert "rank 1 not admitted: wrong distributed secret" in impostor.stderr.read()
            assert set(llm.engine.core.executor.procs) == {0}
            _check(llm, prompts, references, expected, "tiny llama, N=2")
        finally:
            llm.engine.core.shutdown()
        assert remote[0].wait(15) == 0
    finally:
        starter.join(5)
        for proc in [impostor, *remote]:
            if proc.poll() is None:
                proc.kill()


def test_killed_worker_kills_the_engine_cleanly(tiny):
    path, prompts, _, _ = tiny
    llm = LLM(model=path, tensor_parallel_size=2, num_kv_blocks=64, distributed_timeout=30)
    engine = llm.engine
    procs = dict(engine.core.executor.procs)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1\b") as excinfo:
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"took {elapsed:.1f} s to notice"
    assert "died" in str(excinfo.value)
    _assert_exited(procs.values())  # rank 0 too
    with pytest.raises(EngineDeadError):  # dead for good: no hang on the next call either
        engine.step()


# --- the embedded default model, 9 query / 3 KV heads, N = 3 -----------------------------------

def test_default_model_tp3_matches_unsharded_and_hf():
    pressure = dict(max_num_batched_tokens=37, block_size=8, num_kv_blocks=7, quant_activations="none")  # exact
    unsharded = LLM(**pressure)
    tokenizer = unsharded.get_tokenizer()
    texts = ["Hi", "The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a land far away, there lived a", "Paged memory lets an operating system " * 3]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = _greedy(unsharded, prompts)
    assert unsharded.engine.core.scheduler.num_preemptions > 0
    hf_model = AutoModelForCausalLM.from_pretrained(resolve_hf_dir(None), dtype=torch.float32).eval()
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    del hf_model, unsharded

    llm = LLM(tensor_parallel_size=3, **pressure)
    try:
        assert llm.engine.core.kv_info.num_kv_heads == 1
        _check(llm, prompts, references, expected, "default model, N=3")
    finally:
        llm.engine.core.shutdown()
