"""Where LoRA's cost goes: the Alpaca-like trace run offline on one engine per setting (as
scripts/lora_throughput.py), with each step's process CPU time split by kind, and the engine's counters
(steps, rows per step, prefix-cache hits, preemptions, KV blocks), settings alternated round by round.

    PYTHONPATH=$PWD python scripts/lora_step_profile.py [--adapters 0,1,4] [--rounds 2] [--num-requests 64]

"kS": k adapters with LoRA's bookkeeping but no delta kernel calls (what lies outside the kernel).
A step's kind: "decode" (every request one token) or "prefill" (some request more). Per step, the CPU time of
the runner's execute_model is split into its LoRA bookkeeping (prepare_step, step_rows), the forward pass
and the rest (inputs, sampling).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
from pathlib import Path

from pagedllm import LLM, LoRARequest
from pagedllm.bench.engine_utils import engine_prompts, request_params
from pagedllm.bench.workloads import WorkloadSpec, make_workload
from pagedllm.model.layers import fused_decoder
from scripts.lora_throughput import write_adapter


class StepClock:
    """Wraps one engine's runner: CPU seconds per step by kind, and the rows the steps ran."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.engine.core
        self.runner = self.core.executor.runner
        self.reset()
        runner, clock = self.runner, self
        execute, model = runner.execute_model, runner.model
        lora = runner.lora

        def timed_execute(sched):
            start = time.process_time()
            out = execute(sched)
            n = list(sched.num_scheduled_tokens.values())
            if n:
                kind = "decode" if max(n) == 1 else "prefill"
                clock.cpu[kind] += time.process_time() - start
                clock.steps[kind] += 1
                clock.rows[kind] += sum(n)
                clock.reqs[kind] += len(n)
            return out
        runner.execute_model = timed_execute

        class TimedModel:
            def __getattr__(self, name):
                return getattr(model, name)

            def __call__(self, *args, **kwargs):
                start = time.process_time()
                try:
                    return model(*args, **kwargs)
                finally:
                    clock.cpu["forward"] += time.process_time() - start
        runner.model = TimedModel()
        if lora is not None:
            for name in ("prepare_step", "step_rows"):
                original = getattr(lora, name)

                def timed(*args, _original=original, **kwargs):
                    start = time.process_time()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        clock.cpu["lora_meta"] += time.process_time() - start
                setattr(lora, name, timed)

    def reset(self) -> None:
        self.cpu = collections.Counter()
        self.steps = collections.Counter()
        self.rows = collections.Counter()
        self.reqs = collections.Counter()
        self.stats0 = self.core.stats()

    def summary(self) -> dict:
        stats = self.core.stats()
        return dict(
            decode_steps=self.steps["decode"], prefill_steps=self.steps["prefill"],
            decode_reqs_per_step=self.reqs["decode"] / max(1, self.steps["decode"]),
            prefill_rows_per_step=self.rows["prefill"] / max(1, self.steps["prefill"]),
            decode_ms=1e3 * self.cpu["decode"] / max(1, self.steps["decode"]),
            prefill_ms=1e3 * self.cpu["prefill"] / max(1, self.steps["prefill"]),
            cpu_decode_s=self.cpu["decode"], cpu_prefill_s=self.cpu["prefill"], cpu_forward_s=self.cpu["forward"],
            cpu_lora_meta_s=self.cpu["lora_meta"],
            prefix_hits=stats.prefix_cache_hits - self.stats0.prefix_cache_hits,
            prefix_queries=stats.prefix_cache_queries - self.stats0.prefix_cache_queries,
            preemptions=stats.num_preemptions - self.stats0.num_preemptions, kv_blocks=stats.kv_num_blocks)


def skip_deltas(llm: LLM) -> None:
    """Keep LoRA on (slots, admission, routing, segments) but drop the delta kernel's calls: what is left of
    LoRA's cost lies outside the kernel. (The outputs are the base model's: a measurement, not a mode.)"""
    runner = llm.engine.core.executor.runner
    for slots in runner.lora.slots.values():
        slots._op = lambda *args: None
    fused = runner.model.model.__dict__.get(fused_decoder._ATTR, (None, None))[1]
    if fused is not None:
        fused._lora_segments = list


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", default="0,1,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    settings = args.adapters.split(",")
    max_k = max(int(s.rstrip("LS")) for s in settings)
    requests = make_workload(WorkloadSpec(name="alpaca", num_requests=args.num_requests, max_model_len=2048))
    tmp = Path(tempfile.mkdtemp(prefix="lora-profile-"))
    engines = {}
    for setting in settings:
        kwargs = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank) if setting != "0" else {}
        engines[setting] = LLM(args.model, **kwargs)
    clocks = {s: StepClock(llm) for s, llm in engines.items()}
    hf_config = next(iter(engines.values())).engine.core.model_info.hf_config
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(tmp / f"a{i}", hf_config, args.rank, i)) for i in range(max_k)]
    params = [request_params(r) for r in requests]
    num_out = sum(r.output_len for r in requests)
    results = collections.defaultdict(list)
    for _ in range(args.rounds):
        for setting, llm in engines.items():
            k = int(setting.rstrip("LS"))
            per_request = [loras[i % k] if k else None for i in range(len(requests))]
            lora_arg = per_request if setting != "0" else None
            llm.generate(engine_prompts(requests[:k or 1]), params[:k or 1], use_tqdm=False,
                         lora_request=lora_arg[:k or 1] if lora_arg else None)
            if setting.endswith("S"):
                skip_deltas(llm)
            llm.engine.reset_prefix_cache()
            clocks[setting].reset()
            start, cpu = time.perf_counter(), time.process_time()
            llm.generate(engine_prompts(requests), params, use_tqdm=False, lora_request=lora_arg)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            row = dict(tok_s=num_out / wall, tok_cpu_s=num_out / cpu, **clocks[setting].summary())
            results[setting].append(row)
            print(setting, " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    base = statistics.median(r["tok_cpu_s"] for r in results[settings[0]])
    for setting, rows in results.items():
        print(f"{setting:>3}: median output tok per CPU s {statistics.median(r['tok_cpu_s'] for r in rows):.1f} "
              f"({statistics.median(r['tok_cpu_s'] for r in rows) / base:.2f}x)")


if __name__ == "__main__":
    main()
