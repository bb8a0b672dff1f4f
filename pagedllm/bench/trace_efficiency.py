"""Trace efficiency: the engine's wall time on a trace vs the matmul-only ideal of the same trace.

While the engine runs the trace, a step listener (EngineCore.step_listeners) records each step's
shape: the tokens it scheduled (rows through every linear layer of every decoder layer) and the
sequences it sampled (rows through the LM head). Afterwards, in the same process and with the
same threads, the model's own layers are timed alone on random inputs at a grid of row counts:

    linear(M)  one pass of every linear layer of the model (QKV, O, gate/up, down; all layers) at M rows;
               in a mixture-of-experts layer, its router and only the experts M rows are routed to,
               each over its own rows (``moe_groups``: the layer's router on the random rows picks
               them, top_k per row, as a step's real rows would be routed), not all the experts
    head(M)    the LM head at M rows, as a greedy step runs it: model.greedy_token_ids where it
               applies (the exact bfloat16-candidates head, model/layers/greedy_head.py), else
               model.compute_logits (float32 logits)

each the best of at least 3 repeats (more for cheap shapes); between grid points the time is
interpolated linearly in M. The grid is timed twice, before the trace (up to the scheduler's
limits) and after it (up to the largest step seen), and each point keeps the faster of the two:
on a shared machine a slow spell during one grid would otherwise inflate the ideal (measured: one
grid ran 30-65% slower than another an hour apart, and a run's efficiency read 61.6% then 49.7%).
Then

    ideal       = sum over steps of linear(tokens of the step) + head(sequences sampled in it)
    efficiency  = ideal / engine wall time (the whole generate call: scheduling, input
                  preparation, attention, norms, sampling, detokenization all count as overhead)

Attention cannot cost less than reading the KV cache it attends over, and on long contexts that
read is as large as the weights' (the default model in float32: 46 KB of K and V per token of
context, so 14 sequences at context 800 read 0.5 GB a step, about its 0.54 GB of weights). So each
step also records `kv_tokens`, the tokens of context its attention reads (every scheduled
request's context after the step: computed tokens plus the tokens scheduled), and with the KV
cache's bytes per token and this machine's read bandwidth (bench/attention.py's read_bandwidth,
timed before and after the trace, the faster kept)

    kv_read     = sum over steps of kv_tokens * KV bytes per token / read bandwidth
    roofline    = (ideal + kv_read) / engine wall time

the share of the wall time that weights and KV reads alone explain: what no float32 engine on
this machine could go below, given the same steps (speculative steps count their proposals'
slots as context, a slight overcount).

The layers are called through their modules (not F.linear on their weights), so a faster weight
layout or GEMM call in model/layers is what the ideal measures too. Steps are also split by kind
(pure decode, pure prefill, mixed) with their wall time and ideal, to show where the gap is.

With the model given, the recorder also times each step's model forward and LM head (hooks around
the model's own calls): a step's `forward_s`. The rest of its wall time, `host_s`, is what the
engine loop spends outside the model: scheduling, input preparation, sampling, the scheduler's
update, output processing and detokenization, Python between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepShape:
    num_tokens: int
    """Tokens scheduled in the step: rows through the linear layers."""
    num_sampled: int
    """Sequences that got logits (rows through the LM head)."""
    num_seqs: int
    num_single: int
    """Sequences scheduled for one token (decodes)."""
    end_s: float
    """perf_counter() when the step's model run returned."""
    forward_s: float | None = None
    """Seconds in the model's forward and LM head during the step (None: not timed)."""
    kv_tokens: int = 0
    """Tokens of context the step's attention reads: each scheduled request's computed tokens plus
    the tokens scheduled for it."""

    @property
    def kind(self) -> str:
        """decode: one token per sequence; prefill: only multi-token chunks; mixed: both."""
        if self.num_single == self.num_seqs:
            return "decode"
        return "prefill" if self.num_single == 0 else "mixed"


