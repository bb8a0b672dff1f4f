"""Where a decode step's time goes: matmuls, attention, everything else (batch B x context C).

B requests with distinct random C-token prompts are prefilled (alone, one output token each, so
their full blocks stay in the prefix cache), then submitted again: they hit the cache and start
decoding together, each over its own blocks. The engine then steps while every one of them
decodes (one token each per step). For those steps, forward hooks time:

    matmuls    every linear layer of the model (modules of model/layers/linear.py) and the LM
               head (model.compute_logits)
    attention  every `Attention` layer: the KV-cache write and the attention over the block tables
    other      the rest of LLMEngine.step(): embedding, norms, rotary, activation, sampling, input
               preparation, the scheduler, output processing

Hooks measure wall time around each module call on the host (CPU ops run synchronously); on a
GPU the shares would need synchronization and are not meaningful. Steps alternate: one without
hooks (the median of those is the step time reported), one with them (the shares: medians per
category), so both see the same load from whatever else runs on the machine. `--torch-profiler`
also writes torch.profiler's top operators of one decode step without hooks (OUT/profile_ops.txt).
`--compare-fused-ops` alternates each pair with a pair run with the fused small CPU ops (norms,
rotary, SiLU: model/layers/cpu_fused.py) switched off, and reports both, side by side;
`--compare-op-pool` does the same with the compiled ops' own spinning worker threads switched off
(csrc/thread_pool.cpp: the ops then run on torch's passive OpenMP threads).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from pagedllm.bench.engine_utils import request_params
from pagedllm.bench.trace_efficiency import StepRecorder
from pagedllm.bench.workloads import BenchRequest, WorkloadSpec, make_workload


HEAD_METHODS = ("compute_logits", "greedy_token_ids")


class ModuleTimer:
    """Sums host wall time per category over module calls (forward hooks), step by step."""

    def __init__(self, model) -> None:
        from pagedllm.model.layers.linear import LinearBase

        self.totals: dict[str, float] = defaultdict(float)
        self._handles = []
        self._starts: dict[int, float] = {}
        for module in model.modules():
            category = ("matmuls" if isinstance(module, LinearBase)
                        else "attention" if type(module).__name__ == "Attention" else None)
            if category is not None:
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post(category)))
        self._model = model
        # The LM head runs as compute_logits, or as greedy_token_ids where only argmaxes are wanted.
        self._head_methods = [name for name in HEAD_METHODS if hasattr(model, name)]
        for name in self._head_methods:
            setattr(model, name, self._timed_head(getattr(model, name)))  # removed again in remove()

    def _timed_head(self, method):
        def timed(hidden_states):
            start = time.perf_counter()
            out = method(hidden_states)
            self.totals["matmuls"] += time.perf_counter() - start
            self.totals["lm_head"] += time.perf_counter() - start
            return out
        return timed

    def _pre(self, module, args) -> None:
        self._starts[id(module)] = time.perf_counter()

    def _post(self, category: str):
        def hook(module, args, output) -> None:
            self.totals[category] += time.perf_counter() - self._starts.pop(id(module))
        return hook

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for name in self._head_methods:
            delattr(self._model, name)


def _step_until(engine, recorder: StepRecorder, batch_size: int, limit: int) -> None:
    """Step until a step decodes the whole batch (the prefill is over)."""
    for _ in range(limit):
        engine.step()
        last = recorder.steps[-1] if recorder.steps else None
        if last and last.num_seqs == batch_size and last.kind == "decode":
            return
    raise RuntimeError(f"no full-batch decode step after {limit} steps (KV budget too small for the batch?)")


def _decode_steps(engine, recorder: StepRecorder, batch_size: int, count: int, model=None):
    """Per pair of steps, one plain and one hooked (alternating, so both see the same machine load):
    (plain wall s, hooked wall s, module totals), keeping pairs where both decoded the whole batch."""
    out = []
    for _ in range(count):
        pair = []
        for hooked in (False, True):
            timer = ModuleTimer(model) if hooked else None  # hooks attached only around the hooked step
            try:
                start = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - start
            finally:
                if timer is not None:
                    timer.remove()
            last = recorder.steps[-1]
            pair.append((wall, timer.totals if timer else {}, last.num_seqs == batch_size and last.kind == "decode"))
        if pair[0][2] and pair[1][2]:
            out.append((pair[0][0], pair[1][0], pair[1][1]))
    return out


def timed_decode_steps(args) -> int:
    """Decode steps a profile times per mode: twice as many with a --compare-* switch (on, then off)."""
    return args.decode_steps * (2 if compare_switch(args) else 1)


def compare_switch(args) -> str | None:
    """The A/B switch a profile alternates: "fused_ops", "op_pool" or None (one at most)."""
    chosen = [name for name in ("fused_ops", "op_pool") if getattr(args, f"compare_{name}", False)]
    if len(chosen) > 1:
        raise ValueError("--compare-fused-ops and --compare-op-pool each alternate steps on/off: give one of them")
    return chosen[0] if chosen else None


def _set_switch(switch: str, enabled: bool) -> None:
    if switch == "fused_ops":
        from pagedllm.model.layers import cpu_fused

        cpu_fused.set_enabled(enabled)
    else:
        from pagedllm.model.attention import cpu_op

        if cpu_op.op_pool(enabled=enabled) is None:
            raise RuntimeError(f"--compare-op-pool needs the compiled CPU ops: {cpu_op.unavailable_reason()}")


def profile_output_len(batch_size: int, context_len: int, decode_steps: int, max_num_batched_tokens: int) -> int:
    """Tokens each request generates: enough that none finishes before the last profiled step.

    The prefill is chunked, so the first requests decode while the last ones still prefill."""
    prefill_steps = -(-batch_size * context_len // max_num_batched_tokens)
    return prefill_steps + 2 * decode_steps + 6


def _alternating_decode_steps(engine, recorder, batch_size: int, count: int, model, switch: str):
    """``count`` pairs of steps with ``switch`` on, each followed by a pair with it off (so both see
    the same load): (on steps, off steps), as ``_decode_steps`` returns them."""
    on, off = [], []
    try:
        for _ in range(count):
            for enabled, sink in ((True, on), (False, off)):
                _set_switch(switch, enabled)
                sink += _decode_steps(engine, recorder, batch_size, 1, model)
    finally:
        _set_switch(switch, True)
    return on, off


def _summary(steps, model, batch_size: int) -> dict:
    step_s = statistics.median(plain for plain, _, _ in steps)
    hooked_s = statistics.median(hooked for _, hooked, _ in steps)
    shares = {}
    for category in ("matmuls", "attention"):
        shares[category] = statistics.median(t.get(category, 0.0) / w for _, w, t in steps)
    shares["other"] = 1.0 - shares["matmuls"] - shares["attention"]
    lm_head = statistics.median(t.get("lm_head", 0.0) / w for _, w, t in steps)
    num_attention_layers = sum(1 for m in model.modules() if type(m).__name__ == "Attention")
    return {
        "decode_steps_timed": len(steps), "step_ms": 1e3 * step_s, "hooked_step_ms": 1e3 * hooked_s,
        "decode_tok_s": batch_size / step_s, "shares": shares, "lm_head_share": lm_head,
        "ms": {k: v * hooked_s * 1e3 for k, v in shares.items()},
        "attention_ms_per_layer": shares["attention"] * hooked_s * 1e3 / max(1, num_attention_layers),
    }


def run_step_profile(llm, batch_size: int, context_len: int, decode_steps: int = 5, torch_profiler: bool = False,
                     out_dir=None, compare: str | None = None) -> dict:
    engine = llm.engine
    core = engine.core
    model = core.executor.runner.model  # instrumentation: hooks on the model's own modules
    requests = make_workload(WorkloadSpec("fixed", batch_size, max_model_len=core.scheduler_config.max_model_len,
                                          input_len=context_len, output_len=profile_output_len(
                                              batch_size, context_len, decode_steps * (2 if compare else 1),
                                              core.scheduler_config.max_num_batched_tokens),
                                          vocab_size=core.model_info.hf_config.vocab_size, seed=batch_size))
    prefill_start = time.perf_counter()
    # Prefill alone first (one token each, so no step mixes decodes in), leaving every prompt's full
    # blocks in the prefix cache: the batch below then starts decoding at once, over distinct blocks.
    # Without prefix caching the batch prefills in chunks, mixed with the decodes of the first requests.
    if core.cache_config.enable_prefix_caching:
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                     [request_params(BenchRequest(r.prompt_token_ids, 1)) for r in requests], use_tqdm=False)
    hits_before = engine.stats().prefix_cache_hits
    for i, r in enumerate(requests):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": r.prompt_token_ids}, request_params(r))
    preemptions_before = engine.stats().num_preemptions
    with StepRecorder(core) as recorder:
        _step_until(engine, recorder, batch_size, limit=4 * batch_size * context_len)
        prefill_s = time.perf_counter() - prefill_start
        ops_table = None
        if torch_profiler:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            ops_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        if compare:
            steps, off_steps = _alternating_decode_steps(engine, recorder, batch_size, decode_steps, model, compare)
        else:
            steps, off_steps = _decode_steps(engine, recorder, batch_size, decode_steps, model), None
    engine.abort_request([f"profile-{i}" for i in range(batch_size)])
    while engine.has_unfinished_requests():
        engine.step()
    if not steps or (off_steps is not None and not off_steps):
        raise RuntimeError("the batch stopped decoding together before the profile ended")
    if ops_table is not None and out_dir is not None:
        (out_dir / "profile_ops.txt").write_text(ops_table + "\n")
    result = {
        "batch_size": batch_size, "context_len": context_len, **_summary(steps, model, batch_size),
        "prefill_s": prefill_s, "num_preemptions": engine.stats().num_preemptions - preemptions_before,
        "prefix_cache_hit_tokens": engine.stats().prefix_cache_hits - hits_before,
        "torch_profiler_ops": ops_table is not None,
    }
    if off_steps is not None:
        result[f"{compare}_off"] = {"batch_size": batch_size, "context_len": context_len,
                                   **_summary(off_steps, model, batch_size)}
    return result


def profile_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["batch x context", "step ms (no hooks)", "matmuls", "of which LM head", "attention", "other",
               "attention ms / layer", "decode tok/s"]
    s = result["shares"]
    return headers, [[f"{result['batch_size']} x {result['context_len']}", result["step_ms"],
                      f"{100 * s['matmuls']:.1f}%", f"{100 * result['lm_head_share']:.1f}%",
                      f"{100 * s['attention']:.1f}%", f"{100 * s['other']:.1f}%", result["attention_ms_per_layer"],
                      result["decode_tok_s"]]]
