"""KV blocks a long conversation holds on a sliding-window model, with the blocks behind the window freed
(the default) and without (the same engine with a manager that frees nothing). A measurement, not a test.

The model is a tiny random MistralForCausalLM (every layer windowed); what is measured is block counts,
which do not depend on the weights. Each conversation is a prompt and one long greedy answer; several run
side by side (their prompts start one step apart). Reported per mode: the blocks held at the peak (every
conversation running) and at the last step (the last conversation alone, at its full length), and their
bytes for this model and for Mistral-7B's shape (32 layers x 8 KV heads x 128, 16-bit: 128 KiB a token).

    PYTHONPATH=$PWD python scripts/window_kv_saving.py [--window 256] [--block-size 16] [--prompt-len 512]
                                                       [--new-tokens 1536] [--conversations 4]
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from transformers import MistralConfig, MistralForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_interface import paged_kv_cache_manager

MISTRAL_7B_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, 16-bit


def run(path: str, args, freeing: bool) -> dict:
    factory = None if freeing else paged_kv_cache_manager  # without the window: nothing freed
    llm = LLM(model=path, block_size=args.block_size, kv_cache_manager_factory=factory, enable_prefix_caching=False,
              max_num_batched_tokens=args.prompt_len)
    core = llm.engine.core
    kv = core.kv_cache_manager
    used = []
    core.step_listeners.append(lambda out, _: used.append(kv.kv_stats().num_used_blocks))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return dict(peak=max(used), end=used[-1], bytes_per_block=core.kv_bytes_per_block,
                tokens=[o.outputs[0].token_ids for o in outputs])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=1536)
    parser.add_argument("--conversations", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, sliding_window=args.window,
                           max_position_embeddings=args.prompt_len + args.new_tokens + 16)
    with tempfile.TemporaryDirectory() as path:
        MistralForCausalLM(config).save_pretrained(path)
        freed, whole = run(path, args, True), run(path, args, False)
    assert freed["tokens"] == whole["tokens"], "freeing changed the outputs"
    length = args.prompt_len + args.new_tokens
    print(f"{args.conversations} conversations of {length} tokens ({length / args.window:.0f}x the window of "
          f"{args.window}), blocks of {args.block_size}:")
    for name, r in (("freed behind the window", freed), ("nothing freed", whole)):
        print(f"  {name:24s} peak {r['peak']:5d} blocks ({_sizes(r['peak'], r, args)}), "
              f"one conversation at its end {r['end']:4d} blocks ({_sizes(r['end'], r, args)})")
    print(f"  freeing holds {freed['peak'] / whole['peak']:.3f} of the blocks at the peak, "
          f"{freed['end'] / whole['end']:.3f} for one conversation at its end")


def _sizes(num_blocks: int, r: dict, args) -> str:
    mib = num_blocks * args.block_size * MISTRAL_7B_BYTES_PER_TOKEN / 2**20
    return f"{num_blocks * r['bytes_per_block'] / 2**10:.0f} KiB here, {mib:.0f} MiB at Mistral-7B's shape"


if __name__ == "__main__":
    main()
