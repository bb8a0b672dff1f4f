"""The compiled CPU paged-attention op (``csrc/``): build it once at setup, load it at run time.

``python -m pagedllm.model.attention.cpu_op build`` (run by ``make setup``) compiles the C++
sources with ``torch.utils.cpp_extension`` into ``<venv>/lib/pagedllm-ops/<key>/``, where the key
hashes the sources, the torch version and the flags: editing a source or upgrading torch makes a
new key, so a stale library is never loaded. Nothing is compiled at the first request (several
tensor-parallel workers would race to build it).

The library holds two ops: ``paged_attention_cpu`` (one varlen call for decode rows, prompt chunks
over a cached prefix and mixed steps: a per-key path for items of few rows, a tiled micro-GEMM path
for long chunks) and ``kv_write_cpu`` (the slot-mapped K/V store), plus the small fused per-layer
ops of ``csrc/fused_ops.cpp`` (RMSNorm with the residual add, rotary, SiLU-and-mul), which
``pagedllm.model.layers.cpu_fused`` uses, and the packed small-row GEMM of ``csrc/cpu_gemm*.cpp``
(``gemm_packed_cpu``), which ``pagedllm.model.layers.cpu_gemm`` uses, and the GEMM on GGUF-quantized weights of
``csrc/quant_gemm*.cpp`` (``quant_gemm_cpu``; bfloat16 weights too, ``csrc/bf16_gemm*``; int8 activations,
``csrc/quant_gemm_int8*``, with ``quantize_act_cpu``; K-quants at their file size, ``csrc/quant_gemm_kq*``),
which ``pagedllm.model.layers.quantized`` uses, and
``decoder_layers_cpu`` (``csrc/decoder_layer.cpp``: every decoder layer of a step in one call, over those ops),
which ``pagedllm.model.layers.fused_decoder`` uses, and ``quant_rows_cpu`` / ``argmax_rows_cpu``
(``csrc/step_ops.cpp``: the quantized embedding lookup and the greedy argmax, one call each), and
``lora_sgmv_cpu`` (``csrc/lora_sgmv*.cpp``: one linear's LoRA deltas over rows grouped by adapter slot). The
attention query and output are float32; the cache
may be float32, float16 or bfloat16 (``--kv-cache-dtype``): 16-bit K/V are widened to float32 in
registers as they are read (F16C / AVX-512 conversions; bfloat16 is a shift), and ``kv_write_cpu``
rounds to nearest even on store, as ``Tensor.to`` does.

``load()`` loads the library and registers ``torch.ops.pagedllm.paged_attention_cpu``. If it is
not built, fails to load, the CPU lacks AVX2 + FMA + F16C, or ``PAGEDLLM_DISABLE_CPU_OP=1`` is set, it
logs the reason once and returns False; the engine then uses the torch reference.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.model.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[3] / "csrc"
SOURCES = ("paged_attention_op.cpp", "paged_attention_avx2.cpp", "paged_attention_avx512.cpp", "fused_ops.cpp",
           "cpu_gemm_op.cpp", "cpu_gemm_avx2.cpp", "cpu_gemm_avx512.cpp", "greedy_select.cpp",
           "thread_pool.cpp", "quant_gemm_op.cpp", "quant_gemm_avx2.cpp", "quant_gemm_avx512.cpp",
           "quant_gemm_int8_avx2.cpp", "quant_gemm_int8_avx512.cpp",
           "quant_gemm_kq_avx2.cpp", "quant_gemm_kq_avx512.cpp",
           "decoder_layer.cpp", "bf16_gemm_op.cpp", "bf16_gemm_avx2.cpp", "bf16_gemm_avx512.cpp", "step_ops.cpp",
           "lora_sgmv_op.cpp", "lora_sgmv_avx2.cpp", "lora_sgmv_avx512.cpp", "quant_dequant_bf16.cpp",
           "bf16_matmul_op.cpp")
HEADERS = ("fused_ops.h", "paged_attention.h", "paged_attention_kernel.h", "paged_attention_tile.h", "cpu_gemm.h", "cpu_gemm_kernel.h",
           "thread_pool.h", "quant_gemm.h", "quant_gemm_kernel.h", "quant_gemm_int8.h",
           "quant_gemm_int8_kernel.h", "int8_simd_avx2.h", "int8_simd_avx512.h", "quant_gemm_kq.h",
           "quant_gemm_kq_kernel.h", "panel_tiles.h", "bf16_gemm.h", "bf16_gemm_kernel.h",
           "lora_sgmv.h", "lora_sgmv_kernel.h", "quant_dequant_bf16.h", "exp_avx512.h")
# Baseline flags only: the ISA files pick their own targets with pragmas (never -march=native,
# so the library built on one machine runs on any x86-64 CPU with AVX2). -fopenmp at compile
# time only: at::parallel_for is an inline `#pragma omp parallel`, which without it runs on one
# thread whatever torch.set_num_threads says (the op ran single-threaded until this flag). Not at
# link time: the GOMP symbols resolve to the libgomp torch already loaded, so the op shares
# torch's intra-op threads instead of starting a second pool.
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp")
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
DISABLE_ENV = "PAGEDLLM_DISABLE_CPU_OP"
DIR_ENV = "PAGEDLLM_CPU_OP_DIR"

_state: dict[str, object] = {}


def build_key() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(CFLAGS).encode())
    return digest.hexdigest()[:16]


def library_dir(key: str) -> Path:
    return envs.PAGEDLLM_CPU_OP_DIR / key


def _library_name(key: str) -> str:
    return f"pagedllm_cpu_{key}"


def library_path() -> Path | None:
    """Where the library for these sources and this torch lives, or None without sources."""
    if not all((CSRC / n).is_file() for n in SOURCES + HEADERS):
        return None
    key = build_key()
    return library_dir(key) / f"{_library_name(key)}.so"


def build(verbose: bool = False) -> Path:
    """Compile the op (a no-op when the library for this key exists). Returns the library path."""
    from torch.utils import cpp_extension

    path = library_path()
    if path is None:
        raise FileNotFoundError(f"C++ sources not found under {CSRC}")
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    key = build_key()
    cpp_extension.load(
        name=_library_name(key), sources=[str(CSRC / n) for n in SOURCES], extra_cflags=list(CFLAGS),
        extra_include_paths=[str(CSRC)], build_directory=str(path.parent), is_python_module=False,
        verbose=verbose,
    )
    _state.pop("loaded", None)  # the build registered the op in this process: let load() see it
    _state["library"] = path
    return path


def _unavailable(reason: str) -> bool:
    logger.warning("compiled CPU attention unavailable (%s); using the torch reference", reason)
    _state["loaded"] = False
    _state["reason"] = reason
    return False


def load() -> bool:
    """True when ``torch.ops.pagedllm.paged_attention_cpu`` is usable here (logs once if not)."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    if envs.PAGEDLLM_DISABLE_CPU_OP:
        return _unavailable(f"{DISABLE_ENV} is set")
    envs.check_compiled_op_env()  # the library reads four variables itself: refuse a value it would misread
    if not hasattr(torch.ops.pagedllm, "paged_attention_cpu"):
        path = library_path()
        if path is None:
            return _unavailable(f"no C++ sources under {CSRC}")
        if not path.is_file():
            return _unavailable(f"not built for this source and torch {torch.__version__}: run "
                                f"`make setup` or `python -m pagedllm.model.attention.cpu_op build`")
        try:
            torch.ops.load_library(str(path))
        except Exception as exc:  # a library that does not load must not take the engine down
            return _unavailable(f"loading {path} failed: {exc}")
    if torch.ops.pagedllm.cpu_isa() == 0:
        return _unavailable("this CPU lacks AVX2 + FMA + F16C")
    _state["loaded"] = True
    return True


