"""Hugging Face checkpoints checked before anything trusts them, as ``gguf_validate`` checks GGUF files:
``config.json``'s hyper-parameters (the bounds of ``gguf_model_checks``) and each safetensors file's header
(its length, every dtype, shape and byte range), read without touching tensor data. A failure is one
``InvalidModelFileError`` naming the file, the key or tensor, and what is wrong.

safetensors' own reader refuses a malformed header too, in words about buffers and offsets; this names
the tensor, and runs before a model as large as the config claims is built.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from pagedllm.errors import InvalidModelFileError
from pagedllm.model.gguf_model_checks import MAX_CONTEXT, MAX_HEAD_DIM, MAX_LAYERS, MAX_ROPE_BASE, MAX_WIDTH

MAX_VOCAB = 1 << 22
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header
MAX_TOKENIZER_FILE_BYTES = 512 << 20  # the largest real tokenizer.json files are tens of MB
MAX_TEMPLATE_FILE_BYTES = 4 << 20  # real chat templates are tens of KB
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class _ConfigReader:
    def __init__(self, config, path: Path) -> None:
        self.config, self.path = config, path

    def fail(self, key: str, what: str) -> None:
        raise InvalidModelFileError(self.path, f"key {key!r}", what)

    def int(self, key: str, low: int, high: int, required: bool = True) -> int | None:
        value = getattr(self.config, key, None)
        if value is None:
            if required:
                self.fail(key, "is missing")
            return None
        if type(value) is not int:
            self.fail(key, f"must be an integer, got {value!r}")
        if not low <= value <= high:
            self.fail(key, f"is {value}, outside [{low}, {high}]")
        return value

    def float(self, key: str, value, low: float, high: float) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            self.fail(key, f"is {value}, not a finite number")
        if not low <= value <= high:
            self.fail(key, f"is {value:g}, outside [{low:g}, {high:g}]")


def check_config(config, path: str | os.PathLike) -> None:
    """The hyper-parameters of a loaded ``config`` (transformers' or a ``ResolvedConfig``) from ``path``."""
    c = _ConfigReader(config, Path(path))
    hidden = c.int("hidden_size", 1, MAX_WIDTH)
    num_heads = c.int("num_attention_heads", 1, hidden)
    num_kv_heads = c.int("num_key_value_heads", 1, num_heads, required=False) or num_heads
    if num_heads % num_kv_heads:
        c.fail("num_key_value_heads", f"{num_kv_heads} does not divide num_attention_heads ({num_heads})")
    head_dim = c.int("head_dim", 2, MAX_HEAD_DIM, required=False)
    if head_dim is None and hidden % num_heads:
        c.fail("num_attention_heads", f"{num_heads} does not divide hidden_size ({hidden})")
    if head_dim is not None and head_dim % 2:
        c.fail("head_dim", f"{head_dim} is odd (rotary pairs need it even)")
    c.int("num_hidden_layers", 1, MAX_LAYERS)
    c.int("intermediate_size", 0, MAX_WIDTH, required=False)
    vocab = c.int("vocab_size", 1, MAX_VOCAB)
    c.int("max_position_embeddings", 1, MAX_CONTEXT, required=False)
    c.float("rms_norm_eps", getattr(config, "rms_norm_eps", None), 1e-12, 0.5)
    rope = getattr(config, "rope_parameters", None) or {}
    for params in (rope, *(v for v in rope.values() if isinstance(v, dict))) if isinstance(rope, dict) else ():
        c.float("rope_parameters.rope_theta", params.get("rope_theta"), 1e-3, MAX_ROPE_BASE)
        c.float("rope_parameters.factor", params.get("factor"), 1e-3, 1e3)
    c.float("rope_theta", getattr(config, "rope_theta", None), 1e-3, MAX_ROPE_BASE)
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        for token in value if isinstance(value, list) else [value]:
            if token is not None and (type(token) is not int or not 0 <= token < vocab):
                c.fail(key, f"{token!r} is not a token id of the vocabulary (0 to {vocab - 1})")


def check_safetensors(path: str | os.PathLike) -> dict[str, dict]:
    """The header of the safetensors file ``path`` (tensor name -> dtype, shape, data_offsets), checked: its
    length within the file, every dtype known, every byte range inside the data and as long as its shape
    says, none overlapping."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InvalidModelFileError(path, "header", f"the file has {size} bytes, too few for a header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise InvalidModelFileError(path, "header", f"claims {header_len} bytes of header, more than the "
                                            f"{min(MAX_HEADER_BYTES, size - 8)} allowed here")
            raw = f.read(header_len)
    except OSError as e:
        raise InvalidModelFileError(path, "file", f"cannot be read: {e.strerror or e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: bad JSON, or an integer past Python's digit limit
        raise InvalidModelFileError(path, "header", f"is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise InvalidModelFileError(path, "header", "is not a JSON object")
    data_size = size - 8 - header_len
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ranges.append(_check_entry(path, name, info, data_size))
    ranges.sort()
    for (begin, end, name), (next_begin, _, next_name) in zip(ranges, ranges[1:]):
        if end > next_begin:
            raise InvalidModelFileError(path, f"tensor {name!r}", f"bytes [{begin}, {end}) overlap tensor "
                                        f"{next_name!r} at {next_begin}")
    return header


def _check_entry(path: Path, name: str, info, data_size: int) -> tuple[int, int, str]:
    where = f"tensor {name!r}"
    if not isinstance(info, dict):
        raise InvalidModelFileError(path, where, "is not described by a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise InvalidModelFileError(path, where, f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidModelFileError(path, where, f"has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise InvalidModelFileError(path, where, f"has data_offsets {offsets!r}, not a range inside the "
                                    f"{data_size} bytes of data (file truncated, or the header corrupted)")
    num_bytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != num_bytes:
        raise InvalidModelFileError(path, where, f"{dtype} of shape {shape} takes {num_bytes} bytes but its "
                                    f"data_offsets span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1], name


def check_tokenizer_files(hf_dir: str | os.PathLike, names: tuple[str, ...]) -> None:
    """Tokenizer files (``names`` in ``hf_dir``) and the chat template file within sane sizes, before a
    tokenizer library reads them whole into memory."""
    hf_dir = Path(hf_dir)
    limits = {name: MAX_TOKENIZER_FILE_BYTES for name in names} | {"chat_template.jinja": MAX_TEMPLATE_FILE_BYTES}
    for name, limit in limits.items():
        try:
            size = (hf_dir / name).stat().st_size
        except OSError:
            continue
        if size > limit:
            raise InvalidModelFileError(hf_dir / name, "file", f"is {size} bytes, more than the {limit} a "
                                        "tokenizer file may be")
