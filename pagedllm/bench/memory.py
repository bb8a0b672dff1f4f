"""KV memory efficiency of paged allocation vs contiguous reservation (max / pow2 / oracle).

At every engine step, right after scheduling (the blocks then cover exactly the tokens whose
KV exists or is being written this step), every KV slot of the cache is in one of these states:

    useful        holds a token's K/V (a computed or this-step token of a running request)
    reservation   reserved by a request for its own future tokens (contiguous policies:
                  final length - tokens so far); paged reserves nothing ahead
    internal      allocated but never to hold this request's state: beyond its final length
                  (contiguous: policy over-reservation, block and buddy rounding) or, for paged,
                  the unfilled tail of each request's last block
    external      free slots that could not be used: the head of the waiting queue was refused
                  this step although the free blocks added up to its reservation (no contiguous
                  hole was large enough). Free memory that is simply too little is not counted.
    (free)        everything else; not part of the denominator

The reported fractions are time averages over engine steps (every step weighs the same):
sum over steps of each state / sum over steps of (useful + reservation + internal + external),
so they add up to 1. Also reported: mean and max running requests per step, steps,
preemptions, and, when the model runs, throughput.

Two modes with identical scheduling (requests run to exactly their trace output length, so
token values never change the schedule):
  - simulate: scheduler + KV manager only, a stub in place of the model: fast, any trace size
  - real: the default model through the offline engine, also measuring throughput
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from pagedllm.bench.common import best_time
from pagedllm.bench.workloads import FIRST_ORDINARY_TOKEN, BenchRequest
from pagedllm.bench.contiguous_allocator import ContiguousKVCacheManager

STATES = ("useful", "reservation", "internal", "external")


@dataclass
class MemoryAccounting:
    steps: int = 0
    useful: int = 0
    reservation: int = 0
    internal: int = 0
    external: int = 0
    running_sum: int = 0
    running_max: int = 0
    admission_failures: int = 0

    def fractions(self) -> dict[str, float]:
        total = self.useful + self.reservation + self.internal + self.external
        return {s: (getattr(self, s) / total if total else 0.0) for s in STATES}

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "fractions": self.fractions(),
            "mean_running": self.running_sum / self.steps if self.steps else 0.0,
            "max_running": self.running_max,
            "admission_failures_counted_as_external": self.admission_failures,
        }


def step_breakdown(scheduler) -> dict[str, int]:
    """Slots in each state right now (call right after schedule()). See the module docstring."""
    kv = scheduler.kv
    bs = kv.block_size
    out = dict.fromkeys(STATES, 0)
    if isinstance(kv, ContiguousKVCacheManager):
        for request in scheduler.running:
            region = kv.regions[request.req_id]
            computed = request.num_computed_tokens
            out["useful"] += computed
            out["reservation"] += region.final_len - computed
            out["internal"] += region.num_blocks * bs - region.final_len
        failure = kv.last_admission_failure
        kv.last_admission_failure = None
        if failure is not None and scheduler.waiting:
            num_needed, num_free = failure
            if num_free >= num_needed:
                out["external"] = num_free * bs
        return out
    # Paged: count each physical block once (parallel samples share blocks); a slot is useful
    # if any sequence holding the block has computed that position.
    fill: dict[int, int] = {}
    for request in scheduler.running:
        computed = request.num_computed_tokens
        for i, block_id in enumerate(kv.get_block_ids(request.req_id)):
            filled = min(bs, max(0, computed - i * bs))
            if filled > fill.get(block_id, -1):
                fill[block_id] = filled
    out["useful"] = sum(fill.values())
    out["internal"] = len(fill) * bs - out["useful"]
    return out


class MemoryProbe:
    """Wraps a scheduler's schedule() to account KV slots after every step."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.acc = MemoryAccounting()
        self._schedule = scheduler.schedule
        scheduler.schedule = self._schedule_and_record

    def detach(self) -> None:
        self.scheduler.schedule = self._schedule

    def _schedule_and_record(self):
        kv = self.scheduler.kv
        if isinstance(kv, ContiguousKVCacheManager):
            kv.last_admission_failure = None
        output = self._schedule()
        if output.total_num_scheduled_tokens:
            b = step_breakdown(self.scheduler)
            acc = self.acc
            acc.steps += 1
            for s in STATES:
                setattr(acc, s, getattr(acc, s) + b[s])
            acc.admission_failures += b["external"] > 0
            n = len(self.scheduler.running)
            acc.running_sum += n
            acc.running_max = max(acc.running_max, n)
        return output


