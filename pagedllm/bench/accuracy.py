"""What the quantized weights cost in accuracy: `pagedllm bench accuracy`.

    pagedllm bench accuracy [--model M.gguf] [--rows 1,17] [--max-text-tokens 1024]

1. Kernels: for every distinct weight shape of the model's first layer and its embedding (the LM head when
   tied), and every GGUF type the compiled kernel runs, ``x W^T`` by the kernel and by the dequantize-then-
   float32 path (torch's matmul of the dequantized weight), each against float64 on the same dequantized
   weight: the largest error over the output, relative to the output's largest magnitude. The weights are
   the model's own (dequantized, then quantized to each type with the ``gguf`` package); the gguf package
   cannot quantize to the K-quants, so those use random blocks of the same shape (sane scales), and only
   where the input width is a multiple of their 256-wide blocks.
   For Q8_0, Q4_0 and Q4_1 also the int8-activation kernel (``--quant-activations int8``: x quantized per
   32-wide block to int8), whose error is the activations' rounding, not float32's.
2. Perplexity of the model on a text the package ships (bench/perplexity_text.py) through each path the
   engine offers for the file: its weights dequantized to float32 (``--gguf-dequantize``), kept quantized
   through the kernels with float32 activations (``--quant-activations none``, the exact mode), with int8
   activations (the default where that kernel runs), and with int8 activations in the LM head too (not a
   mode the engine offers: measured to decide); and the same model requantized (from its dequantized
   weights, with the gguf package) to each ``--requantize`` type, through the kernels. From the prompt
   logprobs of one request each.
3. int8 activations against float32 ones on the same quantized weights (``--layer-prompts``,
   ``--greedy-prompts``): each decoder layer's output (its residual stream) over the prompts' tokens, the
   relative error ||int8 - none|| / ||none|| per layer, its largest and its mean over the layers; and the
   greedy continuations of chat prompts, none vs int8 vs int8 with the LM head too: how many are identical
   and the mean length of their common prefix.
"""

from __future__ import annotations

import math

import numpy as np

from pagedllm.bench.common import bench_subparser, format_table, int_list, write_result

KERNEL_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "accuracy", bench_accuracy,
                        help="quantized kernels vs float32 and float64; perplexity per weight path")
    p.add_argument("--rows", type=int_list, default=[1, 17], help="activation rows of each kernel check")
    p.add_argument("--max-text-tokens", type=int, default=1024, help="tokens of the shipped text scored")
    p.add_argument("--skip-perplexity", action="store_true")
    p.add_argument("--requantize", default="Q8_0,Q4_0",
                   help="also score the model requantized to these types (ones the gguf package can write)")
    p.add_argument("--layer-prompts", type=int, default=4,
                   help="prompts of the per-layer int8 vs float32 activation error (0: skip)")
    p.add_argument("--greedy-prompts", type=int, default=8,
                   help="chat prompts of the greedy agreement check, none vs int8 (0: skip)")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens per prompt of that check")
    p.add_argument("--first-answers", type=int, default=40,
                   help="times the first question is asked at the model's default sampling, one request at a time, "
                        "per activation mode (0: skip)")


def _random_k_blocks(qtype, n: int, k: int, magnitude: float, rng) -> np.ndarray:
    """Random K-quant rows of ``[n, k]`` whose values are about ``magnitude``: random bytes, then each
    super-block's fp16 scale (and min) set near the size that gives it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n, k // 256, block_bytes), dtype=np.uint8)
    offsets = (208,) if qtype == GGMLQuantizationType.Q6_K else (0, 2)  # where d (and dmin) sit in the block
    for offset in offsets:
        d = (rng.uniform(0.5, 1.5, (n, k // 256, 1)) * magnitude / 64).astype(np.float16)
        blocks[:, :, offset:offset + 2] = d.view(np.uint8)
    return blocks.reshape(n, -1)


def _model_weights(gguf_path) -> dict[str, np.ndarray]:
    """One float32 ``[n, k]`` weight per distinct shape: layer 0's projections and the embedding."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    weights: dict[str, np.ndarray] = {}
    shapes = set()
    for tensor in GGUFReader(gguf_path).tensors:
        if len(tensor.shape) != 2 or not (tensor.name.startswith("blk.0.") or tensor.name == "token_embd.weight"):
            continue
        w = dequantize(tensor.data, tensor.tensor_type).reshape(int(tensor.shape[1]), int(tensor.shape[0]))
        if w.shape not in shapes:
            shapes.add(w.shape)
            weights[tensor.name.removeprefix("blk.0.").removesuffix(".weight")] = w.astype(np.float32)
    return weights


