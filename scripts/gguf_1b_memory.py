"""Resident memory of loading a random Llama-3.2-1B-shaped GGUF, stage by stage (issue 25).

    PYTHONPATH=$PWD .venv/bin/python scripts/gguf_1b_memory.py --qtype Q4_0 [--kv-mib 64] [--decode]

The GGUF comes from ``pagedllm.bench.random_gguf`` (written once under
``$PAGEDLLM_CACHE/random-gguf``, as ``bench llamacpp --random-shape`` does). Each measurement runs in a
fresh process: the stages of ``LLM(model=<gguf>)`` are read from /proc/self/status (VmRSS now,
VmHWM since the previous stage: the peak counter is reset between stages through
/proc/self/clear_refs), split into anonymous and file-backed pages (the GGUF's memory map counts in
RSS while its pages are mapped). ``--decode`` also generates a few tokens, so a step's buffers count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile in MiB."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024
    return out


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def gguf_path(qtype: str, shape: str) -> Path:
    from pagedllm.bench.random_gguf import write_random_gguf
    from pagedllm.model.loader import cache_root

    path = cache_root() / "random-gguf" / f"{shape}-{qtype}.gguf"
    if not path.exists():
        write_random_gguf(path, shape, qtype)
    return path


def resolve(loader, path: Path) -> None:
    """The converted directory the load reads (config and tokenizer); also under a tree whose loader
    predates ``weights`` (PYTHONPATH=<an older checkout>: the before of a before/after)."""
    try:
        loader.resolve_hf_dir(str(path), weights=False)
    except TypeError:
        loader.resolve_hf_dir(str(path))


def child(args: argparse.Namespace) -> None:
    """One load in this process; prints one JSON line of stages."""
    stages: list[tuple[str, dict]] = []

    def mark(name: str) -> None:
        stages.append((name, status()))
        reset_peak()

    import torch  # noqa: F401

    import pagedllm  # noqa: F401
    from pagedllm import LLM, SamplingParams
    from pagedllm.model import loader
    from pagedllm.model.llama import LlamaForCausalLM

    path = gguf_path(args.qtype, args.shape)
    reset_peak()
    mark("imports")
    resolve(loader, path)  # the cached conversion (config, tokenizer): done before
    mark("convert (cached)")

    original_load, original_process = LlamaForCausalLM.load_weights, LlamaForCausalLM.process_weights_after_loading

    def load_weights(self, weights):
        mark("build model")
        loaded = original_load(self, weights)
        mark("load weights")
        return loaded

    def process(self):
        original_process(self)
        mark("repack (process_weights)")

    LlamaForCausalLM.load_weights, LlamaForCausalLM.process_weights_after_loading = load_weights, process
    t0 = time.perf_counter()
    llm = LLM(model=str(path), kv_cache_memory=args.kv_mib << 20, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len)
    load_s = time.perf_counter() - t0
    mark("engine ready (KV allocated)")
    if args.decode:
        llm.generate([list(range(1, 129))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        mark("after 128 + 8 tokens")
    import gc

    gc.collect()
    loader._release_free_heap()
    mark("after gc + malloc_trim")
    loaded = getattr(llm.engine.core.executor, "loaded", None)
    model = loaded.model if loaded is not None else None
    quant_bytes = float_bytes = 0
    if model is not None:
        from pagedllm.model.layers.quantized import QuantizedWeight

        seen = set()
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, QuantizedWeight) and id(value) not in seen:
                    seen.add(id(value))
                    quant_bytes += value.nbytes
        float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"stages": stages, "file_mib": path.stat().st_size / 2**20, "kv_mib": args.kv_mib,
                      "load_s": load_s, "quant_mib": quant_bytes / 2**20, "float_param_mib": float_bytes / 2**20}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qtype", default="Q4_0", choices=("Q4_0", "Q8_0"))
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--kv-mib", type=int, default=64, help="kv_cache_memory in MiB")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--decode", action="store_true", help="also generate 8 tokens after a 128-token prompt")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    path = gguf_path(args.qtype, args.shape)  # written here, so the child measures only the load
    from pagedllm.model import loader

    resolve(loader, path)  # config and tokenizer, converted once
    cmd = [sys.executable, __file__, "--child", "--qtype", args.qtype, "--shape", args.shape, "--kv-mib",
           str(args.kv_mib), "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if args.decode:
        cmd.append("--decode")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    file_mib, kv = result["file_mib"], result["kv_mib"]
    print(f"{path.name}: file {file_mib:.0f} MiB, KV cache {kv} MiB, load {result['load_s']:.1f} s; "
          f"quantized weights held {result['quant_mib']:.0f} MiB, float parameters {result['float_param_mib']:.0f} MiB")
    print(f"{'stage':30s} {'RSS':>6s} {'anon':>6s} {'file':>6s} {'peak':>6s}  (MiB; peak = VmHWM since the stage before)")
    base = result["stages"][0][1]["VmRSS"]
    for name, s in result["stages"]:
        print(f"{name:30s} {s['VmRSS']:6d} {s['RssAnon']:6d} {s['RssFile']:6d} {s['VmHWM']:6d}")
    peak = max(s["VmHWM"] for _, s in result["stages"])
    final = result["stages"][-1][1]["VmRSS"]
    print(f"peak {peak} MiB = {peak / (file_mib + kv):.2f}x (file + KV); after load {final} MiB = "
          f"{final / (file_mib + kv):.2f}x; above the imports ({base} MiB): peak "
          f"{(peak - base) / (file_mib + kv):.2f}x, after {(final - base) / (file_mib + kv):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
