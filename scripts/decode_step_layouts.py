"""One decode step of a model, before vs after the CPU GEMM layouts, side by side in one run.

    PYTHONPATH=$PWD python scripts/decode_step_layouts.py [--batch 64] [--context 128] [--threads 1 2]

"after" is the model as load_model returns it (process_weights_after_loading applied); "before"
is a second copy with every linear weight made row-major again and every packed copy (compiled
GEMM panels, MKL's packed head) dropped, i.e. F.linear on [out, in] weights as the checkpoint
stores them. The two run different GEMMs, so their float32 logits differ by summation order: the
check is identical greedy tokens and logits within 1e-3 of the largest logit's magnitude (through 30
layers over random KV, measured up to 3.4e-4 at batch 16). A step is the model's
forward for ``batch`` sequences of ``context`` cached tokens plus one new token each, then the
logits of those rows (no sampling, no scheduler). Figures: min and median over interleaved rounds.
"""

import argparse
import statistics
import time

import torch

from pagedllm.model import AttentionMetadata, load_model, set_forward_context


def revert_layouts(model) -> None:
    for module in model.modules():
        if hasattr(module, "input_size") and hasattr(module, "weight"):
            module.weight.data = module.weight.data.contiguous()
        if hasattr(module, "gemm_weight"):
            module.gemm_weight = None
        if hasattr(module, "packed_weight"):
            module.packed_weight = None


def decode_inputs(model, batch: int, context: int, block_size: int = 16):
    attn = model.model.layers[0].self_attn
    blocks_per_seq = -(-(context + 1) // block_size)
    kv_caches = [torch.randn(2, batch * blocks_per_seq, block_size, attn.num_kv_heads, attn.head_dim)
                 for _ in model.model.layers]
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    slots = tables[:, context // block_size] * block_size + context % block_size
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1),
        seq_lens=torch.full((batch,), context + 1),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context + 1,
        block_size=block_size,
    )
    input_ids = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    return metadata, kv_caches, input_ids, torch.full((batch,), context)


def step(model, metadata, kv_caches, input_ids, positions) -> torch.Tensor:
    with torch.no_grad(), set_forward_context(metadata, kv_caches):
        return model.compute_logits(model(input_ids, positions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    after = load_model(args.model).model
    before = load_model(args.model).model
    revert_layouts(before)
    inputs = decode_inputs(after, args.batch, args.context)
    logits_after, logits_before = step(after, *inputs), step(before, *inputs)
    assert torch.equal(logits_after.argmax(-1), logits_before.argmax(-1)), "greedy tokens differ"
    torch.testing.assert_close(logits_after, logits_before, rtol=0, atol=1e-3 * logits_before.abs().max().item())
    print(f"decode step, batch {args.batch}, context {args.context}, float32, ms per step")
    print("| threads | before (F.linear, [out,in]) min / median | after (as loaded: packed for the compiled GEMM) min / median "
          "| speedup (min) |")
    print("|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {"before": [], "after": []}
        for name, model in (("before", before), ("after", after)):
            step(model, *inputs)  # warm-up
        for r in range(args.rounds):
            order = [("before", before), ("after", after)]
            for name, model in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                step(model, *inputs)
                times[name].append((time.perf_counter() - start) * 1e3)
        b, a = times["before"], times["after"]
        print(f"| {threads} | {min(b):.1f} / {statistics.median(b):.1f} | {min(a):.1f} / {statistics.median(a):.1f} "
              f"| x{min(b) / min(a):.2f} |", flush=True)


if __name__ == "__main__":
    main()
