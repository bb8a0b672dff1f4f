"""A random-weight GGUF of a real model's shape: "a realistic size without a hub".

    python -m pagedllm.bench.random_gguf --shape llama-3.2-1b --qtype Q4_0 --out /tmp/llama1b-q4_0.gguf
    python -m pagedllm.bench.random_gguf --shape qwen3-30b-a3b --qtype Q4_K_M --out /tmp/qwen3-30b-a3b.gguf

The tokenizer (and with it the vocabulary size) is the embedded default model's, SmolLM2's 49152-token
BPE, copied key by key from its GGUF: both pagedllm and llama.cpp's server need a real tokenizer to
start, and no other is on the machine. So ``llama-3.2-1b`` here is Llama-3.2-1B's decoder (hidden
2048, 16 layers, 32 query / 8 KV heads of 64, intermediate 8192, rope base 500000, tied embeddings)
with a 49152-token vocabulary instead of 128256 (the embedding is 0.10 B parameters instead of
0.26 B: 1.07 B in all instead of 1.24 B), and plain rope (Llama 3's rope-scaling
frequencies only matter past 8K tokens of context). ``qwen3-30b-a3b`` is Qwen3-30B-A3B's decoder
(architecture ``qwen3moe``: hidden 2048, 48 layers, 32 query / 4 KV heads of 128 with q/k norms, 128
experts of intermediate 768, 8 active, renormalised; rope base 1e6, context 40960, an untied LM head) with
the same vocabulary: 30.1 B parameters instead of 30.5 B, 17.0 GiB (18.3 GB) in Q4_K_M.

Weights are random quantized blocks written directly (``random_blocks.py``: the dequantized weights'
standard deviation ~0.02 as in Llama's initialization): the same bytes a quantizer would write, but a file
takes seconds to minutes, not numpy quantization's hours. ``Q4_0``, ``Q8_0``, ``Q5_0`` and ``Q5_1`` put every
2-D weight, the embedding included, in the one type ("pure", like llama-quantize --pure); ``Q4_K_M`` mixes Q4_K and Q6_K as
llama.cpp's llama-quantize does (``random_blocks.q4_k_m_type``), ``Q3_K_M`` Q3_K with Q4_K, Q5_K and Q6_K
(``random_blocks.q3_k_m_type``). Norms are float32 ones, a mixture-of-experts
router float32 random. The file is written one tensor at a time (headers first, then each tensor made,
written and dropped), so a 17 GiB file takes the memory of its largest tensor, not its size.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.bench.random_blocks import BLOCK, WEIGHT_STD, q3_k_m_type, q4_k_m_type, random_blocks

QTYPES = ("Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q4_K_M", "Q3_K_M")
MIXES = {"Q4_K_M": q4_k_m_type, "Q3_K_M": q3_k_m_type}
"""llama.cpp's mixes: the type each tensor gets, by name."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float = 10000.0
    context: int = 8192
    dim_per_head: int | None = None
    """A head's width where it is not hidden / heads (Qwen3's 128 at hidden 2048 and 32 heads)."""
    experts: int = 0
    """Experts of each layer's MLP (0: a dense llama; else a qwen3moe, every layer sparse)."""
    experts_used: int = 0
    expert_intermediate: int = 0
    rms_eps: float = 1e-5
    tied_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim_per_head or self.hidden // self.heads

    @property
    def arch(self) -> str:
        return "qwen3moe" if self.experts else "llama"


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, rope_theta=500000.0),
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, rope_theta=100000.0),
    "qwen3-30b-a3b": Shape(hidden=2048, layers=48, heads=32, kv_heads=4, intermediate=6144, rope_theta=1e6,
                           context=40960, dim_per_head=128, experts=128, experts_used=8, expert_intermediate=768,
                           rms_eps=1e-6, tied_embeddings=False),
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=2048),
    # Every width a multiple of 256, so K-quant mixes need no fallback type.
    "tiny-qwen3moe": Shape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, context=2048,
                           dim_per_head=64, experts=8, experts_used=2, expert_intermediate=256, rms_eps=1e-6,
                           tied_embeddings=False),
}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    """Numpy order: [rows, cols], or [experts, rows, cols] for stacked experts."""
    qtype: str | None
    """A block type of random_blocks.py; None: float32 (norms: ones; a router: random)."""

    @property
    def nbytes(self) -> int:
        if self.qtype is None:
            return 4 * int(np.prod(self.shape))
        per_block, block_bytes = BLOCK[self.qtype]
        return int(np.prod(self.shape[:-1])) * self.shape[-1] // per_block * block_bytes


