"""Roofline of a decode step: this machine's limits, measured in the same run, vs the engine.

Measured first (fp32, torch's threads):
    bandwidth   bytes/s of a large tensor copy (read + write counted), best of several
    matmul rate flop/s of a square fp32 GEMM, best of several

For a decode step at batch B (every request adds one token, context ~C tokens):
    bytes   = every linear weight once (projections, MLP, LM head) + B * C * KV bytes per token
    flops   = B * (2 * linear params + 4 * layers * heads * head_dim * C)
    floor   = max(bytes / bandwidth, flops / matmul rate)

Then the engine runs B requests (prompt P, a few decode steps) and we time, per pure-decode
step at batch B: the whole step (schedule + prepare + forward + sample + update), the
scheduler's schedule(), the runner's input preparation, and, separately, the step's matmuls
alone (F.linear over the model's weights at B rows, no attention). Reported: floor / step
(the fraction of the machine's ceiling the engine reaches), matmuls / step (what the issue's
"within 15% of its matmuls" asks), and (schedule + prepare) / step.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.bench.common import best_time




def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src), repeats)


def measure_matmul_rate(n: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    return 2 * n**3 / best_time(lambda: a @ b, repeats)


def linear_weights(model) -> list[torch.Tensor]:
    """Every weight a decode step multiplies by (the LM head once, even when tied to the embedding)."""
    weights = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and "embed_tokens" not in name:
            weights.append(weight)
    return weights


def matmuls_alone(weights: list[torch.Tensor], batch_size: int, repeats: int = 3) -> float:
    """Seconds for one pass of F.linear over every weight at `batch_size` rows."""
    inputs = {w.shape[1]: torch.randn(batch_size, w.shape[1], dtype=w.dtype) for w in weights}

    def run():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return best_time(run, repeats)


class _StepTimer:
    """Wraps schedule(), the runner's input preparation and the whole core step with timers."""

    def __init__(self, core) -> None:
        self.records: list[dict] = []
        self._current: dict = {}
        sched, runner = core.scheduler, core.executor.runner
        orig_schedule, orig_prepare, orig_step = sched.schedule, runner.prepare_inputs, core.step

        def schedule():
            start = time.perf_counter()
            out = orig_schedule()
            self._current["schedule_s"] = time.perf_counter() - start
            self._current["num_scheduled"] = list(out.num_scheduled_tokens.values())
            return out

        def prepare(*args, **kwargs):
            start = time.perf_counter()
            out = orig_prepare(*args, **kwargs)
            self._current["prepare_s"] = time.perf_counter() - start
            return out

        def step():
            self._current = {}
            start = time.perf_counter()
            out = orig_step()
            self._current["step_s"] = time.perf_counter() - start
            self.records.append(self._current)
            return out

        sched.schedule, runner.prepare_inputs, core.step = schedule, prepare, step


def run_roofline(llm, batch_sizes: list[int], prompt_len: int = 64, decode_steps: int = 8,
                 progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from pagedllm.bench.engine_utils import engine_prompts, request_params
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    core = llm.engine.core
    model = core.executor.runner.model  # instrumentation: the roofline needs the weights themselves
    cfg = core.model_info.hf_config
    bandwidth = measure_bandwidth()
    matmul_rate = measure_matmul_rate()
    weights = linear_weights(model)
    num_linear_params = sum(w.numel() for w in weights)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    num_layers = cfg.num_hidden_layers
    num_heads = cfg.num_attention_heads
    head_dim = model.head_dim
    kv_bytes_per_token = core.kv_info.bytes_per_block // core.kv_info.block_size
    timer = _StepTimer(core)
    rows = []
    for batch_size in tqdm(batch_sizes, desc="roofline", disable=not progress, unit="batch"):
        requests = make_workload(WorkloadSpec("fixed", batch_size, max_model_len=core.scheduler_config.max_model_len,
                                              input_len=prompt_len, output_len=decode_steps + 2,
                                              vocab_size=cfg.vocab_size, seed=batch_size))
        timer.records.clear()
        llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=False)
        decode = [r for r in timer.records
                  if r.get("num_scheduled") and len(r["num_scheduled"]) == batch_size and max(r["num_scheduled"]) == 1]
        if not decode:
            continue
        step_s = statistics.median(r["step_s"] for r in decode)
        schedule_s = statistics.median(r["schedule_s"] for r in decode)
        prepare_s = statistics.median(r.get("prepare_s", 0.0) for r in decode)
        context = prompt_len + decode_steps / 2
        flops = batch_size * (2 * num_linear_params + 4 * num_layers * num_heads * head_dim * context)
        num_bytes = weight_bytes + batch_size * context * kv_bytes_per_token
        floor_s = max(num_bytes / bandwidth, flops / matmul_rate)
        mm_s = matmuls_alone(weights, batch_size)
        rows.append({
            "batch_size": batch_size, "decode_steps_timed": len(decode), "step_ms": 1e3 * step_s,
            "floor_ms": 1e3 * floor_s, "matmuls_alone_ms": 1e3 * mm_s, "schedule_ms": 1e3 * schedule_s,
            "prepare_ms": 1e3 * prepare_s, "achieved_fraction_of_floor": floor_s / step_s,
            "matmul_fraction_of_step": mm_s / step_s, "non_matmul_fraction": 1 - mm_s / step_s,
            "schedule_prepare_fraction": (schedule_s + prepare_s) / step_s,
            "engine_decode_tok_s": batch_size / step_s, "ceiling_tok_s": batch_size / floor_s,
            "bound": "memory" if num_bytes / bandwidth >= flops / matmul_rate else "compute",
        })
    return {
        "bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": matmul_rate / 1e9,
        "linear_params": num_linear_params, "weight_bytes": weight_bytes,
        "flops_per_token_linear": 2 * num_linear_params, "kv_bytes_per_token": kv_bytes_per_token,
        "prompt_len": prompt_len, "decode_steps": decode_steps, "rows": rows,
    }


def roofline_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["batch", "step ms", "floor ms", "floor / step", "matmuls ms", "matmuls / step", "sched+prep / step",
               "engine tok/s", "ceiling tok/s", "bound"]
    rows = [[r["batch_size"], r["step_ms"], r["floor_ms"], r["achieved_fraction_of_floor"], r["matmuls_alone_ms"],
             r["matmul_fraction_of_step"], r["schedule_prepare_fraction"], r["engine_decode_tok_s"],
             r["ceiling_tok_s"], r["bound"]] for r in result["rows"]]
    return headers, rows