def unavailable_reason() -> str | None:
    return None if load() else str(_state.get("reason"))


def isa_name() -> str:
    """'avx512', 'avx2' or 'none': the kernel the op uses on this CPU."""
    return {2: "avx512", 1: "avx2"}.get(int(torch.ops.pagedllm.cpu_isa()), "none") if load() else "none"


def op_pool(enabled: bool | None = None, spin_us: int | None = None,
            yield_when_contended: bool | None = None) -> dict | None:
    """Query, and optionally set, the compiled ops' own worker threads (csrc/thread_pool.cpp): on,
    they wait for the next job spinning for ``spin_us`` microseconds (``PAGEDLLM_POOL_SPIN_US``,
    default 50) before sleeping; while the process is contended the pool hands its jobs to torch's
    OpenMP threads (``yield_when_contended``, default on; off, its workers take them, sleeping
    between them); off (``PAGEDLLM_DISABLE_OP_POOL=1``), the ops always run on OpenMP's threads,
    which the engine keeps passive. Returns the state, with counters (jobs, worker sleeps,
    contended windows, jobs handed off), or None where the library is not loaded."""
    if not load():
        return None
    state = torch.ops.pagedllm.op_pool_config(-1 if enabled is None else int(enabled),
                                              -1 if spin_us is None else int(spin_us),
                                              -1 if yield_when_contended is None else int(yield_when_contended))
    keys = ("enabled", "spin_us", "jobs", "worker_sleeps", "contended", "contended_windows", "yield_when_contended",
            "handed_off")
    flags = ("enabled", "contended", "yield_when_contended")
    return {k: (bool(v) if k in flags else int(v)) for k, v in zip(keys, state)}


KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Cache element types the op reads (widened to float32 in registers) and kv_write_cpu stores."""


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the op handles these inputs (else the caller uses the reference)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and kv_cache.dtype in KV_DTYPES
            and query.shape[-1] in SUPPORTED_HEAD_DIMS and query.stride(-1) == 1 and kv_cache.stride(-1) == 1)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    num_splits: int = 0,  # > 0 forces that many context splits per item (tests)
    isa: int = 0,  # 0 = the best this CPU has; 1 = AVX2 (tests the baseline kernel on an AVX-512 CPU)
    tile_min_rows: int = 0,  # > 0: items of at least this many rows (queries x group) go tiled; 0 = default
    tile_rows: int = 0,  # > 0: rows per item of a long chunk; 0 = default
    sliding_window: int | None = None,  # keys a query sees, itself included (paged.py); None = all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (paged.py); None = off
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as ``paged.paged_attention``, in one varlen call that reads blocks in place."""
    return torch.ops.pagedllm.paged_attention_cpu(
        query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        scale, num_splits, isa, tile_min_rows, tile_rows, -1 if sliding_window is None else sliding_window,
        0.0 if softcap is None else softcap,
    )


def supports_kv_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_write_cpu`` handles these inputs (else the caller uses ``index_copy_``)."""
    return (key.device.type == "cpu" and key.dtype == value.dtype == torch.float32 and kv_cache.dtype in KV_DTYPES
            and kv_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1)


def kv_write_cpu(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as ``paged.write_kv_cache``: each token's K and V at its flat slot, in place."""
    torch.ops.pagedllm.kv_write_cpu(key, value, kv_cache, slot_mapping)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.model.attention.cpu_op")
    parser.add_argument("command", choices=["build", "status"])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "build":
        try:
            path = build(verbose=args.verbose)
        except Exception as exc:  # setup goes on: the engine falls back to the torch reference
            print(f"pagedllm: building the CPU attention op failed ({exc}); the torch reference will be used")
            return 0
        print(f"pagedllm: CPU attention op at {path}")
    ok = load()
    print(f"pagedllm: CPU attention op {'loaded, kernel ' + isa_name() if ok else 'unavailable'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
