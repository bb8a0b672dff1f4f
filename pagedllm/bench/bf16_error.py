"""`pagedllm bench bf16-error`: which bfloat16 rounding moves an embedder's vectors, measured in sentence-transformers'
own model of a `pagedllm bench embed` shape (random weights) against the same model in float32.

    pagedllm bench bf16-error --shape qwen3-0.6b --num-texts 24
    pagedllm bench bf16-error --cross-encoder --num-texts 256

An embedder: one kind of rounding inside every F.linear at a time (the weights; the inputs and weights; the inputs,
weights and output), then the whole model in bfloat16; min cosine and max abs diff over a mixed-length batch.

With --cross-encoder: a one-label cross-encoder of the shape, its layers' linears on bf16 operands (float32 sums, as
`--dtype bf16-matmul`), all of them or all but the last few layers, against CrossEncoder.predict in float32 (max
score difference over mixed-length pairs); its pooler and classifier stay float32, as in pagedllm.
docs/embeddings.md, "Where the bfloat16 error comes from", reads these.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pagedllm.bench.common import bench_subparser, write_result


def add_parser(subparsers) -> None:
    from pagedllm.bench.embed_models import SHAPES

    p = bench_subparser(subparsers, "bf16-error", bench_bf16_error, engine=False,
                        help="which bfloat16 rounding moves an embedder's vectors (sentence-transformers' model)")
    p.add_argument("--shape", default="minilm", choices=sorted(SHAPES))
    p.add_argument("--num-texts", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cross-encoder", action="store_true", help="a one-label cross-encoder of the shape instead")


def _bf16(t):
    import torch

    return t.to(torch.bfloat16).float()


ROUNDINGS = {
    "weights": lambda linear, x, w, b: linear(x, _bf16(w), b),
    "inputs and weights": lambda linear, x, w, b: linear(_bf16(x), _bf16(w), b),
    "inputs, weights and output": lambda linear, x, w, b: _bf16(linear(_bf16(x), _bf16(w), None)) + (0 if b is None else b),
}
"""How each rounding wraps F.linear(x, w, b)."""


def bench_bf16_error(args, engine_args: dict) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    rows = cross_encoder_errors(args) if args.cross_encoder else embedder_errors(args)
    result = {"shape": args.shape, "num_texts": args.num_texts, "cross_encoder": args.cross_encoder, "rows": rows}
    write_result(Path(args.out), "bf16-error", result)
    for row in rows:
        print(f"{args.shape}: " + ", ".join(f"{key} {value:.7g}" if isinstance(value, float) else str(value)
                                             for key, value in row.items()))
    return result


def embedder_errors(args) -> list[dict]:
    import numpy as np
    import torch
    import torch.nn.modules.linear as linear_module
    from sentence_transformers import SentenceTransformer

    from pagedllm.bench.embed_models import SHAPES, build_embedder, mixed_lengths, texts_of_lengths

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_embedder(args.shape, Path(tmp))
        texts = texts_of_lengths(SHAPES[args.shape], mixed_lengths(args.num_texts, 8, 256, 1), 2)
        model = SentenceTransformer(str(path), device="cpu")
        reference = model.encode(texts, convert_to_numpy=True).astype(np.float64)

        def row(name: str, vectors) -> dict:
            v = np.asarray(vectors, dtype=np.float64)
            cosine = (v * reference).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(reference, axis=1)
            return {"rounding": name, "min_cosine": float(cosine.min()), "max_abs_diff": float(np.abs(v - reference).max())}

        exact = linear_module.F.linear
        for name, rounded in ROUNDINGS.items():
            linear_module.F.linear = lambda x, w, b=None, rounded=rounded: rounded(exact, x, w, b)
            try:
                rows.append(row(f"linears' {name} in bfloat16", model.encode(texts, convert_to_numpy=True)))
            finally:
                linear_module.F.linear = exact
        whole = SentenceTransformer(str(path), device="cpu", model_kwargs={"torch_dtype": torch.bfloat16})
        rows.append(row("whole model in bfloat16", whole.encode(texts, convert_to_numpy=True).astype(np.float32)))
    return rows


def cross_encoder_errors(args) -> list[dict]:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sentence_transformers.cross_encoder import CrossEncoder

    from pagedllm.bench.embed_models import SHAPES, build_cross_encoder, mixed_lengths, texts_of_lengths

    shape = SHAPES[args.shape]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = CrossEncoder(str(build_cross_encoder(args.shape, Path(tmp))), device="cpu")
        queries = texts_of_lengths(shape, mixed_lengths(args.num_texts, 8, 32, 3), 3)
        documents = texts_of_lengths(shape, mixed_lengths(args.num_texts, 8, 256, 4), 4)
        pairs = list(zip(queries, documents))
        reference = model.predict(pairs).astype(np.float64)
        layers = model.model.bert.encoder.layer

        def rounded_forward(linear):
            return lambda x: F.linear(_bf16(x), _bf16(linear.weight), linear.bias)

        for kept in range(len(layers) + 1):
            rounded = [m for layer in layers[:len(layers) - kept] for m in layer.modules()
                       if isinstance(m, torch.nn.Linear)]
            for m in rounded:
                m.forward = rounded_forward(m)
            try:
                scores = model.predict(pairs).astype(np.float64)
            finally:
                for m in rounded:
                    del m.forward
            rows.append({"float32_last_layers": kept, "layers": len(layers),
                         "max_score_diff": float(np.abs(scores - reference).max()),
                         "score_range": f"[{reference.min():.4f}, {reference.max():.4f}]"})
    return rows
