"""The model a GGUF's metadata describes, checked before conversion: hyper-parameters within sane
bounds and consistent with each other, the tensors an architecture needs present with the shapes
those hyper-parameters imply, and the tokenizer agreeing with the embedding.

Each bound below is what a real checkpoint of a supported architecture stays well inside and what
the loader can allocate for (the rotary tables are precomputed for ``context_length`` positions).
Shapes are in GGUF order, the fastest dimension first: a Hugging Face ``[out, in]`` weight is
``(in, out)`` here.
"""

from __future__ import annotations

import math

from gguf import MODEL_TENSOR as T, TENSOR_NAMES, GGUFValueType

from pagedllm.errors import InvalidModelFileError, ModelLoadError
from pagedllm.model import gguf_arch
from pagedllm.model.gguf_validate import FLOAT_TYPES, INTEGER_TYPES, ArrayValue, GGUFMetadata, read_metadata

MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17  # embedding and feed-forward widths
MAX_HEAD_DIM = 1024
MAX_CONTEXT = 1 << 20  # the rotary tables hold this many positions in float32
MAX_EXPERTS = 1024
MAX_ROPE_BASE = 1e12
SPECIAL_TOKEN_KEYS = ("bos", "eos", "unknown", "padding", "separator", "seperator", "cls", "mask", "eot", "eom")
"""(``seperator`` is how llama.cpp's converter spells the key.)"""

_NORMS = (T.ATTN_NORM, T.FFN_NORM, T.FFN_PRE_NORM, T.ATTN_POST_NORM, T.FFN_POST_NORM, T.TOKEN_EMBD_NORM,
          T.ATTN_OUT_NORM, T.LAYER_OUT_NORM)


class _Hparams:
    """Reads ``{arch}.*`` keys with a type and a range each; a wrong one raises naming the key."""

    def __init__(self, metadata: GGUFMetadata, arch: str) -> None:
        self.metadata, self.arch = metadata, arch

    def fail(self, key: str, what: str) -> None:
        raise InvalidModelFileError(self.metadata.path, f"key {key!r}", what)

    def int(self, name: str, low: int, high: int, default: int | None = None, full_key: bool = False) -> int | None:
        key = name if full_key else f"{self.arch}.{name}"
        found = self.metadata.fields.get(key)
        if found is None:
            if default is None and low > 0 and not full_key:
                self.fail(key, "is missing")
            return default
        value_type, value = found
        if value_type not in INTEGER_TYPES:
            self.fail(key, f"must be an integer, got {_describe(value_type, value)}")
        if not low <= value <= high:
            self.fail(key, f"is {value}, outside [{low}, {high}]")
        return value

    def float(self, name: str, low: float, high: float, default: float | None = None,
              required: bool = False) -> float | None:
        key = f"{self.arch}.{name}"
        found = self.metadata.fields.get(key)
        if found is None:
            if required:
                self.fail(key, "is missing")
            return default
        value_type, value = found
        if value_type not in FLOAT_TYPES and value_type not in INTEGER_TYPES:
            self.fail(key, f"must be a number, got {_describe(value_type, value)}")
        if not math.isfinite(value):
            self.fail(key, f"is {value}, not a finite number")
        if not low <= value <= high:
            self.fail(key, f"is {value:g}, outside [{low:g}, {high:g}]")
        return value


def _describe(value_type: GGUFValueType, value) -> str:
    if isinstance(value, ArrayValue):
        return f"an array of {value.length} {value.item_type.name}"
    return f"{value!r} ({value_type.name})"


def validate_gguf(path) -> GGUFMetadata:
    """``path``'s metadata once the structure (gguf_validate.py) and the model it describes are checked;
    InvalidModelFileError otherwise. Reads no tensor data."""
    metadata = read_metadata(path)
    check_model(metadata)
    return metadata