def kernel_errors(gguf_path, rows: list[int], seed: int = 0, max_out_features: int | None = None) -> list[dict]:
    """Per (weight, type, rows): the kernel's and the float32 path's largest relative error vs float64
    (each weight's first ``max_out_features`` rows when given: the same kernels, less time)."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from pagedllm.model.layers.quantized import QuantizedWeight

    rng = np.random.default_rng(seed)
    results = []
    for name, w in _model_weights(gguf_path).items():
        w = w[:max_out_features]
        n, k = w.shape
        for type_name in KERNEL_TYPES:
            qtype = GGMLQuantizationType[type_name]
            k_quant = type_name.endswith("_K")
            if k_quant and k % 256:
                continue
            raw = (_random_k_blocks(qtype, n, k, float(np.abs(w).mean()), rng) if k_quant
                   else quantize(w, qtype))
            w_deq = dequantize(raw, qtype).reshape(n, k)
            kernel = QuantizedWeight(int(qtype), torch.from_numpy(np.ascontiguousarray(raw)), k)
            int8 = QuantizedWeight(int(qtype), torch.from_numpy(np.array(raw)), k)
            if not int8.use_int8_activations():  # a type (or a CPU) without the int8 kernel
                int8 = None
            w32 = torch.from_numpy(w_deq.astype(np.float32))
            for m in rows:
                x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
                exact = x.double().numpy() @ w_deq.astype(np.float64).T
                scale = float(np.abs(exact).max())
                kernel_err = float(np.abs(kernel.matmul(x).double().numpy() - exact).max()) / scale
                f32_err = float(np.abs((x @ w32.T).double().numpy() - exact).max()) / scale
                int8_err = (None if int8 is None
                            else float(np.abs(int8.matmul(x).double().numpy() - exact).max()) / scale)
                results.append({"weight": name, "shape": f"{n}x{k}", "type": type_name,
                                "weights": "random blocks" if k_quant else "the model's, requantized",
                                "rows": m, "kernel_rel_err": kernel_err, "float32_rel_err": f32_err,
                                "int8_activations_rel_err": int8_err})
    return results


def requantize_gguf(src, dst, type_name: str) -> None:
    """Copy the GGUF ``src`` to ``dst`` with every quantized 2-D weight dequantized and quantized to
    ``type_name`` (metadata and float tensors as they are)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(src)
    qtype = GGMLQuantizationType[type_name]
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        shape = [int(x) for x in reversed(tensor.shape)]  # numpy order: [rows, columns]
        if len(shape) == 2 and tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
            raw = quantize(w, qtype)
            writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(tensor.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llm(model: str | None, engine_args: dict, quant_activations: str, gguf_dequantize: bool = False,
         int8_lm_head: bool = False):
    """An engine on ``model`` with these activations (and, to measure it, an int8 LM head)."""
    from pagedllm import LLM
    from pagedllm.model.activation_format import use_int8_lm_head

    llm = LLM(**{**engine_args, "model": model, "gguf_dequantize": gguf_dequantize, "enable_prefix_caching": False,
                 "quant_activations": quant_activations})
    if int8_lm_head and not use_int8_lm_head(llm.engine.core.executor.runner.model):  # instrumentation
        raise SystemExit("the LM head has no weight of an int8 kernel type")
    return llm


def perplexity(model: str | None, gguf_dequantize: bool, max_tokens: int, engine_args: dict,
               quant_activations: str = "none", int8_lm_head: bool = False) -> dict:
    """The model's perplexity on the shipped text, weights through one path (prompt logprobs of one request)."""
    from pagedllm import SamplingParams
    from pagedllm.bench.perplexity_text import TEXT

    llm = _llm(model, engine_args, quant_activations, gguf_dequantize, int8_lm_head)
    token_ids = llm.get_tokenizer().encode(TEXT)[:max_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    logprobs = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], token_ids[1:])]
    del llm
    return {"tokens_scored": len(logprobs), "perplexity": math.exp(-sum(logprobs) / len(logprobs))}