class ForwardTimer:
    """Sums wall time in a model's forward and its compute_logits (hooks; removed by `remove`)."""

    def __init__(self, model) -> None:
        self.total_s = 0.0
        self._start = 0.0
        self._model = model
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]
        # The LM head runs as compute_logits, or as greedy_token_ids where only argmaxes are wanted.
        self._head_methods = [name for name in ("compute_logits", "greedy_token_ids") if hasattr(model, name)]
        for name in self._head_methods:
            setattr(model, name, self._timed(getattr(model, name)))  # instance attributes, deleted by remove()

    def _timed(self, method):
        def timed(hidden_states):
            start = time.perf_counter()
            try:
                return method(hidden_states)
            finally:
                self.total_s += time.perf_counter() - start
        return timed

    def _pre(self, module, args) -> None:
        self._start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.total_s += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for name in self._head_methods:
            delattr(self._model, name)


class StepRecorder:
    """Records every step's shape through EngineCore's public step listeners (a context manager).

    `model`: also time each step's forward and LM head (StepShape.forward_s)."""

    def __init__(self, core, model=None) -> None:
        self.core = core
        self.model = model
        self.steps: list[StepShape] = []
        self._timer: ForwardTimer | None = None
        self._forward_before = 0.0

    def __call__(self, sched_output, runner_output) -> None:
        scheduled = sched_output.num_scheduled_tokens
        forward_s = None
        if self._timer is not None:
            forward_s = self._timer.total_s - self._forward_before
            self._forward_before = self._timer.total_s
        kv_tokens = sum(req.num_computed_tokens + scheduled.get(req.req_id, 0)
                        for reqs in (sched_output.scheduled_new_reqs, sched_output.scheduled_cached_reqs)
                        for req in reqs)
        self.steps.append(StepShape(sched_output.total_num_scheduled_tokens, len(runner_output.sampled_token_ids),
                                    len(scheduled), sum(1 for n in scheduled.values() if n == 1),
                                    time.perf_counter(), forward_s, kv_tokens))

    def __enter__(self) -> StepRecorder:
        if self.model is not None:
            self._timer = ForwardTimer(self.model)
        self.core.step_listeners.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.core.step_listeners.remove(self)
        if self._timer is not None:
            self._timer.remove()
            self._timer = None


def linear_modules(model) -> list[tuple[torch.nn.Module, int]]:
    """(module, input features) of every linear layer a token passes through, LM head excluded."""
    from pagedllm.model.layers.linear import LinearBase

    return [(m, getattr(m, "input_size_per_partition", m.input_size))
            for m in model.modules() if isinstance(m, LinearBase)]


