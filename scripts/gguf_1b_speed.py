"""Batch-1 decode and a 128-token prefill on the Llama-3.2-1B shape (issue 25), in one process.

    PYTHONPATH=$PWD .venv/bin/python scripts/gguf_1b_speed.py [--threads 2] [--rounds 3] [--engine]
    PYTHONPATH=$PWD PAGEDLLM_DISABLE_OP_POOL=1 .venv/bin/python scripts/gguf_1b_speed.py --threads 1 --clock cpu

Per linear shape of one layer and the LM head (hidden 2048, intermediate 8192, 8 KV heads of 64,
a 49152-row head), alternating round by round: the quantized kernel (Q4_0, Q8_0) at 1 and 128 rows
against torch's float32 ``F.linear`` on the same shape, summed over 16 layers + the head (the
matmul-only time of a step), beside the memory-bandwidth bound (weight bytes / the read bandwidth
measured here with the same threads). ``--engine`` adds ``LLM`` on the random GGUFs: a 128-token
prefill (time to the first token, a fresh prompt each run) and decode ms per step (from two
generation lengths). On a shared machine, ``--threads 1 --clock cpu`` gives each call's CPU time,
which other processes' load barely moves (wall time on 2 busy cores varied 2-4x run to run).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

HIDDEN, INTER, KV, VOCAB, LAYERS = 2048, 8192, 8 * 64, 49152, 16
SHAPES = {  # name: (n, k, count per step)
    "qkv": (HIDDEN + 2 * KV, HIDDEN, LAYERS),
    "o": (HIDDEN, HIDDEN, LAYERS),
    "gate_up": (2 * INTER, HIDDEN, LAYERS),
    "down": (HIDDEN, INTER, LAYERS),
    "lm_head": (VOCAB, HIDDEN, 1),
}


CLOCK = [time.perf_counter]  # --clock cpu: time.process_time (this process's CPU seconds, all threads)


def best_ms(fn, repeats: int) -> float:
    clock = CLOCK[0]
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return 1e3 * min(times)


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """GB/s torch reads a buffer larger than any cache at (sum over float32, threads as set)."""
    buf = torch.ones(mib << 18)
    return mib * 2**20 / 1e9 / (best_ms(lambda: buf.sum(), repeats) / 1e3)


def random_quant(qtype: int, n: int, k: int, rng):
    from pagedllm.model.layers import quantized

    bk, bb = quantized.GGUF_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // bk * bb), dtype=np.uint8)
    raw.reshape(n, k // bk, bb)[..., :2] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    return quantized.QuantizedWeight(qtype, torch.from_numpy(raw), k)


def kernels(args) -> None:
    from pagedllm.model.layers import quantized

    rng = np.random.default_rng(0)
    bw = read_bandwidth_gbs()
    print(f"read bandwidth {bw:.1f} GB/s ({torch.get_num_threads()} threads)")
    results: dict[tuple[str, str, int], list[float]] = {}
    # Distinct copies of each weight, cycled, at least 256 MB of them (at most one per layer): each
    # call then reads its weight from memory, as a step does, not from the last level cache.
    weights, copies = {}, {}
    for name, (n, k, count) in SHAPES.items():
        copies[name] = {kind: min(count, int(-(-(256 << 20) // (n * k * size)))) for kind, size in
                        (("f32", 4), ("Q4_0", 18 / 32), ("Q8_0", 34 / 32))}
        weights[name] = {"f32": [torch.randn(n, k) * 0.02 for _ in range(copies[name]["f32"])],
                         "Q4_0": [random_quant(quantized.Q4_0, n, k, rng) for _ in range(copies[name]["Q4_0"])],
                         "Q8_0": [random_quant(quantized.Q8_0, n, k, rng) for _ in range(copies[name]["Q8_0"])]}
    xs = {rows: torch.randn(rows, max(HIDDEN, INTER)) for rows in args.rows}

    def cycle(kind: str, ws: list, x: torch.Tensor):
        if kind == "f32":
            return lambda: [F.linear(x, w) for w in ws]
        return lambda: [w.matmul(x) for w in ws]

    for _ in range(args.rounds):
        for name, (n, k, _) in SHAPES.items():
            for rows in args.rows:
                x = xs[rows][:, :k].contiguous()
                for kind, ws in weights[name].items():
                    ms = best_ms(cycle(kind, ws, x), args.repeats if rows == 1 else 1) / len(ws)
                    results.setdefault((name, kind, rows), []).append(ms)
    kinds = ("f32", "Q4_0", "Q8_0")
    for rows in args.rows:
        print(f"\n{rows} row(s): ms per call (best of rounds); step = 16 layers + head")
        print(f"{'shape':9s} {'n x k':>12s} " + " ".join(f"{k:>8s}" for k in kinds) + "   GB/s Q4_0  Q8_0")
        total = dict.fromkeys(kinds, 0.0)
        for name, (n, k, count) in SHAPES.items():
            ms = {kind: min(results[(name, kind, rows)]) for kind in kinds}
            for kind in kinds:
                total[kind] += count * ms[kind]
            gbs = [weights[name][q][0].nbytes / 1e6 / ms[q] for q in ("Q4_0", "Q8_0")]
            print(f"{name:9s} {f'{n}x{k}':>12s} " + " ".join(f"{ms[kind]:8.3f}" for kind in kinds)
                  + f"   {gbs[0]:5.1f} {gbs[1]:5.1f}")
        print(f"{'step':22s} " + " ".join(f"{total[kind]:8.2f}" for kind in kinds))
        nbytes = {q: sum(count * weights[name][q][0].nbytes for name, (_, _, count) in SHAPES.items())
                  for q in ("Q4_0", "Q8_0")}
        nbytes["f32"] = sum(count * n * k * 4 for n, k, count in SHAPES.values())
        print(f"{'bandwidth bound':22s} " + " ".join(f"{nbytes[kind] / 1e6 / bw:8.2f}" for kind in kinds))


def engine(args) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.random_gguf import write_random_gguf
    from pagedllm.model.loader import cache_root

    rng = np.random.default_rng(1)  # a fresh prompt every run: no prefix-cache hit
    llms = {}
    for qtype in ("Q4_0", "Q8_0"):
        path = cache_root() / "random-gguf" / f"llama-3.2-1b-{qtype}.gguf"
        if not path.exists():
            write_random_gguf(path, "llama-3.2-1b", qtype)
        llms[qtype] = LLM(model=str(path), kv_cache_memory=64 << 20, max_num_seqs=4, max_model_len=1024)

    def run(llm, new_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        prompt = [int(t) for t in rng.integers(100, 40000, size=128)]
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return time.perf_counter() - start

    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for qtype, llm in llms.items():
            for new_tokens in (1, 33):
                times.setdefault((qtype, new_tokens), []).append(run(llm, new_tokens))
    print("\nengine, 128-token prompt (best of rounds):")
    for qtype in llms:
        prefill = min(times[(qtype, 1)])
        step = (min(times[(qtype, 33)]) - prefill) / 32
        print(f"{qtype}: prefill {1e3 * prefill:.0f} ms ({128 / prefill:.0f} tok/s), decode {1e3 * step:.1f} ms "
              f"a step ({1 / step:.1f} tok/s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128], help="x rows per linear call")
    p.add_argument("--engine", action="store_true")
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time the linears by CPU seconds (with --threads 1, what a call costs on a busy "
                        "machine, descheduled time left out)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    if not args.no_kernels:
        kernels(args)
    if args.engine:
        engine(args)


if __name__ == "__main__":
    main()