def simulate(requests: list[BenchRequest], policy: str, num_blocks: int, block_size: int = 16,
             max_model_len: int = 2048, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
             allocator: str = "first_fit", progress: bool = False) -> dict:
    """Run the trace through the real scheduler and KV manager with a stub model (no tensors)."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import ModelRunnerOutput
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.sampling_params import SamplingParams

    if policy == "paged":
        kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    else:
        kv = ContiguousKVCacheManager(num_blocks, block_size, policy, max_model_len, allocator)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, kv)
    probe = MemoryProbe(scheduler)
    for i, r in enumerate(requests):
        assert r.n == 1, "simulate() runs single-sequence requests"
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        scheduler.add_request(Request(str(i), list(r.prompt_token_ids), params, frozenset(), r.output_len))
    bar = tqdm(total=len(requests), desc=f"simulate {policy}", disable=not progress, unit="req")
    num_output_tokens = 0
    while scheduler.has_unfinished_requests():
        sched = scheduler.schedule()
        assert sched.total_num_scheduled_tokens, "the scheduler is stuck: nothing runs and requests wait"
        sampled = {rid: [FIRST_ORDINARY_TOKEN] for rid in sched.num_scheduled_tokens
                   if scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens}
        num_output_tokens += len(sampled)
        for out in scheduler.update_from_output(sched, ModelRunnerOutput(sampled_token_ids=sampled)):
            if out.finished:
                bar.update(1)
    bar.close()
    assert kv.check_no_leaks() == [], kv.check_no_leaks()
    return {"policy": policy, "num_output_tokens": num_output_tokens,
            "num_preemptions": scheduler.num_preemptions, **probe.acc.summary()}


def run_real(requests: list[BenchRequest], policy: str, llm, progress: bool = False,
             kv_map_png: Path | None = None) -> dict:
    """Run the trace through a real engine, built by the caller for `policy` (engine_utils.build_llm).

    `kv_map_png`: also draw the block map (LLM.kv_cache_snapshot) at the step that held the most blocks."""
    from pagedllm.bench.engine_utils import engine_prompts, request_params

    probe = MemoryProbe(llm.engine.core.scheduler)  # instrumentation: a slot census after every schedule()
    peak = PeakKVMap(llm) if kv_map_png is not None else None
    stats_before = llm.engine.stats()
    start = time.perf_counter()
    try:
        outputs = llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=progress)
    finally:
        probe.detach()
        if peak is not None:
            peak.detach()
    if peak is not None and peak.kv_map is not None:
        render_kv_map(peak.kv_map, kv_map_png, f"{policy}: the KV cache at its fullest step")
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_in = sum(r.prompt_len for r in requests)
    assert llm.engine.core.check_kv_leaks() == [], llm.engine.core.check_kv_leaks()
    return {
        "policy": policy, "elapsed_s": elapsed, "num_output_tokens": num_out,
        "output_tok_s": num_out / elapsed, "total_tok_s": (num_out + num_in) / elapsed,
        "num_preemptions": stats.num_preemptions - stats_before.num_preemptions,
        "num_swap_outs": stats.num_swap_outs - stats_before.num_swap_outs,
        **probe.acc.summary(),
        "_outputs": [[list(c.token_ids) for c in o.outputs] for o in outputs],
    }


def memory_table(rows: list[dict], real: bool) -> tuple[list[str], list[list]]:
    paged = next((r for r in rows if r["policy"] == "paged"), None)
    headers = ["policy", "useful %", "reservation %", "internal %", "external %", "mean running", "max running",
               "steps", "preemptions"]
    if real:
        headers += ["output tok/s", "paged / policy"]
    table = []
    for r in rows:
        f = r["fractions"]
        row = [r["policy"], 100 * f["useful"], 100 * f["reservation"], 100 * f["internal"], 100 * f["external"],
               r["mean_running"], r["max_running"], r["steps"], r["num_preemptions"]]
        if real:
            ratio = paged["output_tok_s"] / r["output_tok_s"] if paged else None
            row += [r["output_tok_s"], ratio]
        table.append(row)
    return headers, table


def strip_private(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}




# --- the block map offline: at the fullest step, to a PNG; and what building one costs -----------------


class PeakKVMap:
    """Keeps the block map (LLM.kv_cache_snapshot) of the step that held the most blocks so far; a map is built
    only when a step beats the peak (the gauges that decide it cost nothing)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.kv_map = None
        self.num_used_blocks = 0
        llm.engine.core.step_listeners.append(self._on_step)

    def _on_step(self, sched_output, runner_output) -> None:
        num_used = self.llm.kv_cache_stats().num_used_blocks
        if num_used > self.num_used_blocks:
            self.num_used_blocks = num_used
            self.kv_map = self.llm.kv_cache_snapshot()

    def detach(self) -> None:
        self.llm.engine.core.step_listeners.remove(self._on_step)


