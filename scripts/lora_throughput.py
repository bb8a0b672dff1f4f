"""Throughput of the Alpaca-like trace with K LoRA adapters spread over its requests vs none (the base alone),
one engine per setting, runs alternated round by round (a shared machine's slow spells last minutes).

    PYTHONPATH=$PWD python scripts/lora_throughput.py [--adapters 0,4] [--rounds 3] [--num-requests 64]

Adapters are random rank-R PEFT adapters on every projection, written in PEFT's format (no peft needed).
"0" runs an engine without --enable-lora; "0L" one with LoRA enabled but every request on the base; an "m" suffix
("4m") holds the slots as main did before session 13, for an A/B in one run: each linear's slots in its own plain
tensors (4 KB pages) instead of the huge-page SlotArena, and lora_sgmv_cpu's prefetch off while it runs (a
measurement, not a mode: the engine is patched after it starts).

2026-12-01, default model, 16 requests, rank 16, 2 rounds, a 2-vCPU machine at load 4.6-6.3 (shared):
    0: 94.7, 83.8 tok/s   0L: 97.9, 124.1   4 adapters: 60.9, 85.6   -> medians 4/0 = 0.82x, 4/0L = 0.66x
(0 and 0L run identical work yet differ by 1.24x: re-measure on a quiet machine before trusting either ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest
from pagedllm.bench.engine_utils import engine_prompts, request_params
from pagedllm.bench.workloads import WorkloadSpec, make_workload

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: Path, hf_config, rank: int, seed: int) -> str:
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for proj, (n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJ[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ), "bias": "none"}))
    return str(path)


def _plain_slots(llm) -> None:
    """Move an in-process engine's LoRA slots out of the arena into plain tensors of their own (4 KB pages)."""
    from pagedllm.model.layers import fused_decoder

    runner = llm.engine.core.executor.runner
    for slots in runner.lora.slots.values():
        slots.a, slots.b = slots.a.clone(), slots.b.clone()
    fused_decoder.invalidate(runner.model.model)  # its plan holds the arena's tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapters", default="0,4", help="comma-separated adapter counts; 0L = LoRA on, base only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    settings = args.adapters.split(",")
    max_k = max(int(s.rstrip("Lm")) for s in settings)
    requests = make_workload(WorkloadSpec(name="alpaca", num_requests=args.num_requests, max_model_len=2048))
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    engines, loras = {}, []
    for setting in settings:
        lora = setting != "0"
        kwargs = dict(enable_lora=True, max_loras=max(1, max_k), max_lora_rank=args.rank) if lora else {}
        engines[setting] = LLM(args.model, **kwargs)
        if setting.endswith("m"):
            _plain_slots(engines[setting])
    hf_config = next(iter(engines.values())).engine.core.model_info.hf_config
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(tmp / f"a{i}", hf_config, args.rank, i)) for i in range(max_k)]
    params = [request_params(r) for r in requests]
    num_out = sum(r.output_len for r in requests)
    results = {s: [] for s in settings}
    for _ in range(args.rounds):
        for setting, llm in engines.items():
            k = int(setting.rstrip("Lm"))
            torch.ops.pagedllm.lora_sgmv_prefetch(0 if setting.endswith("m") else 1)
            per_request = [loras[i % k] if k else None for i in range(len(requests))]
            llm.generate(engine_prompts(requests[:k or 1]), params[:k or 1], use_tqdm=False,
                         lora_request=per_request[:k or 1] if setting != "0" else None)  # warm-up, adapters read
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(engine_prompts(requests), params, use_tqdm=False,
                         lora_request=per_request if setting != "0" else None)
            results[setting].append(num_out / (time.perf_counter() - start))
            print(f"{setting:>3} adapters: {results[setting][-1]:.1f} output tok/s", flush=True)
    base = statistics.median(results[settings[0]])
    print("setting  median tok/s  vs first")
    for setting, rates in results.items():
        median = statistics.median(rates)
        print(f"{setting:>7}  {median:12.1f}  {median / base:8.2f}")
    assert not math.isnan(base)


if __name__ == "__main__":
    main()
