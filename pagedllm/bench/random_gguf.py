"""A random-weight GGUF of a real model's shape: "a realistic size without a hub".

    python -m pagedllm.bench.random_gguf --shape llama-3.2-1b --qtype Q4_0 --out /tmp/llama1b-q4_0.gguf

The tokenizer (and with it the vocabulary size) is the embedded default model's, SmolLM2's 49152-token
BPE, copied key by key from its GGUF: both pagedllm and llama.cpp's server need a real tokenizer to
start, and no other is on the machine. So ``llama-3.2-1b`` here is Llama-3.2-1B's decoder (hidden
2048, 16 layers, 32 query / 8 KV heads of 64, intermediate 8192, rope base 500000, tied embeddings)
with a 49152-token vocabulary instead of 128256 (the embedding is 0.10 B parameters instead of
0.26 B: 1.07 B in all instead of 1.24 B), and plain rope (Llama 3's rope-scaling
frequencies only matter past 8K tokens of context).

Weights are random quantized blocks written directly (random int8 / 4-bit codes under one scale per
block of 32, the dequantized weights' standard deviation ~0.02 as in Llama's initialization): the
same bytes a quantizer would write, but the 1 B-parameter file takes seconds, not the minutes of
numpy quantization. Every 2-D weight, the embedding included, is in the one type ("pure", like
llama-quantize --pure); norms are float32 ones.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float = 10000.0
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, rope_theta=500000.0),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_theta=100000.0),
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=2048),
}


def _random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes (rows, cols / 32 * block bytes) of random Q8_0 or Q4_0 blocks."""
    from gguf import GGMLQuantizationType

    if cols % 32:
        raise ValueError(f"a {qtype.name} row needs a multiple of 32 columns, got {cols}")
    blocks = rows * (cols // 32)
    if qtype == GGMLQuantizationType.Q8_0:
        code_bytes, code_std = 32, 74.0  # int8 codes uniform in [-128, 127]
    elif qtype == GGMLQuantizationType.Q4_0:
        code_bytes, code_std = 16, 4.32  # 4-bit codes uniform in [1, 15], minus 8: symmetric about 0
    else:
        raise ValueError(f"random blocks are written in Q8_0 or Q4_0, not {qtype.name}")
    raw = np.empty((blocks, 2 + code_bytes), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:
        raw[:, 2:] = rng.integers(0, 256, size=(blocks, code_bytes), dtype=np.uint8)
    else:
        low, high = rng.integers(1, 16, size=(2, blocks, code_bytes), dtype=np.uint8)
        raw[:, 2:] = low | (high << 4)
    scales = np.full(blocks, WEIGHT_STD / code_std, dtype=np.float16)
    raw[:, :2] = scales.view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, -1)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str) -> tuple[list[tuple], int]:
    """The tokenizer.* keys of the GGUF at ``source`` as (key, value, type, array item type), and its
    vocabulary size. Cached: gguf's reader takes seconds over a real vocabulary's 100 K strings."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    fields, vocab = [], 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        fields.append((key, value, vtype, sub))
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return fields, vocab


def _copy_tokenizer(writer, source: Path) -> int:
    """Copy the tokenizer.* keys of the GGUF at ``source``; returns its vocabulary size."""
    fields, vocab = _tokenizer_fields(str(source))
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    return vocab


def write_random_gguf(path: str | Path, shape: str | Shape = "llama-3.2-1b", qtype: str = "Q4_0",
                      tokenizer_gguf: str | Path | None = None, seed: int = 0) -> Path:
    """Write a random-weight llama-architecture GGUF of ``shape`` in ``qtype`` (Q4_0 or Q8_0) with the
    tokenizer of ``tokenizer_gguf`` (default: the embedded model's). Returns the path."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    from pagedllm.model.loader import default_gguf_path

    s = SHAPES[shape] if isinstance(shape, str) else shape
    q = GGMLQuantizationType[qtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random {shape if isinstance(shape, str) else 'custom'} {qtype}")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_0 if q == GGMLQuantizationType.Q4_0 else LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(2)
    vocab = _copy_tokenizer(writer, Path(tokenizer_gguf) if tokenizer_gguf else default_gguf_path())
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)

    rng = np.random.default_rng(seed)
    ones = np.ones(s.hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", _random_blocks(vocab, s.hidden, q, rng), raw_dtype=q)
    kv = s.kv_heads * s.head_dim
    for i in range(s.layers):
        for name, (rows, cols) in (("attn_q", (s.hidden, s.hidden)), ("attn_k", (kv, s.hidden)),
                                   ("attn_v", (kv, s.hidden)), ("attn_output", (s.hidden, s.hidden)),
                                   ("ffn_gate", (s.intermediate, s.hidden)), ("ffn_up", (s.intermediate, s.hidden)),
                                   ("ffn_down", (s.hidden, s.intermediate))):
            writer.add_tensor(f"blk.{i}.{name}.weight", _random_blocks(rows, cols, q, rng), raw_dtype=q)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)  # a half-written file never carries the final name
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedllm.bench.random_gguf", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--qtype", default="Q4_0", choices=("Q4_0", "Q8_0"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    path = write_random_gguf(args.out, args.shape, args.qtype, seed=args.seed)
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