GREEDY_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
                    "Explain what a hash table is in two sentences.", "List three prime numbers.",
                    "Who wrote Romeo and Juliet?", "Give me a tip for learning to cook.",
                    "What is 12 times 12?", "Describe the color blue to someone who cannot see.",
                    "Why is the sky blue?", "Name a famous painting and its painter.")


def _layer_outputs(llm, prompts: list[list[int]]) -> list:
    """Each decoder layer's output (its residual stream: the layer's output plus the residual it hands on),
    float64 ``[all prompts' tokens, hidden]``, one prefill step per prompt."""
    import torch

    from pagedllm import SamplingParams

    layers = llm.engine.core.executor.runner.model.model.layers  # instrumentation: hooks on the layers
    captured: list[list] = [[] for _ in layers]

    def keep(index):
        def hook(module, inputs, out):
            stream = out[0] + out[1] if isinstance(out, tuple) else out
            captured[index].append(stream.detach().double().clone())
        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]  # (the fused step turns off)
    try:
        for ids in prompts:
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(parts) for parts in captured]


def layer_errors(model: str | None, engine_args: dict, num_prompts: int, max_tokens: int = 256) -> dict:
    """Per decoder layer: ||int8 - none|| / ||none|| of its output over ``num_prompts`` slices of the shipped
    text (the same quantized weights, float32 vs int8 activations); the largest and the mean over layers."""
    from pagedllm.bench.perplexity_text import TEXT

    outputs = {}
    for mode in ("none", "int8"):
        llm = _llm(model, engine_args, mode)
        ids = llm.get_tokenizer().encode(TEXT)
        prompts = [ids[i * max_tokens // 2:(i * max_tokens // 2) + max_tokens // (1 + i % 2)]
                   for i in range(num_prompts)]
        outputs[mode] = _layer_outputs(llm, prompts)
        del llm
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(outputs["int8"], outputs["none"])]
    return {"prompts": num_prompts, "tokens": int(outputs["none"][0].shape[0]), "per_layer": errors,
            "max": max(errors), "mean": sum(errors) / len(errors)}


def greedy_agreement(model: str | None, engine_args: dict, num_prompts: int, max_tokens: int) -> dict:
    """Greedy continuations of chat prompts with float32 activations, int8 ones, and int8 in the LM head too:
    per pair, how many are identical and the mean length of their common prefix."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    questions = [GREEDY_QUESTIONS[i % len(GREEDY_QUESTIONS)] for i in range(num_prompts)]
    runs = {}
    for label, mode, head in (("none", "none", False), ("int8", "int8", False), ("int8 + LM head", "int8", True)):
        llm = _llm(model, engine_args, mode, int8_lm_head=head)
        prompts = [{"prompt_token_ids": llm.encode_chat([{"role": "user", "content": q}])} for q in questions]
        runs[label] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def agreement(seqs, base):
        return {"identical": sum(list(a) == list(b) for a, b in zip(seqs, base)), "prompts": len(base),
                "mean_common_prefix": sum(common(a, b) for a, b in zip(seqs, base)) / len(base), "tokens": max_tokens}

    return {"int8 vs none": agreement(runs["int8"], runs["none"]),
            "int8 + LM head vs none": agreement(runs["int8 + LM head"], runs["none"]),
            "int8 + LM head vs int8": agreement(runs["int8 + LM head"], runs["int8"])}


def first_answers(model: str | None, engine_args: dict, num_answers: int, max_tokens: int = 48) -> dict:
    """A newcomer's first question (GREEDY_QUESTIONS[0]) asked ``num_answers`` times, one request at a time as a
    chat client sends it, at the model's default sampling (the card's, for the embedded model): per activation
    mode, the answers that name Paris, the first token's three likeliest choices, and a few answers."""
    import dataclasses

    from pagedllm import SamplingParams

    messages = [{"role": "user", "content": GREEDY_QUESTIONS[0]}]
    result = {}
    for mode in ("none", "int8"):
        llm = _llm(model, engine_args, mode)
        params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=max_tokens)
        texts = [llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text for _ in range(num_answers)]
        first = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=1, logprobs=3), use_tqdm=False)
        top = sorted(first[0].outputs[0].logprobs[0].values(), key=lambda lp: -lp.logprob)
        result[mode] = {"asked": num_answers, "naming_paris": sum("Paris" in t for t in texts),
                        "first_token": [(lp.decoded_token, round(lp.logprob, 3)) for lp in top],
                        "sampling": {f: getattr(params, f) for f in ("temperature", "top_p")}, "answers": texts[:4]}
        del llm
    return result