def check_model(metadata: GGUFMetadata) -> None:
    """InvalidModelFileError for the first inconsistency found (module docstring). Files of an architecture
    pagedllm does not read pass unchecked here: the conversion names the supported ones."""
    found = metadata.fields.get("general.architecture")
    if found is None or found[0] != GGUFValueType.STRING:
        raise InvalidModelFileError(metadata.path, "key 'general.architecture'",
                                    "is missing" if found is None else f"must be a string, got {_describe(*found)}")
    arch = found[1]
    if arch not in gguf_arch.SUPPORTED_ARCHITECTURES:
        return
    h = _Hparams(metadata, arch)
    tensors = {t.name: t for t in metadata.tensors}
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise InvalidModelFileError(metadata.path, "tensor 'token_embd.weight'", "is missing")
    hidden = h.int("embedding_length", 1, MAX_WIDTH)
    num_heads = h.int("attention.head_count", 1, hidden)
    if f"{arch}.attention.key_length" not in metadata.fields and hidden % num_heads:
        h.fail(f"{arch}.attention.head_count", f"{num_heads} does not divide embedding_length ({hidden})")
    num_kv_heads = h.int("attention.head_count_kv", 1, num_heads, default=num_heads)
    if num_heads % num_kv_heads:
        h.fail(f"{arch}.attention.head_count_kv",
               f"{num_kv_heads} does not divide attention.head_count ({num_heads})")
    head_dim = h.int("attention.key_length", 2, MAX_HEAD_DIM, default=hidden // num_heads)
    encoder = arch in gguf_arch.ENCODER_ARCHITECTURES
    if head_dim % 2 and not encoder:
        h.fail(f"{arch}.attention.key_length", f"the head size {head_dim} is odd (rotary pairs need it even)")
    value_dim = h.int("attention.value_length", 1, MAX_HEAD_DIM, default=head_dim)
    if value_dim != head_dim:
        h.fail(f"{arch}.attention.value_length", f"{value_dim} differs from the key length {head_dim} "
               "(not supported)")
    num_layers = h.int("block_count", 1, MAX_LAYERS)
    context = h.int("context_length", 1, MAX_CONTEXT, default=2048)
    h.float("rope.freq_base", 1e-3, MAX_ROPE_BASE)
    h.float("rope.freq_base_swa", 1e-3, MAX_ROPE_BASE)
    h.float("rope.scaling.factor", 1e-3, 1e3)
    h.float("rope.scaling.attn_factor", 1e-3, 1e3)
    h.int("rope.scaling.original_context_length", 0, context, default=0)
    h.int("rope.dimension_count", 0, head_dim, default=0)
    h.float("attention.layer_norm_rms_epsilon", 1e-12, 0.5)
    h.float("attention.layer_norm_epsilon", 0.0, 0.5, required=encoder)
    h.float("attn_logit_softcapping", 0.0, 1e6)
    h.float("final_logit_softcapping", 0.0, 1e6)
    h.int("attention.sliding_window", 0, MAX_CONTEXT, default=0)
    num_experts = h.int("expert_count", 0, MAX_EXPERTS, default=0)
    if num_experts:
        h.int("expert_used_count", 1, num_experts)
    ff_default = 0 if arch == "qwen3moe" else None
    ff = h.int("feed_forward_length", 0 if ff_default == 0 else 1, MAX_WIDTH, default=ff_default)
    expert_ff = h.int("expert_feed_forward_length", 1 if arch == "qwen3moe" else 0, MAX_WIDTH,
                      default=None if arch == "qwen3moe" else 0)
    pattern = metadata.value(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, ArrayValue) and pattern.length != num_layers:
        h.fail(f"{arch}.attention.sliding_window_pattern", f"lists {pattern.length} layers but block_count is "
               f"{num_layers}")
    # Mixtral's experts are feed_forward_length wide; qwen3moe's dense layers expert_feed_forward_length when
    # feed_forward_length is 0 (as gguf_arch reads them)
    dims = _Dims(hidden, num_heads, num_kv_heads, head_dim, ff or expert_ff, expert_ff or ff, num_experts,
                 vocab=embedding.shape[-1], phi3=arch == "phi3", context=context)
    _check_tensors(metadata, arch, num_layers, dims)
    _check_tokenizer(metadata, h, dims.vocab)


class _Dims:
    """The widths the hyper-parameters imply, and each tensor kind's expected GGUF shape."""

    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, ff, expert_ff, num_experts, vocab, phi3, context):
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.vocab = vocab
        self.shapes = {
            T.TOKEN_EMBD: (hidden, vocab), T.OUTPUT: (hidden, vocab), T.OUTPUT_NORM: (hidden,),
            T.ATTN_Q: (hidden, q), T.ATTN_K: (hidden, kv), T.ATTN_V: (hidden, kv), T.ATTN_QKV: (hidden, q + 2 * kv),
            T.ATTN_OUT: (q, hidden), T.ATTN_Q_NORM: (head_dim,), T.ATTN_K_NORM: (head_dim,),
            T.FFN_GATE: (hidden, ff), T.FFN_UP: (hidden, 2 * ff if phi3 else ff), T.FFN_DOWN: (ff, hidden),
            T.FFN_GATE_INP: (hidden, num_experts),
            T.FFN_GATE_EXP: (hidden, expert_ff, num_experts), T.FFN_UP_EXP: (hidden, expert_ff, num_experts),
            T.FFN_DOWN_EXP: (expert_ff, hidden, num_experts),
            T.ROPE_FREQS: (head_dim // 2,), T.ROPE_FACTORS_LONG: (head_dim // 2,),
            T.ROPE_FACTORS_SHORT: (head_dim // 2,),
            T.POS_EMBD: (hidden, context),
            **{norm: (hidden,) for norm in _NORMS},
        }
        self.bias_shapes = {T.ATTN_Q: (q,), T.ATTN_K: (kv,), T.ATTN_V: (kv,), T.ATTN_QKV: (q + 2 * kv,),
                            T.ATTN_OUT: (hidden,), T.FFN_UP: (ff,), T.FFN_DOWN: (hidden,),
                            **{norm: (hidden,) for norm in _NORMS}}


def _check_tensors(metadata: GGUFMetadata, arch: str, num_layers: int, dims: _Dims) -> None:
    layers: dict[int, set] = {}
    for tensor in metadata.tensors:
        where = f"tensor {tensor.name!r}"
        try:
            kind, layer, suffix = gguf_arch.classify(arch, tensor.name)
        except ModelLoadError:
            raise InvalidModelFileError(metadata.path, where, f"is not a tensor of a {arch} model") from None
        if layer is not None:
            if layer >= num_layers:
                raise InvalidModelFileError(metadata.path, where, f"belongs to layer {layer} but {arch}.block_count "
                                            f"is {num_layers}")
            layers.setdefault(layer, set()).add(kind)
        expected = (dims.bias_shapes if suffix == "bias" else dims.shapes).get(kind)
        if expected is not None and tensor.shape != expected:
            raise InvalidModelFileError(metadata.path, where, f"has shape {list(tensor.shape)} but the "
                                        f"hyper-parameters imply {list(expected)}")
    encoder = arch in gguf_arch.ENCODER_ARCHITECTURES
    names = {t.name for t in metadata.tensors}
    for name in _REQUIRED_IN_ENCODER if encoder else ("output_norm.weight",):
        if name not in names:
            raise InvalidModelFileError(metadata.path, f"tensor {name!r}", "is missing")
    for layer in range(num_layers):
        kinds = layers.get(layer, set())
        if encoder:  # BERT's layers have one form: every weight and bias
            missing = [f"{base}.{suffix}" for base in _REQUIRED_IN_ENCODER_LAYER for suffix in ("weight", "bias")
                       if f"blk.{layer}.{base}.{suffix}" not in names]
        else:
            missing = [name for name, alternatives in _REQUIRED_IN_LAYER if not kinds & alternatives]
        if missing:
            raise InvalidModelFileError(
                metadata.path, f"layer {layer}",
                f"lacks {', '.join(missing)} ({arch}.block_count is {num_layers}; the file has tensors for "
                f"{len(layers)} layers)")


_REQUIRED_IN_LAYER = (
    ("attn_norm", {T.ATTN_NORM}),
    ("attn_q or attn_qkv", {T.ATTN_Q, T.ATTN_QKV}),
    ("attn_output", {T.ATTN_OUT}),
    ("ffn_down or ffn_down_exps", {T.FFN_DOWN, T.FFN_DOWN_EXP}),
)

_REQUIRED_IN_ENCODER = ("position_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias")
_REQUIRED_IN_ENCODER_LAYER = tuple(TENSOR_NAMES[kind].removeprefix("blk.{bid}.") for kind in (
    T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.ATTN_OUT_NORM, T.FFN_UP, T.FFN_DOWN, T.LAYER_OUT_NORM))


def _check_tokenizer(metadata: GGUFMetadata, h: _Hparams, vocab: int) -> None:
    if f"{h.arch}.vocab_size" in metadata.fields:
        declared = h.int("vocab_size", 1, 1 << 31)
        if declared != vocab:
            h.fail(f"{h.arch}.vocab_size", f"is {declared} but token_embd.weight has {vocab} rows")
    tokens = metadata.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not isinstance(tokens[1], ArrayValue) or tokens[1].item_type != GGUFValueType.STRING:
            h.fail("tokenizer.ggml.tokens", f"must be an array of strings, got {_describe(*tokens)}")
        if tokens[1].length != vocab:
            h.fail("tokenizer.ggml.tokens", f"lists {tokens[1].length} tokens but token_embd.weight has {vocab} rows")
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            found = metadata.fields.get(key)
            if found is not None and (not isinstance(found[1], ArrayValue) or found[1].length != vocab):
                h.fail(key, f"must be an array of {vocab} items (one per token), got {_describe(*found)}")
    for name in SPECIAL_TOKEN_KEYS:
        h.int(f"tokenizer.ggml.{name}_token_id", 0, vocab - 1, full_key=True)
