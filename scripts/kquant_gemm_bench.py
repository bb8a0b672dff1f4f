"""The K-quant int8-activation kernels (csrc/quant_gemm_kq*) against the float-activation path the
K-quants take without them (the 12-bit QX panels) and the Q4_0 int8-activation kernel, on the
Llama-3.2-1B shape (K = 2048; N = 8192 and 2048), and the bytes each weight holds against the file's.

    PYTHONPATH=$PWD PAGEDLLM_DISABLE_OP_POOL=1 .venv/bin/python scripts/kquant_gemm_bench.py --threads 1

    PYTHONPATH=$PWD .venv/bin/python scripts/kquant_gemm_bench.py --threads 2 --rows 1 32 \
        --kinds Q3_K:int8 Q4_K:int8                                          (Q3_K against Q4_K)

    PYTHONPATH=$PWD .venv/bin/python scripts/kquant_gemm_bench.py --threads 2 --rows 1 32 \
        --kinds Q4_0:int8 Q4_1:int8 Q5_0:int8 Q5_1:int8 IQ4_NL:int8         (Q5_0 / Q5_1 / IQ4_NL against Q4_0 / Q4_1)

    PYTHONPATH=$PWD PAGEDLLM_DISABLE_OP_POOL=1 .venv/bin/python scripts/kquant_gemm_bench.py --threads 1 \
        --rows 512 2048 --n 2048 --kinds Q4_K:int8 Q6_K:int8 Q4_0:int8      (prefill row counts)

    PYTHONPATH=$PWD .venv/bin/python scripts/kquant_gemm_bench.py --threads 2 --rows 32 64 128 256 1024 \
        --kinds Q4_K:int8 Q4_K:bf16 Q6_K:int8 Q6_K:bf16 Q4_0:int8 Q4_0:bf16   (the bf16 prefill path, AMX CPUs)

`int8` is the int8-activation kernel at every row count; `bf16` the same weight through the bf16 prefill path
(csrc/quant_dequant_bf16.cpp) at every row count; `float` the float-activation path.

ms per call, best of interleaved rounds (the kernels alternate, so they share whatever else the machine
does: read the ratios), and for one row the weight bytes read per second (GB/s, the bytes held).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

K = 2048
NS = (8192, 2048)
KINDS = (("Q4_K", "int8"), ("Q4_K", "float"), ("Q6_K", "int8"), ("Q6_K", "float"), ("Q3_K", "int8"), ("Q3_K", "float"),
         ("Q4_0", "int8"))


def random_weight(type_name: str, n: int, k: int, rng) -> tuple[np.ndarray, int]:
    """GGUF rows of ``type_name`` (K-quants: random blocks with small fp16 scales; the 32-weight types:
    quantized Gaussian weights) and their qtype."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.model.layers import quantized

    qtype = int(GGMLQuantizationType[type_name])
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qtype), qtype
    if type_name == "IQ4_NL":  # (gguf has no IQ4_NL quantizer) random indices, a small fp16 d
        blocks = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
        blocks[:, :, :2] = np.full((n, k // 32, 1), 3e-4, np.float16).view(np.uint8)
        return blocks.reshape(n, -1), qtype
    bb = quantized.GGUF_BLOCKS[qtype][1]
    blocks = rng.integers(0, 256, (n, k // 256, bb), dtype=np.uint8)
    for offset in {"Q6_K": (208,), "Q3_K": (108,)}.get(type_name, (0, 2)):  # d (and dmin)
        blocks[:, :, offset : offset + 2] = rng.uniform(1e-4, 1e-3, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1), qtype


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    from pagedllm.model.layers.quantized import QuantizedWeight

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--kinds", nargs="+", default=[f"{t}:{m}" for t, m in KINDS],
                   help="TYPE:ACTIVATIONS pairs, e.g. Q4_K:int8 Q4_0:int8")
    p.add_argument("--n", type=int, nargs="+", default=list(NS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    weights, file_bytes = {}, {}
    for n in args.n:
        for type_name, mode in (kind.split(":") for kind in args.kinds):
            raw, qtype = random_weight(type_name, n, K, rng)
            w = QuantizedWeight(qtype, torch.from_numpy(raw), K, int8_activations=mode in ("int8", "bf16"))
            if mode in ("int8", "bf16"):
                assert w.use_int8_activations()
            weights[(n, type_name, mode)] = w
            file_bytes[(n, type_name, mode)] = raw.size
    xs = {rows: torch.randn(rows, K) for rows in args.rows}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for key, w in weights.items():
            for rows in args.rows:
                x = xs[rows]
                repeats = args.repeats if rows <= 16 else 1
                # the bf16 path from 1 row, or never (the int8 kernel at every row count)
                previous = torch.ops.pagedllm.quant_gemm_bf16_rows(1 if key[2] == "bf16" else 0)
                times.setdefault(key + (rows,), []).append(best_ms(lambda: w.matmul(x), repeats))
                torch.ops.pagedllm.quant_gemm_bf16_rows(previous)
    print(f"K = {K}, {torch.get_num_threads()} thread(s); ms per call (best of {args.rounds} rounds); "
          "GB/s = bytes held / time at 1 row")
    print(f"{'n':>5s} {'type':6s} {'acts':5s} {'held/file':>9s} " + " ".join(f"{f'M={r} ms':>10s}" for r in args.rows)
          + f" {'GB/s M=1':>9s}")
    for key, w in weights.items():
        n, type_name, mode = key
        ms = [min(times[key + (rows,)]) for rows in args.rows]
        rate = w.nbytes / (ms[0] * 1e-3) / 1e9 if args.rows[0] == 1 else float("nan")
        print(f"{n:5d} {type_name:6s} {mode:5s} {w.nbytes / file_bytes[key]:9.3f} "
              + " ".join(f"{m:10.3f}" for m in ms) + f" {rate:9.1f}")


if __name__ == "__main__":
    main()
