"""Time the compiled paged-attention op the way the engine's decode steps see it.

In the engine a step's attention reads each running sequence's KV blocks, scattered through a cache
of gigabytes, once per layer, and every layer reads a different cache: nothing is hot in L1/L2 and
little in L3. ``pagedllm bench attention`` times one small hot cache instead. Here the cache is
one large buffer on 2 MB huge pages (``pagedllm.model.huge_pages``, as the engine allocates it),
each "layer" gets its own random block set (``randperm`` over the whole cache), and the layers are
run in turn, ``--layers`` of them per pass, so a block is read again only after every other
layer's blocks.

    PYTHONPATH=$PWD python scripts/attention_scattered.py               # this checkout's library
    PYTHONPATH=$PWD python scripts/attention_scattered.py --lib X.so    # another build of the op
    PYTHONPATH=$PWD python scripts/attention_scattered.py --env PAGEDLLM_ATTN_PF=0 --env ''

Each ``--env NAME=VALUE`` (or ``''`` for the defaults) is a variant: the variants are timed in
alternation within each pass, so machine noise hits all of them. Reported per shape and variant:
ms per layer call (median and 10th percentile over every call of every pass: on a shared machine
the median resists calls that lost their core), the KV bytes read over the median (GB/s), and the
first variant's median over this one's (speedup). Values do not matter to the timing (the cache holds a constant).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedllm.model import huge_pages

SHAPES = ["1x1500", "4x400", "14x700", "16x300", "64x300", "64x512", "32x1024"]


def parse_env(spec: str) -> dict[str, str]:
    out = {}
    for part in filter(None, spec.split(";")):
        name, _, value = part.partition("=")
        out[name] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help="SEQSxLEN,... (decode: one query per sequence)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-gb", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=30, help="block sets rotated (one per layer)")
    ap.add_argument("--passes", type=int, default=5, help="passes over all layers per variant")
    ap.add_argument("--env", action="append", default=None, help="a variant: NAME=VALUE[;NAME=VALUE] ('' = as is)")
    ap.add_argument("--lib", default=None, help="load this library instead of this checkout's build")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--hot", action="store_true",
                    help="the bench's case instead: one contiguous block set, reused every call (cache-warm)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if args.lib:
        torch.ops.load_library(args.lib)
    else:
        from pagedllm.model.attention import cpu_op

        if not cpu_op.load():
            raise SystemExit(f"the compiled op is unavailable: {cpu_op.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    bs = args.block_size
    block_bytes = 2 * bs * num_kv_heads * head_dim * 4
    total_blocks = int(args.cache_gb * 2**30) // block_bytes
    kv = huge_pages.empty((2, total_blocks, bs, num_kv_heads, head_dim))
    kv.fill_(0.01)  # touches (places) every page
    variants = [parse_env(s) for s in (args.env or [""])]
    names = [";".join(f"{k}={v}" for k, v in env.items()) or "default" for env in variants]
    print(f"cache {kv.numel() * 4 / 2**30:.1f} GiB, huge pages {huge_pages.huge_page_bytes() / 2**30:.1f} GiB, "
          f"{args.threads} threads, {'hot contiguous blocks' if args.hot else f'{args.layers} layers rotated'}, {args.passes} passes, "
          f"isa {int(torch.ops.pagedllm.cpu_isa())}, lib {args.lib or 'this checkout'}")
    print(f"{'shape':>9} {'variant':<32} {'ms/layer':>9} {'p10':>7} {'GB/s':>6} {'speedup':>8}")
    op = torch.ops.pagedllm.paged_attention_cpu
    scale = head_dim**-0.5
    saved = {k: os.environ.get(k) for env in variants for k in env}
    for shape in args.shapes.split(","):
        num_seqs, seq_len = (int(x) for x in shape.split("x"))
        width = -(-seq_len // bs)
        need = num_seqs * width
        if args.hot:
            tables = [torch.arange(need).view(num_seqs, width)] * args.layers
        else:
            tables = [torch.randperm(total_blocks)[:need].view(num_seqs, width).contiguous()
                      for _ in range(args.layers)]
        query = torch.randn(num_seqs, num_heads, head_dim)
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.long)
        starts = torch.arange(num_seqs + 1, dtype=torch.long)
        kv_bytes = num_seqs * seq_len * num_kv_heads * head_dim * 4 * 2
        times: list[list[float]] = [[] for _ in variants]
        for p in range(args.passes + 1):  # pass 0 warms up (and is dropped)
            for i, env in enumerate(variants):
                for k, v in env.items():
                    os.environ[k] = v
                for table in tables:
                    start = time.perf_counter()
                    op(query, kv, table, seq_lens, starts, scale, 0, 0, 0, 0)
                    if p:
                        times[i].append(time.perf_counter() - start)
                for k in env:
                    if saved[k] is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = saved[k]
        first = statistics.median(times[0])
        for name, t in zip(names, times):
            med, low = statistics.median(t), statistics.quantiles(t, n=10)[0]
            print(f"{shape:>9} {name:<32} {med * 1e3:9.3f} {low * 1e3:7.3f} {kv_bytes / med / 1e9:6.1f} "
                  f"{first / med:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