OWNER_HUES = 230
"""A request's colour is a hue in [0, 230) degrees (red to blue): purple (265) is for shared blocks."""


def kv_map_colors(kv_map) -> list[tuple[float, float, float]]:
    """One RGB colour per block, as the dashboard draws them: free dark grey, cached pale blue, a block of one
    request in that request's hue (the requests' hues spread apart; paler the emptier), shared purple (darker the more holders)."""
    import colorsys

    owner: dict[int, int] = {}  # block id -> the index of its first holder in kv_map.requests
    for i, request in enumerate(kv_map.requests):
        for block_id in request.block_ids:
            owner.setdefault(block_id, i)
    cached = set(kv_map.cached_block_ids)
    colors = []
    for block_id, (ref_cnt, num_tokens) in enumerate(zip(kv_map.ref_cnts, kv_map.num_tokens)):
        if ref_cnt == 0:
            colors.append((0.86, 0.92, 1.0) if block_id in cached else (0.33, 0.33, 0.33))
        elif ref_cnt > 1:
            colors.append(colorsys.hls_to_rgb(265 / 360, max(0.25, 0.62 - 0.08 * ref_cnt), 0.7))
        else:
            hue = owner.get(block_id, 0) * 137.5 % OWNER_HUES / 360  # neighbours far apart, never the shared purple
            fill = num_tokens / kv_map.block_size
            colors.append(colorsys.hls_to_rgb(hue, 0.78 - 0.28 * fill, 0.7))
    return colors


