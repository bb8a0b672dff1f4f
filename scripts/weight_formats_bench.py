"""float32 vs bf16 vs int8 (Q8_0) weights for an unquantized checkpoint, in one process so the ratios
share the machine's load (docs/benchmarks.md, "bf16 and int8 weights for float checkpoints").

    python scripts/weight_formats_bench.py [--rounds 3] [--skip-kernels] [--skip-model] [--threads N] [--cpu-time]

1. Kernels, one linear at 1 and 64 rows, alternating round by round (median of rounds): the float32
   path (the compiled packed GEMM the float32 linears use), the compiled bf16 kernel (AVX-512 and
   AVX2 builds of it), torch's bf16 F.linear (oneDNN: activations rounded to bf16 too) and the Q8_0
   kernel that int8 uses.
2. The default model's float32 weights (its converted directory) saved as a bf16 checkpoint, loaded
   three ways: float32 (``--quantization float32``), bf16 (``auto``: the checkpoint's own bf16) and
   int8: the weight bytes each model holds (every distinct tensor its modules keep: parameters,
   packed copies, the bf16 greedy head) and the decode step at 1 and 64 requests (the time of 40
   generated tokens minus that of 8, over 32 steps, so prefill cancels out).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path


CLOCK = time.perf_counter


def timed(fn, reps: int) -> float:
    fn()
    start = CLOCK()
    for _ in range(reps):
        fn()
    return (CLOCK() - start) / reps


def kernels(rounds: int) -> None:
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.model.layers import cpu_gemm, quantized

    assert quantized.kernel_available(), "the compiled library is not built"
    op = torch.ops.pagedllm.quant_gemm_cpu
    shapes = [(3072, 576, "SmolLM2-135M gate_up"), (576, 1536, "SmolLM2-135M down"), (8192, 2048, "1B-class up")]
    for n, k, label in shapes:
        w = torch.randn(n, k) * 0.05
        wb = w.to(torch.bfloat16)
        f32 = cpu_gemm.pack(w)
        bf = quantized.repack(quantized.BF16, wb.view(torch.uint8))
        q8 = quantized.repack(quantized.Q8_0, torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0)))
        for m in (1, 64):
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            variants = {
                "float32 (compiled GEMM)": lambda: cpu_gemm.gemm(x, f32, None, n),
                "bf16 kernel avx512": lambda: op(x, bf, quantized.BF16_KERNEL, n, None, 2),
                "bf16 kernel avx2": lambda: op(x, bf, quantized.BF16_KERNEL, n, None, 1),
                "torch bf16 F.linear": lambda: F.linear(xb, wb).float(),
                "int8 (Q8_0 kernel)": lambda: op(x, q8, quantized.Q8_0, n, None, 0),
            }
            reps = max(5, int(4e8 // (n * k * max(m, 8))))
            times = {name: [] for name in variants}
            for _ in range(rounds):
                for name, fn in variants.items():
                    times[name].append(timed(fn, reps))
            base = statistics.median(times["float32 (compiled GEMM)"])
            print(f"{label} [{n} x {k}], {m} rows:")
            for name, ts in times.items():
                t = statistics.median(ts)
                print(f"  {name:26s} {t * 1e6:9.1f} us   float32 / this = {base / t:5.2f}x")


def held_bytes(model) -> int:
    """Bytes of every distinct tensor the model's modules keep (parameters, packed copies, heads)."""
    import torch

    from pagedllm.model.layers.quantized import QuantizedWeight

    seen: dict[int, int] = {}

    def add(value, depth=0) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel():
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, QuantizedWeight):
            add(value.packed)
        elif depth == 0 and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for v in vars(value).values():  # e.g. the greedy head's bf16 copy
                add(v, 1)

    for module in model.modules():
        for value in list(vars(module).values()) + list(module._parameters.values()) + list(module._buffers.values()):
            add(value)
    return sum(seen.values())