def moe_layers(model) -> list[torch.nn.Module]:
    """The model's sparse mixture-of-experts MLPs (model/layers/moe.py), if any."""
    from pagedllm.model.layers.moe import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def moe_groups(moe, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(expert, its rows of ``x``) for each expert the layer's router sends at least one row of
    ``x`` to: the GEMMs the routed rows need (len(x) * top_k rows in all)."""
    _, expert_ids = moe.route(x)
    return [(e, x[(expert_ids == e).any(-1)]) for e in expert_ids.unique().tolist()]


def _best_of(fn, repeats: int, budget_s: float = 1.0, max_repeats: int = 20) -> float:
    """Best of `repeats` runs, and of more (up to `max_repeats`) while they fit in `budget_s`:
    cheap shapes get more tries, which matters on a shared, noisy machine."""
    fn()  # warm-up (first-touch of the output buffers, MKL's per-shape setup)
    best = float("inf")
    spent = 0.0
    count = 0
    while count < repeats or (count < max_repeats and spent + best < budget_s):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        spent += elapsed
        count += 1
    return best


def _grid(max_rows: int) -> list[int]:
    """Powers of two up to max_rows, and max_rows itself."""
    grid = [1]
    while grid[-1] * 2 < max_rows:
        grid.append(grid[-1] * 2)
    if max_rows > 1:
        grid.append(max_rows)
    return grid


@torch.inference_mode()
def time_matmul_grid(model, max_tokens: int, max_sampled: int, repeats: int = 3) -> dict:
    """Seconds of linear(M) and head(M) at a grid of M (see the module docstring)."""
    from pagedllm.model.layers.greedy_head import GreedyFallback

    linears = linear_modules(model)
    assert linears, "no linear layers found in the model"
    moes = moe_layers(model)
    param = next(model.parameters())
    hidden = model.config.hidden_size
    out = {"linear": {}, "head": {}}
    for m in _grid(max_tokens):
        inputs = {n: torch.randn(m, n, dtype=param.dtype, device=param.device) for n in {n for _, n in linears}}
        x = torch.randn(m, hidden, dtype=param.dtype, device=param.device)
        routed = [(moe, moe_groups(moe, x)) for moe in moes]

        def run_linears():
            for module, n in linears:
                module(inputs[n])
            for moe, groups in routed:
                moe.gate(x)  # the router's GEMM
                for expert, rows in groups:
                    moe.expert_mlp(expert, rows)

        out["linear"][m] = _best_of(run_linears, repeats)
    for m in _grid(max(1, max_sampled)):
        x = torch.randn(m, hidden, dtype=param.dtype, device=param.device)
        # As a greedy step runs the head (the benchmarks' traces are greedy): the exact greedy
        # head where the model has one for m rows (layers/greedy_head.py), else the logits.
        greedy = getattr(model, "greedy_token_ids", None)
        head = greedy if greedy is not None and not isinstance(greedy(x), GreedyFallback) else model.compute_logits
        out["head"][m] = _best_of(lambda: head(x), repeats)
    return out


def fastest_of(grid: dict, earlier: dict | None) -> dict:
    """Each point of `grid` at the faster of its time and `earlier`'s at the same row count."""
    if not earlier:
        return grid
    return {kind: {m: min(t, earlier.get(kind, {}).get(m, t)) for m, t in points.items()}
            for kind, points in grid.items()}


def kv_bytes_per_token(kv_caches: list[torch.Tensor]) -> int:
    """Bytes of K and V, over all layers, that one token of context occupies (caches shaped
    [2, num_blocks, block_size, ...], worker/kv_cache.py)."""
    return sum(cache.numel() * cache.element_size() // (cache.shape[1] * cache.shape[2]) for cache in kv_caches)


def _interp(grid: dict[int, float], rows: np.ndarray) -> np.ndarray:
    ms = np.array(sorted(grid), dtype=np.float64)
    ts = np.array([grid[m] for m in sorted(grid)])
    return np.where(rows > 0, np.interp(rows, ms, ts), 0.0)


def ideal_seconds(steps: list[StepShape], grid: dict) -> np.ndarray:
    """Per step: the matmul-only time of its shape."""
    tokens = np.array([s.num_tokens for s in steps], dtype=np.float64)
    sampled = np.array([s.num_sampled for s in steps], dtype=np.float64)
    return _interp(grid["linear"], tokens) + _interp(grid["head"], sampled)


def efficiency_result(steps: list[StepShape], start_s: float, wall_s: float, model, num_preemptions: int,
                      repeats: int = 3, grid_before: dict | None = None, kv_bytes: int | None = None,
                      bandwidth_before: float | None = None) -> dict:
    """The trace-efficiency figures of one engine run (`steps` recorded from `start_s`, lasting `wall_s`);
    `grid_before`: a time_matmul_grid taken before the run, whose faster points are kept. With
    `kv_bytes` (kv_bytes_per_token of the engine's caches) also the KV-read term and the roofline
    share; `bandwidth_before`: read_bandwidth() taken before the run (the larger is kept)."""
    if not steps:
        raise ValueError("no engine steps were recorded")
    max_tokens, max_sampled = max(s.num_tokens for s in steps), max(s.num_sampled for s in steps)
    grid = fastest_of(time_matmul_grid(model, max_tokens, max_sampled, repeats), grid_before)
    bandwidth = None
    if kv_bytes is not None:
        from pagedllm.bench.attention import read_bandwidth

        bandwidth = max(read_bandwidth(), bandwidth_before or 0.0)
    return score_steps(steps, start_s, wall_s, grid, num_preemptions, kv_bytes, bandwidth)


def union_of(grids: list[dict]) -> dict:
    """Every row count timed in any of `grids`, each at its fastest: one grid covering several runs'
    steps (fastest_of keeps only the first grid's points, which may stop short of another run's)."""
    out: dict = {}
    for grid in grids:
        for kind, points in grid.items():
            merged = out.setdefault(kind, {})
            for m, t in points.items():
                merged[m] = min(t, merged.get(m, t))
    return {kind: dict(sorted(points.items())) for kind, points in out.items()}


def grid_of(result: dict) -> dict:
    """The matmul grid an efficiency result was scored with (its JSON form has string row counts)."""
    return {kind: {int(m): t for m, t in points.items()} for kind, points in result["matmul_grid_s"].items()}


def score_steps(steps: list[StepShape], start_s: float, wall_s: float, grid: dict, num_preemptions: int,
                kv_bytes: int | None = None, bandwidth: float | None = None) -> dict:
    """efficiency_result's figures for a given matmul grid (and, with `kv_bytes`, read `bandwidth` in
    bytes/s): so several runs of one trace can be scored against the same, fastest, grid."""
    if not steps:
        raise ValueError("no engine steps were recorded")
    max_tokens, max_sampled = max(s.num_tokens for s in steps), max(s.num_sampled for s in steps)
    ideal = ideal_seconds(steps, grid)
    kv_read = None
    roofline = {}
    if kv_bytes is not None:
        kv_read = np.array([s.kv_tokens for s in steps], dtype=np.float64) * kv_bytes / bandwidth
        roofline = {"kv_bytes_per_token": kv_bytes, "read_gb_s": bandwidth / 1e9, "kv_read_s": float(kv_read.sum()),
                    "roofline": float(ideal.sum() + kv_read.sum()) / wall_s}
    ends = np.array([s.end_s for s in steps])
    durations = np.diff(np.concatenate([[start_s], ends]))  # step i: end of step i-1 (or the start) to its end
    timed = all(s.forward_s is not None for s in steps)
    forward = np.array([s.forward_s for s in steps]) if timed else None
    by_kind = {}
    for kind in ("decode", "prefill", "mixed"):
        mask = np.array([s.kind == kind for s in steps])
        if mask.any():
            by_kind[kind] = {"steps": int(mask.sum()), "wall_s": float(durations[mask].sum()),
                             "ideal_s": float(ideal[mask].sum()),
                             "mean_tokens": float(np.mean([s.num_tokens for s, k in zip(steps, mask) if k]))}
            if kv_read is not None:
                by_kind[kind]["kv_read_s"] = float(kv_read[mask].sum())
            if timed:
                by_kind[kind]["forward_s"] = float(forward[mask].sum())
    split = {}
    if timed:
        # The time before the first step and after the last (adding requests, collecting outputs) is host time too.
        split = {"forward_s": float(forward.sum()), "host_s": wall_s - float(forward.sum()),
                 "host_share": (wall_s - float(forward.sum())) / wall_s}
    return {
        "engine_wall_s": wall_s, "ideal_s": float(ideal.sum()), "efficiency": float(ideal.sum()) / wall_s,
        "num_preemptions": num_preemptions, "num_steps": len(steps),
        "num_scheduled_tokens": int(sum(s.num_tokens for s in steps)),
        "num_sampled": int(sum(s.num_sampled for s in steps)), "max_step_tokens": max_tokens,
        "max_step_sampled": max_sampled,
        **split, **roofline, "by_kind": by_kind,
        "matmul_grid_s": {k: {str(m): t for m, t in v.items()} for k, v in grid.items()},
    }


def efficiency_table(result: dict) -> tuple[list[str], list[list]]:
    """One row per step kind; with forward timing, also the share of wall time outside the model;
    with the KV-read term, the KV-read floor and (matmuls + KV reads) / wall."""
    timed = "forward_s" in result
    kv = "kv_read_s" in result
    headers = ["steps", "count", "wall s", "matmul-only ideal s", "ideal / wall", "mean tokens / step"]
    if kv:
        headers += ["KV-read floor s", "(ideal + KV read) / wall"]
    if timed:
        headers.append("outside the model / wall")
    rows = [["all", result["num_steps"], result["engine_wall_s"], result["ideal_s"], result["efficiency"],
             result["num_scheduled_tokens"] / result["num_steps"]]
            + ([result["kv_read_s"], result["roofline"]] if kv else []) + ([result["host_share"]] if timed else [])]
    for kind, k in result["by_kind"].items():
        wall = k["wall_s"]
        row = [kind, k["steps"], wall, k["ideal_s"], k["ideal_s"] / wall if wall else None, k["mean_tokens"]]
        if kv:
            row += [k["kv_read_s"], (k["ideal_s"] + k["kv_read_s"]) / wall if wall else None]
        if timed:
            row.append(1 - k["forward_s"] / wall if wall else None)
        rows.append(row)
    return headers, rows
