"""`pagedllm bench quant-gemm`: the compiled quantized kernels (csrc/quant_gemm*.cpp) side by side on one weight
shape, and the bytes each weight holds against the file's.

    pagedllm bench quant-gemm --threads 1          (with PAGEDLLM_DISABLE_OP_POOL=1: one thread, nothing else)
    pagedllm bench quant-gemm --threads 2 --rows 1,32 --kinds Q3_K:int8,Q4_K:int8
    pagedllm bench quant-gemm --threads 2 --rows 1,32 --kinds Q4_0:int8,Q4_1:int8,Q5_0:int8,Q5_1:int8,IQ4_NL:int8
    pagedllm bench quant-gemm --threads 1 --rows 512,2048 --n 2048 --kinds Q4_K:int8,Q6_K:int8,Q4_0:int8
    pagedllm bench quant-gemm --threads 2 --rows 32,64,128,256,1024 --kinds Q4_K:int8,Q4_K:bf16,Q4_0:int8,Q4_0:bf16

A kind is TYPE:ACTIVATIONS. `int8` is the int8-activation kernel at every row count; `bf16` the same weight through
the bf16 prefill path (csrc/quant_dequant_bf16.cpp, AMX CPUs) at every row count; `float` the float-activation path
(the K-quants' 12-bit QX panels). The default shape is Llama-3.2-1B's (K = 2048; N = 8192 and 2048).

Milliseconds per call, best of interleaved rounds (the kinds alternate, so they share whatever else the machine
does: read the ratios), and at one row the weight bytes read per second (GB/s of the bytes held).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, int_list, write_result

DEFAULT_KINDS = "Q4_K:int8,Q4_K:float,Q6_K:int8,Q6_K:float,Q3_K:int8,Q3_K:float,Q4_0:int8"
ACTIVATIONS = ("int8", "bf16", "float")


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "quant-gemm", bench_quant_gemm, engine=False,
                        help="the compiled quantized kernels side by side on one weight shape (ms per call, GB/s)")
    p.add_argument("--kinds", type=parse_kinds, default=DEFAULT_KINDS,
                   help="TYPE:ACTIVATIONS pairs, comma-separated (see the doc)")
    p.add_argument("--rows", type=int_list, default=[1, 16, 256], help="activation rows per call, comma-separated")
    p.add_argument("--n", type=int_list, default=[8192, 2048], help="weight rows (output features), comma-separated")
    p.add_argument("--k", type=int, default=2048, help="weight columns (input features), a multiple of 256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each kind's best is kept")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per round at 16 rows or fewer (one above)")


def parse_kinds(text: str) -> list[tuple[str, str]]:
    """'Q4_K:int8,Q4_0:float' -> [('Q4_K', 'int8'), ('Q4_0', 'float')]; an error naming a bad one."""
    from gguf import GGMLQuantizationType

    kinds = []
    for kind in (k for k in text.split(",") if k):
        type_name, _, mode = kind.partition(":")
        if type_name not in GGMLQuantizationType.__members__ or mode not in ACTIVATIONS:
            raise argparse.ArgumentTypeError(f"{kind!r} is not TYPE:ACTIVATIONS (a GGUF type, then one of {ACTIVATIONS})")
        kinds.append((type_name, mode))
    return kinds


def random_weight(type_name: str, n: int, k: int, rng):
    """GGUF rows of ``type_name`` and its qtype: the 32-weight types quantized from Gaussian weights, IQ4_NL
    (gguf has no quantizer for it) random indices under a small fp16 scale, K-quants random blocks with small
    fp16 scales."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.model.layers import quantized

    qtype = int(GGMLQuantizationType[type_name])
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qtype), qtype
    if type_name == "IQ4_NL":
        blocks = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
        blocks[:, :, :2] = np.full((n, k // 32, 1), 3e-4, np.float16).view(np.uint8)
        return blocks.reshape(n, -1), qtype
    block_bytes = quantized.GGUF_BLOCKS[qtype][1]
    blocks = rng.integers(0, 256, (n, k // 256, block_bytes), dtype=np.uint8)
    for offset in {"Q6_K": (208,), "Q3_K": (108,)}.get(type_name, (0, 2)):  # d (and dmin)
        blocks[:, :, offset : offset + 2] = rng.uniform(1e-4, 1e-3, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1), qtype


def best_ms(fn, repeats: int) -> float:
    fn()  # warm: the first call may pack or allocate
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def bench_quant_gemm(args, engine_args: dict) -> dict:
    import numpy as np
    import torch

    from pagedllm.model.layers import quantized

    kinds = args.kinds
    if args.k % 256:
        raise SystemExit(f"--k {args.k}: the weight's columns must be a multiple of 256 (a K-quant block)")
    if not quantized.kernel_available():
        raise SystemExit("the compiled quantized kernel does not run here (make setup builds it)")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    weights, file_bytes = {}, {}
    for n in args.n:
        for type_name, mode in kinds:
            raw, qtype = random_weight(type_name, n, args.k, rng)
            low_precision = mode in ("int8", "bf16")
            weight = quantized.QuantizedWeight(qtype, torch.from_numpy(raw), args.k, int8_activations=low_precision)
            if low_precision and not weight.use_int8_activations():
                raise SystemExit(f"{type_name} has no int8-activation kernel here: ask for {type_name}:float")
            weights[(n, type_name, mode)] = weight
            file_bytes[(n, type_name, mode)] = raw.size
    xs = {rows: torch.randn(rows, args.k) for rows in args.rows}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for key, weight in weights.items():
            for rows in args.rows:
                # the bf16 path from one row on, or never (the int8 kernel at every row count)
                previous = torch.ops.pagedllm.quant_gemm_bf16_rows(1 if key[2] == "bf16" else 0)
                try:
                    ms = best_ms(lambda: weight.matmul(xs[rows]), args.repeats if rows <= 16 else 1)
                finally:
                    torch.ops.pagedllm.quant_gemm_bf16_rows(previous)
                times.setdefault(key + (rows,), []).append(ms)
    results = []
    for (n, type_name, mode), weight in weights.items():
        ms = {rows: min(times[(n, type_name, mode, rows)]) for rows in args.rows}
        results.append({"n": n, "k": args.k, "type": type_name, "activations": mode,
                        "held_over_file": weight.nbytes / file_bytes[(n, type_name, mode)], "ms": ms,
                        "gb_s_one_row": weight.nbytes / (ms[1] * 1e-3) / 1e9 if 1 in ms else None})
    result = {"threads": torch.get_num_threads(), "rounds": args.rounds, "rows": args.rows, "results": results}
    write_result(Path(args.out), "quant-gemm", result)
    print(f"K = {args.k}, {result['threads']} thread(s); ms per call (best of {args.rounds} rounds); "
          "GB/s = bytes held / time at 1 row")
    print(format_table(["n", "type", "acts", "held/file", *(f"M={r} ms" for r in args.rows), "GB/s M=1"],
                       [[r["n"], r["type"], r["activations"], f"{r['held_over_file']:.3f}",
                         *(f"{r['ms'][rows]:.3f}" for rows in args.rows),
                         "-" if r["gb_s_one_row"] is None else f"{r['gb_s_one_row']:.1f}"] for r in results]))
    return result
