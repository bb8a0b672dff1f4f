"""Benchmark: tensor_parallel_size 1 vs 2 on this machine (CPU, gloo on loopback).

    python -m pagedllm.bench.tensor_parallel [--layers 8] [--batch 8] [--new-tokens 32]

A random Llama (hidden 1024, 8 query / 4 KV heads, ~125M parameters by default) is saved to a
temporary directory, then each size runs the same greedy workload: a batch of decode-heavy
requests, and one long prompt (prefill). N=1 runs in this process with all CPU threads; each of
the N=2 ranks gets cpu_count/2 threads, so both use the whole machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _make_model(path: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def _run(path: str, tp: int, batch: int, new_tokens: int, prompt_len: int) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(model=path, tensor_parallel_size=tp, num_kv_blocks=512, max_num_batched_tokens=1024)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        decode_prompts = [{"prompt_token_ids": [100 + i] * 16} for i in range(batch)]
        llm.generate(decode_prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(decode_prompts, greedy, use_tqdm=False)
        decode_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(5, 5 + prompt_len))}],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill_s = time.perf_counter() - start
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "decode_tok_s": batch * new_tokens / decode_s,
            "decode_step_ms": decode_s / new_tokens * 1e3,
            "prefill_tok_s": prompt_len / prefill_s,
        }
    finally:
        llm.engine.core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        _make_model(path, args.layers)
        results = {tp: _run(path, tp, args.batch, args.new_tokens, args.prompt_len) for tp in (1, 2)}
    print(f"cpu_count={os.cpu_count()} layers={args.layers} batch={args.batch} new_tokens={args.new_tokens} "
          f"prompt_len={args.prompt_len}")
    print(f"{'N':>3} {'decode tok/s':>13} {'ms/step':>9} {'prefill tok/s':>14}")
    for tp, r in results.items():
        print(f"{tp:>3} {r['decode_tok_s']:>13.1f} {r['decode_step_ms']:>9.1f} {r['prefill_tok_s']:>14.1f}")
    print("greedy outputs identical:", results[1]["tokens"] == results[2]["tokens"])


if __name__ == "__main__":
    main()
