"""Which bfloat16 rounding moves an embedder's vectors: sentence-transformers' own model of a `pagedllm bench embed`
shape (random weights), with one kind of rounding inside F.linear at a time, against the same model in float32
(min cosine and max abs diff over a mixed-length batch); then the whole model in bfloat16. docs/embeddings.md,
"Where the bfloat16 error comes from".

With --cross-encoder: a one-label cross-encoder of the shape, its layers' linears on bf16 operands (float32 sums,
as `--dtype bf16-matmul`), all of them or all but the last few layers, against CrossEncoder.predict in float32
(max score difference over mixed-length pairs); its pooler and classifier stay float32, as in pagedllm.

    PYTHONPATH=$PWD .venv/bin/python scripts/bf16_error_sources.py --shape qwen3-0.6b --num-texts 24
    PYTHONPATH=$PWD .venv/bin/python scripts/bf16_error_sources.py --cross-encoder --num-texts 256
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


ROUNDINGS = {
    "weights": lambda linear, x, w, b: linear(x, _bf16(w), b),
    "inputs and weights": lambda linear, x, w, b: linear(_bf16(x), _bf16(w), b),
    "inputs, weights and output": lambda linear, x, w, b: _bf16(linear(_bf16(x), _bf16(w), None)) + (0 if b is None else b),
}


def main() -> None:
    from sentence_transformers import SentenceTransformer
    import torch.nn.modules.linear as linear_module

    from pagedllm.bench.embed_models import SHAPES, build_embedder, mixed_lengths, texts_of_lengths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="minilm", choices=sorted(SHAPES))
    parser.add_argument("--num-texts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cross-encoder", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.cross_encoder:
        cross_encoder_sources(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = build_embedder(args.shape, Path(tmp))
        texts = texts_of_lengths(SHAPES[args.shape], mixed_lengths(args.num_texts, 8, 256, 1), 2)
        model = SentenceTransformer(str(path), device="cpu")
        reference = model.encode(texts, convert_to_numpy=True).astype(np.float64)

        def report(name: str, vectors) -> None:
            v = np.asarray(vectors, dtype=np.float64)
            cosine = (v * reference).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(reference, axis=1)
            print(f"{args.shape}: {name}: min cosine {cosine.min():.7f}, max abs diff {np.abs(v - reference).max():.1e}")

        exact = linear_module.F.linear
        for name, rounded in ROUNDINGS.items():
            linear_module.F.linear = lambda x, w, b=None, rounded=rounded: rounded(exact, x, w, b)
            try:
                report(f"linears' {name} in bfloat16", model.encode(texts, convert_to_numpy=True))
            finally:
                linear_module.F.linear = exact
        whole = SentenceTransformer(str(path), device="cpu", model_kwargs={"torch_dtype": torch.bfloat16})
        report("whole model in bfloat16", whole.encode(texts, convert_to_numpy=True).astype(np.float32))


def cross_encoder_sources(args) -> None:
    from sentence_transformers.cross_encoder import CrossEncoder

    from pagedllm.bench.embed_models import SHAPES, build_cross_encoder, mixed_lengths, texts_of_lengths

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        model = CrossEncoder(str(build_cross_encoder(args.shape, Path(tmp))), device="cpu")
        queries = texts_of_lengths(shape, mixed_lengths(args.num_texts, 8, 32, 3), 3)
        documents = texts_of_lengths(shape, mixed_lengths(args.num_texts, 8, 256, 4), 4)
        pairs = list(zip(queries, documents))
        reference = model.predict(pairs).astype(np.float64)
        logits = model.predict(pairs, activation_fn=torch.nn.Identity()).astype(np.float64)
        print(f"{args.shape} cross-encoder: logits in [{logits.min():.2f}, {logits.max():.2f}], "
              f"scores in [{reference.min():.4f}, {reference.max():.4f}]")
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
            print(f"{args.shape} cross-encoder, bf16 operands in all but the last {kept} of {len(layers)} layers: "
                  f"max score diff {np.abs(scores - reference).max():.1e}")


if __name__ == "__main__":
    main()
