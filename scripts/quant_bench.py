"""Quantized GGUF weights vs the dequantized float32 path on the embedded default model, in one
process (so the ratios share the machine's load): resident memory after LLM(), single-user greedy
decode tok/s, and the linears alone at batch 1 (the kernel vs torch's float32 matmul).

    python scripts/quant_bench.py [--threads 2] [--prompt-len 128] [--new-tokens 128] [--rounds 2]

Memory is each LLM's RSS growth in a fresh child process (a process never returns freed heap
to a later measurement reliably); speed alternates the two engines round by round.
"""

import argparse
import json
import multiprocessing as mp
import os
import resource
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _memory_child(dequantize: bool, queue) -> None:
    import torch  # noqa: F401  (imports count for both sides alike, before the baseline)

    from pagedllm import LLM

    before = rss_mb()
    llm = LLM(gguf_dequantize=dequantize, kv_cache_memory=64 << 20)
    queue.put((rss_mb() - before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    del llm


def memory(dequantize: bool) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_memory_child, args=(dequantize, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def decode_rate(llm, prompt_ids: list[int], new_tokens: int) -> float:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == new_tokens
    return new_tokens / elapsed, list(out[0].outputs[0].token_ids)


def linears_batch1(model_q, model_f, rounds: int) -> dict:
    import torch

    def layers(model):
        return [m for m in model.modules() if hasattr(m, "quant_weight") and hasattr(m, "matmul")] + [model.lm_head]

    lq, lf = layers(model_q), layers(model_f)
    xs = [torch.randn(1, (l.quant_weight.k if l.quant_weight is not None else l.weight.shape[1])) for l in lq]

    def run_q():
        for layer, x in zip(lq, xs):
            layer.quant_weight.matmul(x)

    def run_f():  # torch's float32 matmul on the same float weights
        for layer, x in zip(lf, xs):
            torch.nn.functional.linear(x, layer.weight)

    def run_packed():  # the float32 path the engine runs today (its compiled packed GEMM where built)
        for layer, x in zip(lf, xs):
            layer.compute_logits(x) if layer is model_f.lm_head else layer.matmul(x, None)

    times = {"quant_kernel": [], "torch_f32": [], "engine_f32": []}
    for _ in range(rounds):
        for name, fn in (("quant_kernel", run_q), ("torch_f32", run_f), ("engine_f32", run_packed)):
            fn()
            start = time.perf_counter()
            for _ in range(5):
                fn()
            times[name].append((time.perf_counter() - start) / 5 * 1e3)
    best = {k: min(v) for k, v in times.items()}
    return {"ms_per_pass_quant": round(best["quant_kernel"], 2), "ms_per_pass_torch_f32": round(best["torch_f32"], 2),
            "ms_per_pass_engine_f32": round(best["engine_f32"], 2),
            "torch_f32_over_quant": round(best["torch_f32"] / best["quant_kernel"], 2),
            "engine_f32_over_quant": round(best["engine_f32"] / best["quant_kernel"], 2), "num_matmuls": len(lq)}


def per_shape(model_q, model_f, rows_list=(1, 8, 32), reps: int = 20) -> dict:
    """Layer 0's four linears and the LM head, each timed alone (best of 3 x reps calls), at a few
    row counts: the kernel, torch's F.linear on the float32 weight, and the engine's float32 path."""
    import torch

    def pick(model):
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj,
                "lm_head": model.lm_head}

    q, f = pick(model_q), pick(model_f)
    out = {}
    for name in q:
        wq = q[name].quant_weight
        for rows in rows_list:
            x = torch.randn(rows, wq.k)
            fns = {"quant": lambda: wq.matmul(x),
                   "torch_f32": lambda: torch.nn.functional.linear(x, f[name].weight),
                   "engine_f32": (lambda: f[name].compute_logits(x)) if name == "lm_head"
                   else (lambda: f[name].matmul(x, None))}
            best = {}
            for _ in range(3):
                for key, fn in fns.items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    best[key] = min(best.get(key, 1e9), (time.perf_counter() - start) / reps * 1e6)
            out[f"{name} {wq.n}x{wq.k} rows={rows}"] = {
                "us_quant": round(best["quant"]), "us_torch_f32": round(best["torch_f32"]),
                "us_engine_f32": round(best["engine_f32"]),
                "torch/quant": round(best["torch_f32"] / best["quant"], 2),
                "engine/quant": round(best["engine_f32"] / best["quant"], 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    result = {}
    if not args.skip_memory:
        (rq, peak_q), (rf, peak_f) = memory(False), memory(True)
        result["rss_growth_mb"] = {"quantized": round(rq), "float32": round(rf), "ratio": round(rf / rq, 2)}
        result["peak_rss_mb"] = {"quantized": round(peak_q), "float32": round(peak_f)}
    from pagedllm import LLM

    common = dict(num_threads=args.threads, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    llm_q = LLM(**common)
    llm_f = LLM(gguf_dequantize=True, **common)
    prompt = list(range(1000, 1000 + args.prompt_len))
    rates = {"quantized": [], "float32": []}
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in (("quantized", llm_q), ("float32", llm_f)):
            rate, tokens[name] = decode_rate(llm, prompt, args.new_tokens)
            rates[name].append(rate)
    best = {k: max(v) for k, v in rates.items()}
    result["decode_tok_s"] = {k: [round(r, 1) for r in v] for k, v in rates.items()}
    result["decode_ratio_best"] = round(best["quantized"] / best["float32"], 2)
    result["same_greedy_tokens"] = tokens["quantized"] == tokens["float32"]
    result["linears_batch1"] = linears_batch1(llm_q.engine.core.executor.runner.model,
                                              llm_f.engine.core.executor.runner.model, args.rounds + 2)
    result["per_shape"] = per_shape(llm_q.engine.core.executor.runner.model, llm_f.engine.core.executor.runner.model)
    result["args"] = vars(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
