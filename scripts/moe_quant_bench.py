"""A quantized mixture-of-experts GGUF: its experts held quantized vs dequantized to float32.

A random Qwen3-MoE (hidden 512, 4 layers, 32 experts of intermediate 256, top-4, 8 query / 2 KV
heads of 64, vocab 8192) is written as GGUF in QTYPE (tests/model/gguf_writer_helpers.py) and
loaded twice in one process: as it is (experts quantized, layers/moe.py) and with
``gguf_dequantize=True`` (float32). Prints the bytes each holds for the experts, the CPU time per
output token of one greedy request (16-token prompt, 65 tokens), the two engines alternating
round by round, and one MoE layer's forward at batch 1, the two layers alternating. One torch
thread and CPU time (``time.process_time``), so other jobs on a shared machine add little.

    PYTHONPATH=. python scripts/moe_quant_bench.py Q8_0 [--dir /tmp/moeq] [--rounds 8]
"""

import argparse
import os
import statistics
import time

import torch
from gguf import GGMLQuantizationType, GGUFReader

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_experts=32, moe_intermediate_size=256, num_experts_per_tok=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=8192, intermediate_size=1024,
             max_position_embeddings=1024, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             tie_word_embeddings=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("qtype", choices=["Q8_0", "Q4_0", "Q4_1"])
    parser.add_argument("--dir", default="/tmp/moeq")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.dir, exist_ok=True)
    os.environ.setdefault("PAGEDLLM_CACHE", os.path.join(args.dir, "cache"))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.model.layers.moe import SparseMoE
    from tests.model.gguf_writer_helpers import write_converted_gguf

    path = os.path.join(args.dir, f"qwen3moe-{args.qtype}.gguf")
    if not os.path.exists(path):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, initializer_range=0.05)).eval()
        write_converted_gguf(model, path, GGMLQuantizationType[args.qtype])
        del model
    experts = [t for t in GGUFReader(path).tensors if "_exps" in t.name]
    print(f"{args.qtype}: file {os.path.getsize(path)} B, its experts {sum(int(t.n_bytes) for t in experts)} B "
          f"({sorted({t.tensor_type.name for t in experts})})")
    llms = {"quantized": LLM(model=path, num_kv_blocks=64),
            "float32": LLM(model=path, num_kv_blocks=64, gguf_dequantize=True)}
    moes = {}
    for name, llm in llms.items():
        moes[name] = [m for m in llm.engine.core.executor.runner.model.modules() if isinstance(m, SparseMoE)]
        held_q = sum(m.experts.quantized_nbytes for m in moes[name])
        held_f = sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in moes[name])
        print(f"{name}: expert bytes held {held_q + held_f} (quantized {held_q}, float {held_f})")

    params = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 19))}]
    times, tokens = {name: [] for name in llms}, {}
    for llm in llms.values():
        llm.generate(prompt, params, use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for name, llm in llms.items():
            start = time.process_time()
            out = llm.generate(prompt, params, use_tqdm=False)
            times[name].append((time.process_time() - start) / 65)
            tokens[name] = out[0].outputs[0].token_ids
    ratios = [q / f for q, f in zip(times["quantized"], times["float32"])]
    print("ms per output token, by round:", {k: [round(v * 1e3, 2) for v in vs] for k, vs in times.items()})
    print("fastest:", {k: round(min(v) * 1e3, 2) for k, v in times.items()},
          f"quantized / float32 per round: median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    print("greedy tokens equal:", tokens["quantized"] == tokens["float32"])

    x = torch.randn(1, SHAPE["hidden_size"])
    layer_times = {name: [] for name in moes}
    with torch.inference_mode():
        for _ in range(9):
            for name, layers in moes.items():
                layers[0](x)
                start = time.process_time()
                for _ in range(200):
                    layers[0](x)
                layer_times[name].append((time.process_time() - start) / 200)
    layer_ratios = [q / f for q, f in zip(layer_times["quantized"], layer_times["float32"])]
    print("one MoE layer at batch 1, us (fastest):", {k: round(min(v) * 1e6, 1) for k, v in layer_times.items()},
          f"quantized / float32 median {statistics.median(layer_ratios):.2f}")


if __name__ == "__main__":
    main()