def decode_step(llm, batch: int, rounds_out: list) -> None:
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(16)]} for i in range(batch)]

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    rounds_out.append((run(40) - run(8)) / 32)


def accuracy(llm, reference) -> tuple[int, float]:
    """(identical leading greedy tokens, max |logprob difference| over them) against ``reference``."""
    from pagedllm import SamplingParams

    messages = [{"role": "user", "content": "Name three colours and say why the sky is blue."}]
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)
    ours, ref = (x.generate(text, params, use_tqdm=False)[0].outputs[0] for x in (llm, reference))
    same = 0
    while same < len(ref.token_ids) and ours.token_ids[same] == ref.token_ids[same]:
        same += 1
    err = max((abs(a[t].logprob - b[t].logprob) for a, b, t in
               zip(ours.logprobs[:same], ref.logprobs[:same], ref.token_ids[:same])), default=float("nan"))
    return same, err


def model(rounds: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from pagedllm import LLM
    from pagedllm.model.loader import resolve_hf_dir

    source = resolve_hf_dir(None)  # the default model's float32 conversion
    with tempfile.TemporaryDirectory() as tmp:
        bf16_dir = Path(tmp) / "smollm2-bf16"
        bf16_dir.mkdir()
        for f in source.iterdir():
            if f.suffix == ".safetensors":
                save_file({k: v.to(torch.bfloat16) if v.dim() == 2 else v for k, v in load_file(f).items()},
                          str(bf16_dir / f.name), metadata={"format": "pt"})
            elif f.is_file():
                (bf16_dir / f.name).write_bytes(f.read_bytes())
        llms = {q: LLM(model=str(bf16_dir), quantization=q, kv_cache_memory=256 << 20)
                for q in ("float32", "auto", "int8")}
        names = {"float32": "float32", "auto": "bf16", "int8": "int8"}
        held = {q: held_bytes(llm.engine.core.executor.runner.model) for q, llm in llms.items()}
        params = {q: sum(p.numel() * p.element_size() for p in llm.engine.core.executor.runner.model.parameters())
                  + sum(m.quant_weight.nbytes for m in {id(m.quant_weight): m for m in
                        llm.engine.core.executor.runner.model.modules()
                        if getattr(m, "quant_weight", None) is not None}.values())
                  for q, llm in llms.items()}
        steps = {(q, b): [] for q in llms for b in (1, 64)}
        for _ in range(rounds):
            for b in (1, 64):
                for q, llm in llms.items():
                    decode_step(llm, b, steps[(q, b)])
        agreement = {q: accuracy(llm, llms["float32"]) for q, llm in llms.items() if q != "float32"}
        print("SmolLM2-135M (bf16 checkpoint):")
        for q, (same, err) in agreement.items():
            print(f"  {names[q]} vs float32, 48 greedy tokens of a chat prompt: the first {same} identical; "
                  f"largest |chosen-token logprob difference| over them {err:.4f}")
        for q in llms:
            s1, s64 = statistics.median(steps[(q, 1)]), statistics.median(steps[(q, 64)])
            f1, f64 = statistics.median(steps[("float32", 1)]), statistics.median(steps[("float32", 64)])
            print(f"  {names[q]:8s} weights {params[q] / 1e6:7.1f} MB (all held: {held[q] / 1e6:7.1f} MB); "
                  f"decode step 1 req {s1 * 1e3:6.2f} ms ({f1 / s1:4.2f}x float32), "
                  f"64 req {s64 * 1e3:7.2f} ms ({f64 / s64:4.2f}x float32)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true",
                        help="kernels timed by this process's CPU time (with --threads 1: what a call costs, "
                             "not how long a loaded machine made it wait)")
    args = parser.parse_args()
    import torch

    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK = time.process_time

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_kernels:
        kernels(args.rounds)
    if not args.skip_model:
        model(args.rounds)


if __name__ == "__main__":
    main()
