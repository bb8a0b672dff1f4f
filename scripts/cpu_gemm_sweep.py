"""The compiled packed GEMM (pagedllm.model.layers.cpu_gemm) against a baseline, over the default
model's 120 linears (or the LM head), per row count:

    PYTHONPATH=$PWD .venv/bin/python scripts/cpu_gemm_sweep.py [--rows 1 14 ...] [--isa avx2] [--head]
        [--vs mkl|legacy|whole|4k]

Baselines ("old"): ``mkl`` the previous CPU linear path (MKL packed GEMM at 2-256 rows, F.linear on
the column-major weight at 1); ``legacy`` the same kernel with K-chunked sweeps and the far L2
prefetch off (the kernel as it was before either); ``whole`` only chunked sweeps off (each row
block over the whole panel in turn); ``4k`` the same kernel on copies of the
packed weights in plain (4 KB-page) memory instead of the huge-page arena.

Each weight is a distinct tensor (424 MB in all), so nothing stays in cache, as in a real step.
The two paths alternate call by call (which goes first alternates too), so a busy machine slows
both alike; per repetition each path's calls are summed, and the table gives the median and the
fastest repetition of each.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.model.layers import cpu_gemm
from pagedllm.model.layers.linear import mkl_pack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 14, 16, 24, 32, 48, 64, 128])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="avx512 / avx2 (default: the best this CPU runs)")
    parser.add_argument("--head", action="store_true", help="the LM head (49152 x 576, row-major) instead")
    parser.add_argument("--vs", choices=["mkl", "legacy", "whole", "4k"], default="mkl",
                        help="the baseline (module doc)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by process CPU time, not wall time: with --threads 1 on a busy machine, "
                             "the time this process was descheduled no longer counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = []
    for n, k in [(49152, 576)] if args.head else SHAPES * args.layers:
        w = torch.randn(n, k) * 0.05
        packed = cpu_gemm.pack(w, args.isa)
        if packed is None:
            raise SystemExit("the compiled GEMM is off or unavailable here")
        if not args.head:
            w = w.t().contiguous().t()  # column-major, as linear.py keeps it; the head stays row-major
        # The baseline reads its own copy: back to back, the second read of a weight would hit L3.
        if args.vs == "mkl":
            old = mkl_pack(w)
        else:
            old = packed.clone() if args.vs == "4k" else cpu_gemm.pack(w, args.isa)
        layers.append((w, old, packed, n, k))
    nbytes = sum(w.numel() for w, *_ in layers) * 4
    print(f"{len(layers)} weights, {nbytes / 1e6:.0f} MB, {args.threads} threads, "
          f"panel width {layers[0][2].shape[2]}, old = {args.vs}")
    print(f"{'M':>4} {'old ms':>8} {'new ms':>8} {'new/old':>8} {'min/min':>8} {'new GB/s':>9} {'GFLOPS':>7}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {k for *_, k in layers}}
        old_t, new_t = [], []
        for rep in range(args.reps + 1):
            old_s = new_s = 0.0
            for i, (w, old, packed, n, k) in enumerate(layers):
                for which in ((0, 1) if (i + rep) % 2 else (1, 0)):
                    if which == 0 and args.vs in ("whole", "legacy"):
                        cpu_gemm.chunk_max_blocks(1)
                        cpu_gemm.far_prefetch(0 if args.vs == "legacy" else 1)
                    t0 = clock()
                    if which == 1:
                        cpu_gemm.gemm(xs[k], packed, None, n)
                        new_s += clock() - t0
                    elif args.vs != "mkl":
                        cpu_gemm.gemm(xs[k], old, None, n)
                        old_s += clock() - t0
                        cpu_gemm.chunk_max_blocks(0)
                        cpu_gemm.far_prefetch(1)
                    elif m >= 2 and old is not None:
                        torch.ops.mkl._mkl_linear(xs[k], old, w, None, m)
                        old_s += clock() - t0
                    else:
                        F.linear(xs[k], w)
                        old_s += clock() - t0
            if rep > 0:  # the first is a warm-up
                old_t.append(old_s)
                new_t.append(new_s)
        o, nw = statistics.median(old_t), statistics.median(new_t)
        print(f"{m:4d} {o * 1e3:8.1f} {nw * 1e3:8.1f} {nw / o:8.2f} {min(new_t) / min(old_t):8.2f} "
              f"{nbytes / min(new_t) / 1e9:9.1f} {2 * m * nbytes / 4 / min(new_t) / 1e9:7.1f}", flush=True)


if __name__ == "__main__":
    main()