def bench_accuracy(args, engine_args: dict) -> dict:
    from pagedllm.model.loader import default_gguf_path, gguf_source

    model = engine_args.get("model")
    gguf_path = gguf_source(model) if model else default_gguf_path()
    if gguf_path is None:
        raise SystemExit("bench accuracy needs a .gguf model (the default model is one)")
    errors = kernel_errors(gguf_path, args.rows)
    result = {"model": str(gguf_path), "kernels": errors}
    print(format_table(["weight", "shape", "type", "weights", "rows", "kernel vs float64", "float32 path vs float64",
                        "int8 activations vs float64"],
                       [[e["weight"], e["shape"], e["type"], e["weights"], e["rows"], e["kernel_rel_err"],
                         e["float32_rel_err"], "-" if e["int8_activations_rel_err"] is None
                         else e["int8_activations_rel_err"]] for e in errors], floatfmt="{:.1e}"))
    if not args.skip_perplexity:
        import tempfile
        from pathlib import Path

        from pagedllm.model.layers import quantized

        paths = {"float32 (dequantized at load)": (str(gguf_path), True),
                 "quantized kernels (the file's types), float32 activations": (str(gguf_path), False)}
        if quantized.int8_kernel_available():
            paths["quantized kernels, int8 activations (the default)"] = (str(gguf_path), False, "int8")
            paths["quantized kernels, int8 activations and LM head"] = (str(gguf_path), False, "int8", True)
        workdir = Path(tempfile.mkdtemp(prefix="pagedllm-requant-"))
        for type_name in filter(None, args.requantize.split(",")):
            dst = workdir / f"{type_name}.gguf"
            requantize_gguf(gguf_path, dst, type_name)
            paths[f"requantized to {type_name}, kernels"] = (str(dst), False)
            if quantized.int8_kernel_available():
                paths[f"requantized to {type_name}, kernels, int8 activations"] = (str(dst), False, "int8")
        result["perplexity"] = {label: perplexity(path_args[0], path_args[1], args.max_text_tokens, engine_args,
                                                  *path_args[2:])
                                for label, path_args in paths.items()}
        print()
        print(format_table(["weights", "tokens scored", "perplexity"],
                           [[label, p["tokens_scored"], p["perplexity"]]
                            for label, p in result["perplexity"].items()], floatfmt="{:.4f}"))
    from pagedllm.model.layers import quantized

    if args.layer_prompts and quantized.int8_kernel_available():
        layers = result["layer_errors"] = layer_errors(str(gguf_path), engine_args, args.layer_prompts)
        print(f"\nint8 vs float32 activations, each decoder layer's output over {layers['prompts']} prompts "
              f"({layers['tokens']} tokens): relative error max {layers['max']:.2e}, mean {layers['mean']:.2e}")
        print(format_table(["layer", "relative error"], [[i, e] for i, e in enumerate(layers["per_layer"])],
                           floatfmt="{:.2e}"))
    if args.greedy_prompts and quantized.int8_kernel_available():
        greedy = result["greedy"] = greedy_agreement(str(gguf_path), engine_args, args.greedy_prompts,
                                                     args.greedy_tokens)
        print()
        print(format_table(["greedy continuations", "identical", "prompts", "mean common prefix", "tokens"],
                           [[label, g["identical"], g["prompts"], g["mean_common_prefix"], g["tokens"]]
                            for label, g in greedy.items()], floatfmt="{:.1f}"))
    if args.first_answers and quantized.int8_kernel_available():
        answers = result["first_answers"] = first_answers(model, engine_args, args.first_answers)
        print(f"\n{GREEDY_QUESTIONS[0]!r} at the default sampling, one request at a time:")
        print(format_table(["activations", "naming Paris", "asked", "first token's likeliest (logprob)"],
                           [[mode, a["naming_paris"], a["asked"], ", ".join(f"{t!r} {lp}" for t, lp in a["first_token"])]
                            for mode, a in answers.items()]))
    write_result(args.out, "accuracy", result)
    return result
