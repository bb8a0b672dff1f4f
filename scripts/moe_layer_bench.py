"""One sparse-MoE layer's forward (layers/moe.py) at decode batch sizes: the grouped-by-expert path
against every expert computed densely, and against the matmul-only ideal (the chosen experts' two
GEMMs over their rows, pre-gathered: no routing, sort, gather or scatter).

Default shape: a scaled-down Qwen3-30B-A3B layer (hidden 1024, 64 experts of intermediate 384,
top-8; the real one is 2048 / 128 x 768 / top-8), random weights, float32.

    PYTHONPATH=. python scripts/moe_layer_bench.py [--hidden 1024 --experts 64 --inter 384 --top-k 8]

The same comparison over a whole model's decode steps, through an LLM: `pagedllm bench moe`.
"""

import argparse
import time

import torch

from pagedllm.model.layers.moe import SparseMoE


def best_ms(fns, repeats: int) -> list[float]:
    """Each function's fastest of ``repeats`` runs, the functions interleaved run by run, so load
    from other processes on a shared machine falls on all of them alike."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [1e3 * t for t in best]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    moe = SparseMoE(args.hidden, args.inter, args.experts, args.top_k, renormalize=True)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.02)
    moe.experts.process_weights_after_loading()  # the packed CPU GEMM weights, as the loader does
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts x intermediate {args.inter}, top-{args.top_k}, "
          f"float32, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'active':>6} {'sparse ms':>9} {'dense ms':>8} {'ideal ms':>8} {'dense/sparse':>12} "
          f"{'ideal/sparse':>12}")
    with torch.inference_mode():
        for batch in args.batches:
            x = torch.randn(batch, args.hidden)
            torch.testing.assert_close(moe(x), moe.forward_dense(x), atol=1e-4, rtol=1e-4)
            _, ids = moe.route(x)
            chosen = ids.reshape(-1)
            groups = [(e, x[(ids == e).any(-1)]) for e in chosen.unique().tolist()]

            def ideal():
                for e, rows in groups:
                    moe.expert_mlp(e, rows)

            sparse, dense, ideal_ms = best_ms([lambda: moe(x), lambda: moe.forward_dense(x), ideal], args.repeats)
            print(f"{batch:>5} {len(groups):>6} {sparse:>9.3f} {dense:>8.3f} {ideal_ms:>8.3f} {dense / sparse:>12.2f} "
                  f"{ideal_ms / sparse:>12.2f}")


if __name__ == "__main__":
    main()
