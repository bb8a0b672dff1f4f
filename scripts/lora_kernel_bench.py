"""The LoRA delta kernel alone (``lora_sgmv_cpu``) over one decode step's 120 linears of the default model's
shape (30 layers x qkv, o, gate_up, down; rank-16 adapters on all), each linear its own slot tensors so nothing
stays cached across layers, as in a step; variants alternated step by step in one process:

    PYTHONPATH=$PWD python scripts/lora_kernel_bench.py [--rows 18] [--adapters 4] [--threads 2] [--reps 40]

Variants: slots in plain tensors (4 KB pages) or cut from a ``SlotArena`` (2 MB huge pages, as the engine
holds them), the one-pass split's software prefetch off or on (``lora_sgmv_prefetch``). The rows are spread
over the adapters and grouped by slot as the runner groups them (18 rows, 4 adapters: segments of 5, 5, 4, 4).
Per step: wall time and process CPU time (all threads); the ratio column is the median over steps of each
variant's CPU time over the first variant's in the same repetition (a shared machine's slow spells cancel).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedllm.lora.layers import LoRASlots, SlotArena, slot_shapes
from pagedllm.model.attention import cpu_op

# SmolLM2-135M (the default model): hidden, intermediate, q, kv widths, layers
HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 576, 192, 30
VARIANTS = {"4k": (False, False), "4k+pf": (False, True), "huge": (True, False), "huge+pf": (True, True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--variants", default="4k,huge,4k+pf,huge+pf")
    args = parser.parse_args()
    assert cpu_op.load(), cpu_op.unavailable_reason()
    torch.set_num_threads(args.threads)
    kinds = [(HIDDEN, [Q, KV, KV]), (Q, [HIDDEN]), (HIDDEN, [INTER, INTER]), (INTER, [HIDDEN])] * LAYERS
    shapes = [s for k, parts in kinds for s in slot_shapes(k, parts, args.max_loras, args.rank)]
    arena = SlotArena(SlotArena.nbytes(shapes, torch.float32), torch.device("cpu"))
    plain, huge = [], []
    for i, (k, parts) in enumerate(kinds):
        g = torch.Generator().manual_seed(i)
        weights = [[(torch.randn(args.rank, k, generator=g) * 0.01, torch.randn(n, args.rank, generator=g) * 0.01)
                    for n in parts] for _ in range(args.adapters)]
        for into, extra in ((plain, {}), (huge, {"arena": arena})):
            slots = LoRASlots(k, parts, args.max_loras, args.rank, torch.float32, torch.device("cpu"), **extra)
            for slot, w in enumerate(weights):
                slots.set_slot(slot, args.rank, w)
            into.append(slots)
    row_slots = sorted(i % args.adapters for i in range(args.rows))
    segments = []
    for slot in range(args.adapters):
        rows = [i for i, s in enumerate(row_slots) if s == slot]
        if rows:
            segments += [rows[0], rows[-1] + 1, slot]
    xs = [torch.randn(args.rows, k) for k, _ in kinds]
    ys = [torch.zeros(args.rows, sum(parts)) for _, parts in kinds]
    op = torch.ops.pagedllm.lora_sgmv_cpu
    names = args.variants.split(",")
    before = torch.ops.pagedllm.lora_sgmv_prefetch(-1)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    try:
        for rep in range(args.reps + 1):
            for name in names if rep % 2 == 0 else names[::-1]:
                on_huge, prefetch = VARIANTS[name]
                torch.ops.pagedllm.lora_sgmv_prefetch(int(prefetch))
                slots_of = huge if on_huge else plain
                c0, t0 = time.process_time(), time.perf_counter()
                for x, y, s in zip(xs, ys, slots_of):
                    op(x, y, s.a, s.b, s.ranks, s.part_sizes, segments, 0)
                t1, c1 = time.perf_counter(), time.process_time()
                if rep:  # the first is a warm-up
                    wall[name].append((t1 - t0) * 1e3)
                    cpu[name].append((c1 - c0) * 1e3)
    finally:
        torch.ops.pagedllm.lora_sgmv_prefetch(before)
    slot_mb = sum(s.a[:args.adapters].numel() + s.b[:args.adapters].numel() for s in huge) * 4 / 1e6
    print(f"{len(kinds)} linears, {args.rows} rows in {len(segments) // 3} segments, {args.adapters} adapters of "
          f"rank {args.rank} ({slot_mb:.1f} MB of slots read a step), {args.threads} threads, {args.reps} steps "
          f"per variant, load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':>8}  {'wall ms':>8}  {'CPU ms':>7}  CPU / {names[0]} (median of per-step ratios, p25-p75)")
    for name in names:
        ratios = sorted(a / b for a, b in zip(cpu[name], cpu[names[0]]))
        q = lambda f: ratios[int(f * (len(ratios) - 1))]  # noqa: E731
        print(f"{name:>8}  {statistics.median(wall[name]):8.2f}  {statistics.median(cpu[name]):7.2f}  "
              f"{statistics.median(ratios):.3f} ({q(0.25):.3f}-{q(0.75):.3f})")


if __name__ == "__main__":
    main()