def tensor_plan(s: Shape, qtype: str, vocab: int) -> list[TensorPlan]:
    """Every tensor of the file, in file order, with its shape and type. Q4_K_M and Q3_K_M need every weight's
    columns to be a multiple of 256 (llama.cpp would fall back to another type per tensor; the shapes here need
    none)."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def weight(name: str, *shape: int) -> TensorPlan:
        kind = MIXES[qtype](name, s.layers, s.tied_embeddings) if qtype in MIXES else qtype
        if kind is not None and shape[-1] % BLOCK[kind][0]:
            raise ValueError(f"{qtype} puts {name} in {kind}, whose rows need a multiple of {BLOCK[kind][0]} "
                             f"columns; the shape gives {shape[-1]}")
        return TensorPlan(name, shape, kind)

    plan = [weight("token_embd.weight", vocab, s.hidden)]
    for i in range(s.layers):
        b = f"blk.{i}"
        plan += [TensorPlan(f"{b}.attn_norm.weight", (s.hidden,), None),
                 weight(f"{b}.attn_q.weight", q, s.hidden), weight(f"{b}.attn_k.weight", kv, s.hidden),
                 weight(f"{b}.attn_v.weight", kv, s.hidden), weight(f"{b}.attn_output.weight", s.hidden, q)]
        if s.experts:
            e, inter = s.experts, s.expert_intermediate
            plan += [TensorPlan(f"{b}.attn_q_norm.weight", (s.head_dim,), None),
                     TensorPlan(f"{b}.attn_k_norm.weight", (s.head_dim,), None),
                     TensorPlan(f"{b}.ffn_norm.weight", (s.hidden,), None),
                     TensorPlan(f"{b}.ffn_gate_inp.weight", (e, s.hidden), None),
                     weight(f"{b}.ffn_gate_exps.weight", e, inter, s.hidden),
                     weight(f"{b}.ffn_up_exps.weight", e, inter, s.hidden),
                     weight(f"{b}.ffn_down_exps.weight", e, s.hidden, inter)]
        else:
            plan += [TensorPlan(f"{b}.ffn_norm.weight", (s.hidden,), None),
                     weight(f"{b}.ffn_gate.weight", s.intermediate, s.hidden),
                     weight(f"{b}.ffn_up.weight", s.intermediate, s.hidden),
                     weight(f"{b}.ffn_down.weight", s.hidden, s.intermediate)]
    plan.append(TensorPlan("output_norm.weight", (s.hidden,), None))
    if not s.tied_embeddings:
        plan.append(weight("output.weight", vocab, s.hidden))
    return plan


def _tensor_data(t: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The bytes (quantized: uint8 [..., row bytes]) or float32 values of one planned tensor."""
    if t.qtype is not None:
        rows = int(np.prod(t.shape[:-1]))
        return random_blocks(rows, t.shape[-1], t.qtype, rng).reshape(*t.shape[:-1], -1)
    if "ffn_gate_inp" in t.name:  # the router: random, or every token picks the same experts
        return rng.normal(0.0, WEIGHT_STD, size=t.shape).astype(np.float32)
    return np.ones(t.shape, dtype=np.float32)


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
    """Write a random-weight GGUF of ``shape`` (llama, or qwen3moe where it has experts) in ``qtype`` (Q4_0,
    Q8_0, Q5_0, Q5_1 or the Q4_K_M or Q3_K_M mix) with the tokenizer of ``tokenizer_gguf`` (default: the embedded model's), one
    tensor at a time. Returns the path."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    from pagedllm.model.loader import default_gguf_path

    s = SHAPES[shape] if isinstance(shape, str) else shape
    if qtype not in QTYPES:  # before any file is made
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(None, s.arch)
    writer.add_name(f"random {shape if isinstance(shape, str) else 'custom'} {qtype}")
    writer.add_file_type({"Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
                          "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
                          "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q3_K_M": LlamaFileType.MOSTLY_Q3_K_M}[qtype])
    writer.add_quantization_version(2)
    vocab = _copy_tokenizer(writer, Path(tokenizer_gguf) if tokenizer_gguf else default_gguf_path())
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_vocab_size(vocab)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_intermediate)

    plan = tensor_plan(s, qtype, vocab)
    for t in plan:  # the header lists every tensor before any is made
        if t.qtype is None:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
        else:
            byte_shape = (*t.shape[:-1], t.nbytes // int(np.prod(t.shape[:-1])))
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes,
                                   raw_dtype=GGMLQuantizationType[t.qtype])
    writer.open_output_file(tmp)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for data in _tensors(plan, rng):
        writer.write_tensor_data(data)
    writer.close()
    tmp.replace(path)  # a half-written file never carries the final name
    return path


def _tensors(plan: list[TensorPlan], rng: np.random.Generator) -> Iterator[np.ndarray]:
    for t in plan:
        data = _tensor_data(t, rng)
        assert data.nbytes == t.nbytes, (t.name, data.nbytes, t.nbytes)
        yield data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedllm.bench.random_gguf", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--qtype", default="Q4_0", choices=QTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    path = write_random_gguf(args.out, args.shape, args.qtype, seed=args.seed)
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