def render_kv_map(kv_map, path: Path, title: str = "KV cache") -> Path:
    """Draw a KVMapMsg as a grid of blocks (row-major by block id) to a PNG; returns the path."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = kv_map_colors(kv_map)
    num_blocks = len(colors)
    cols = max(8, math.ceil(math.sqrt(num_blocks * 2)))
    rows = math.ceil(num_blocks / cols)
    grid = [[(1.0, 1.0, 1.0)] * cols for _ in range(rows)]
    for block_id, color in enumerate(colors):
        grid[block_id // cols][block_id % cols] = color
    fig, ax = plt.subplots(figsize=(10, max(2.5, 10 * rows / cols + 1.2)))
    ax.imshow(grid, interpolation="nearest", aspect="equal")
    ax.set_xticks([])
    ax.set_yticks([])
    used = sum(1 for r in kv_map.ref_cnts if r)
    filled = sum(kv_map.num_tokens)
    running = sum(1 for r in kv_map.requests if r.state == "running")
    ax.set_title(f"{title}\n{num_blocks} blocks of {kv_map.block_size}: {used} held "
                 f"({filled} of {used * kv_map.block_size} slots filled), {len(kv_map.cached_block_ids)} cached, "
                 f"{sum(1 for r in kv_map.ref_cnts if r > 1)} shared; {running} running, "
                 f"{len(kv_map.requests) - running} waiting", fontsize=9)
    ax.legend(handles=[Patch(color=(0.33, 0.33, 0.33), label="free"), Patch(color=(0.86, 0.92, 1.0), label="cached"),
                       Patch(color=colorsys_rgb(30), label="one request (paler = emptier)"),
                       Patch(color=colorsys_rgb(265, 0.46), label="shared")],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def colorsys_rgb(hue_deg: float, lightness: float = 0.5) -> tuple[float, float, float]:
    import colorsys

    return colorsys.hls_to_rgb(hue_deg / 360, lightness, 0.7)


def kv_map_cost(num_blocks: int = 16384, block_size: int = 16, num_requests: int = 256, prompt_len: int = 500,
                repeats: int = 20) -> dict:
    """What the engine core pays for the dashboard and the gauges, with no model: a pool of `num_blocks` and
    `num_requests` running requests of `prompt_len` tokens (about 16 GB of KV for an 8B model).

    Returns seconds per call (best of `repeats`) of EngineCore.kv_map() (only while someone watches, at most every 0.5 s), of its
    msgpack encoding, and of EngineCore.stats() (every step; the gauges are counters, so it should not grow
    with the pool)."""
    import msgspec

    from pagedllm.config import EngineArgs
    from pagedllm.core.request import EngineCoreRequest
    from pagedllm.engine.core import EngineCore
    from pagedllm.sampling_params import SamplingParams

    core = EngineCore(EngineArgs(block_size=block_size, max_num_seqs=num_requests, max_model_len=4 * prompt_len,
                                 max_num_batched_tokens=num_requests * prompt_len),
                      executor=_StubExecutor(num_blocks, 4 * prompt_len))
    for i in range(num_requests):
        prompt = [FIRST_ORDINARY_TOKEN + (i * 7 + j) % 1000 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=prompt_len, ignore_eos=True, temperature=0.0)
        core.add_request(EngineCoreRequest(str(i), prompt, params, [], prompt_len))
    core.step()

    def per_call(fn) -> float:  # the best of `repeats`: this machine's other load is not the map's cost
        return best_time(fn, repeats, warmup=False)

    kv_map = core.kv_map()
    encoder = msgspec.msgpack.Encoder()
    result = {"num_blocks": num_blocks, "num_running": core.scheduler.num_running,
              "num_used_blocks": core.kv_cache_manager.kv_stats().num_used_blocks,
              "kv_map_s": per_call(core.kv_map), "kv_map_encode_s": per_call(lambda: encoder.encode(kv_map)),
              "kv_map_bytes": len(encoder.encode(kv_map)), "stats_s": per_call(core.stats),
              "kv_stats_s": per_call(core.kv_cache_manager.kv_stats)}
    core.abort_requests([str(i) for i in range(num_requests)])
    assert core.check_kv_leaks() == []
    return result


class _StubExecutor:
    """No model: each request samples token FIRST_ORDINARY_TOKEN (for kv_map_cost)."""

    def __init__(self, num_blocks: int, max_len: int) -> None:
        from pagedllm.worker.interface import ModelInfo

        self.num_blocks = num_blocks
        self.model_info = ModelInfo(model_path="stub", hf_config=None,
                                    vocab_size=50000, max_position_embeddings=max_len, eos_token_ids=(2,))

    def initialize_kv_cache(self, cache_config, scheduler_config):
        from pagedllm.worker.interface import KVCacheInfo

        return KVCacheInfo(num_blocks=self.num_blocks, num_host_blocks=0, block_size=cache_config.block_size,
                           bytes_per_block=1, num_kv_heads=1)

    def execute_model(self, sched):
        from pagedllm.core.sched_output import ModelRunnerOutput

        return ModelRunnerOutput(sampled_token_ids={rid: [FIRST_ORDINARY_TOKEN] for rid in sched.num_scheduled_tokens})

    def shutdown(self) -> None:
        pass


if __name__ == "__main__":  # python -m pagedllm.bench.memory: the block map's cost in the engine core
    for num_blocks, num_requests in ((2048, 32), (16384, 256), (65536, 256)):
        r = kv_map_cost(num_blocks=num_blocks, num_requests=num_requests)
        print(f"{r['num_blocks']:6d} blocks ({r['num_used_blocks']} held by {r['num_running']} requests): "
              f"kv_map {1e3 * r['kv_map_s']:.2f} ms + msgpack {1e3 * r['kv_map_encode_s']:.2f} ms "
              f"({r['kv_map_bytes'] / 1024:.0f} KiB); stats() {1e6 * r['stats_s']:.1f} us, "
              f"kv_stats() {1e6 * r['kv_stats_s']:.1f} us")
