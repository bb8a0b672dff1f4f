"""Weight layouts for the CPU linears, side by side: ms per call and GFLOP/s, float32.

    PYTHONPATH=$PWD python scripts/gemm_layouts.py [--threads 1 2] [--rows 1 8 32 64 128 512]

Layouts (y = x W^T, W as a checkpoint stores it, [out, in]):
  linear    F.linear(x, W)                                  (what the model did before)
  mm_t      torch.mm(x, Wt), Wt = W.t().contiguous() [in, out]
  linear_cm F.linear(x, Wt.t()): the same [out, in] tensor with [in, out] storage (what the model's
            linears use after process_weights_after_loading)
  mkl_pack  torch.ops.mkl._mkl_linear on MKL-packed W (cblas_sgemm_pack once, compute per call)
  onednn    torch.ops.mkldnn._linear_pointwise on a oneDNN-reordered W
An AVX2-only CPU can be approximated on an AVX-512 one with
  MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
(Intel's AVX2 code paths, not an AMD core's timings). Each figure is the minimum over interleaved
rounds (layouts in a shuffled order each round), so the layouts share whatever else the machine is
doing; read the ratios, not the absolute rates.
Shapes default to the default model (SmolLM2-135M: hidden 576, intermediate 1536, 9/3 heads of 64,
vocab 49152).
"""

import argparse
import random
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (in_features, out_features)
    "qkv": (576, (9 + 2 * 3) * 64),
    "o_proj": (576, 576),
    "gate_up": (576, 2 * 1536),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}


def layouts(w: torch.Tensor) -> dict:
    wt = w.t().contiguous()
    fns = {
        "linear": lambda x: F.linear(x, w),
        "mm_t": lambda x: torch.mm(x, wt),
        "linear_cm": lambda x: F.linear(x, wt.t()),
    }
    if hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
        # The op uses the packed weight only when M equals the batch size it is told, so tell it M.
        fns["mkl_pack"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])
    if torch.backends.mkldnn.is_available():
        reordered = torch.ops.mkldnn._reorder_linear_weight(w, None)
        fns["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
    return fns


def time_call(fn, x, budget_s: float) -> float:
    fn(x)
    n, start = 0, time.perf_counter()
    while True:
        fn(x)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512])
    parser.add_argument("--layers", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-ms", type=float, default=15.0, help="timed calls per measurement")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"default threads {torch.get_num_threads()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n## {threads} thread(s): ms per call (GFLOP/s), ratio = F.linear time / layout time\n")
        for name in args.layers:
            k, n = SHAPES[name]
            w = torch.randn(n, k) / k**0.5
            fns = layouts(w)
            names = list(fns)
            print(f"| {name} [{k}->{n}] M | " + " | ".join(names) + " | best |")
            print("|---" * (len(names) + 2) + "|")
            for m in args.rows:
                x = torch.randn(m, k)
                ref = F.linear(x, w)
                for label, fn in fns.items():
                    torch.testing.assert_close(fn(x), ref, rtol=1e-4, atol=1e-4, msg=label)
                best = {label: float("inf") for label in names}
                for _ in range(args.rounds):
                    order = names[:]
                    random.shuffle(order)
                    for label in order:
                        best[label] = min(best[label], time_call(fns[label], x, args.budget_ms / 1e3))
                gflop = 2 * m * k * n / 1e9
                cells = [
                    f"{best[label] * 1e3:.3f} ({gflop / best[label]:.0f}, x{best['linear'] / best[label]:.2f})"
                    for label in names
                ]
                winner = min(names, key=best.get)
                print(f"| {m} | " + " | ".join(cells) + f" | {winner} |", flush=True)
            print()


if __name__ == "__main__":
    main()
