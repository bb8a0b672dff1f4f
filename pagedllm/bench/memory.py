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

from tqdm.auto import tqdm

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
        assert not sched.is_empty, "the scheduler is stuck: nothing runs and requests wait"
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


def run_real(requests: list[BenchRequest], policy: str, llm, progress: bool = False) -> dict:
    """Run the trace through a real engine, built by the caller for `policy` (engine_utils.build_llm)."""
    from pagedllm.bench.engine_utils import engine_prompts, request_params

    probe = MemoryProbe(llm.engine.core.scheduler)  # instrumentation: a slot census after every schedule()
    stats_before = llm.engine.stats()
    start = time.perf_counter()
    try:
        outputs = llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=progress)
    finally:
        probe.detach()
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


