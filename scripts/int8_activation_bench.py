"""The int8-activation kernel (``--quant-activations int8``, csrc/quant_gemm_int8*.cpp) against the
float32-activation one on the Llama-3.2-1B shape's linears, and what it costs in accuracy.

    PYTHONPATH=$PWD PAGEDLLM_DISABLE_OP_POOL=1 .venv/bin/python scripts/int8_activation_bench.py --threads 1 --clock cpu
    PYTHONPATH=$PWD .venv/bin/python scripts/int8_activation_bench.py --threads 2 --engine

Speed: per linear shape of one layer (hidden 2048, intermediate 8192, 8 KV heads of 64) and weight type,
ms per call at each row count, the two kernels alternating round by round (best of rounds), and the
16 layers' sum. Accuracy: per shape and type, the largest error over the output of each kernel against
float64 on the same dequantized weight and the float32 x, relative to the output's largest magnitude
(as ``pagedllm bench accuracy``), gguf-quantized Gaussian weights, Gaussian x. ``--engine`` adds
``LLM`` on the random 1B GGUFs, a 128-token prefill and decode ms a step (medians), option off and on.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

HIDDEN, INTER, KV, LAYERS = 2048, 8192, 8 * 64, 16
SHAPES = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}
TYPES = ("Q4_0", "Q4_1", "Q8_0")
CLOCK = [time.perf_counter]


def best_ms(fn, repeats: int) -> float:
    clock = CLOCK[0]
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return 1e3 * min(times)


def weight_pair(type_name: str, n: int, k: int, rng):
    """(float-activation weight, int8-activation weight, the dequantized float64 weight)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from pagedllm.model.layers.quantized import QuantizedWeight

    qtype = int(GGMLQuantizationType[type_name])
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    raw = quantize(w, qtype)
    plain = QuantizedWeight(qtype, torch.from_numpy(raw.copy()), k)
    int8 = QuantizedWeight(qtype, torch.from_numpy(raw.copy()), k)
    assert int8.use_int8_activations()
    return plain, int8, dequantize(raw, qtype).reshape(n, k).astype(np.float64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--engine", action="store_true")
    p.add_argument("--no-kernels", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    if not args.no_kernels:
        kernels(args)
    if args.engine:
        engine(args)


def kernels(args) -> None:
    rng = np.random.default_rng(0)
    types = args.types.split(",")
    pairs = {(name, t): weight_pair(t, n, k, rng) for name, (n, k) in SHAPES.items() for t in types}
    xs = {rows: torch.randn(rows, INTER) for rows in args.rows}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for (name, t), (plain, int8, _) in pairs.items():
            k = SHAPES[name][1]
            for rows in args.rows:
                x = xs[rows][:, :k].contiguous()
                for label, w in (("float", plain), ("int8", int8)):
                    times.setdefault((name, t, rows, label), []).append(
                        best_ms(lambda: w.matmul(x), args.repeats if rows <= 16 else 1))
    for rows in args.rows:
        print(f"\n{rows} row(s), ms per call (best of {args.rounds} rounds), {torch.get_num_threads()} thread(s)")
        print(f"{'shape':8s} {'n x k':>11s} " + " ".join(f"{t + ' fp':>8s} {t + ' i8':>8s}  ratio" for t in types))
        totals = {(t, label): 0.0 for t in types for label in ("float", "int8")}
        for name, (n, k) in SHAPES.items():
            cells = []
            for t in types:
                f, i = (min(times[(name, t, rows, label)]) for label in ("float", "int8"))
                totals[(t, "float")] += LAYERS * f
                totals[(t, "int8")] += LAYERS * i
                cells.append(f"{f:8.3f} {i:8.3f} {f / i:5.2f}x")
            print(f"{name:8s} {f'{n}x{k}':>11s} " + " ".join(cells))
        print(f"{'16 layers':20s} " + " ".join(
            f"{totals[(t, 'float')]:8.2f} {totals[(t, 'int8')]:8.2f} {totals[(t, 'float')] / totals[(t, 'int8')]:5.2f}x"
            for t in types))
    print("\naccuracy: largest |error| / largest |output| vs float64 on the dequantized weight (Gaussian x)")
    print(f"{'shape':8s} {'type':5s} {'rows':>4s} {'float-act kernel':>16s} {'int8-act kernel':>16s}")
    gen = torch.Generator().manual_seed(1)
    for (name, t), (plain, int8, w64) in pairs.items():
        k = SHAPES[name][1]
        for rows in (1, 17):
            x = torch.randn(rows, k, generator=gen)
            exact = x.double().numpy() @ w64.T
            scale = float(np.abs(exact).max())
            errs = [float(np.abs(w.matmul(x).double().numpy() - exact).max()) / scale for w in (plain, int8)]
            print(f"{name:8s} {t:5s} {rows:4d} {errs[0]:16.1e} {errs[1]:16.1e}")


def engine(args) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.random_gguf import write_random_gguf
    from pagedllm.model.loader import cache_root

    rng = np.random.default_rng(1)
    llms = {}
    for qtype in ("Q4_0", "Q8_0"):
        path = cache_root() / "random-gguf" / f"llama-3.2-1b-{qtype}.gguf"
        if not path.exists():
            write_random_gguf(path, "llama-3.2-1b", qtype)
        for mode in ("none", "int8"):
            llms[(qtype, mode)] = LLM(model=str(path), kv_cache_memory=64 << 20, max_num_seqs=4, max_model_len=1024,
                                      quant_activations=mode)

    def run(llm, new_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        prompt = [int(t) for t in rng.integers(100, 40000, size=128)]
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return time.perf_counter() - start

    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for key, llm in llms.items():
            for new_tokens in (1, 33):
                times.setdefault((key, new_tokens), []).append(run(llm, new_tokens))
    print("\nengine, 128-token prompt, wall time, median over rounds (decode: per round, the 33-token run less "
          "the 1-token one, / 32):")
    for key in llms:
        prefill = float(np.median(times[(key, 1)]))
        step = float(np.median([(b - a) / 32 for a, b in zip(times[(key, 1)], times[(key, 33)])]))
        print(f"{key[0]} quant_activations={key[1]}: prefill {1e3 * prefill:.0f} ms ({128 / prefill:.0f} tok/s), "
              f"decode {1e3 * step:.1f} ms a step")


if __name__ == "__main__":
    main()
