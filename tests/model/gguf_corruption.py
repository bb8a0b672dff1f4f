"""Tiny valid GGUF files and the byte positions of their fields, to corrupt one place at a time.

``GGUFReader`` lists each field and tensor description as a sequence of parts (length, bytes, type,
value...); a part's position in the file is its field's offset plus the parts before it, so a test can
overwrite exactly one count, length, type, dimension, offset or hyper-parameter.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader

from tests.model.gguf_writer_helpers import spm_vocab, write_converted_gguf
from tests.model.tiny_models import make_hf_model


def write_tiny_llama(path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
                     with_vocab: bool = True, seed: int = 0) -> Path:
    """A tiny Llama (hidden 64, 3 layers, vocabulary 512) as llama.cpp's converter writes it, a few dozen KB."""
    hf = make_hf_model("llama", seed=seed)
    vocab = spm_vocab(hf.config.vocab_size, ["▁a", "▁b"]) if with_vocab else None
    write_converted_gguf(hf, path, qtype, vocab=vocab)
    return path


@dataclass(frozen=True)
class Place:
    """Where one value lies in the file, and its struct format."""

    offset: int
    fmt: str


class Layout:
    """Byte positions of a GGUF file's header counts, field values and tensor descriptions."""

    def __init__(self, path: Path) -> None:
        reader = GGUFReader(path)
        self.path = path
        self.fields = {key: _parts(field) for key, field in reader.fields.items()}
        self.tensors = {t.name: _parts(t.field) for t in reader.tensors}
        self.data_start = reader.data_offset
        self.tensor_info = {t.name: t for t in reader.tensors}

    def value(self, key: str) -> Place:
        """A scalar field's value (part 3), or an array's length (part 4)."""
        parts = self.fields[key]
        if len(parts) == 1:  # a header count (GGUF.version, GGUF.tensor_count, GGUF.kv_count)
            offset, part = parts[0]
            return Place(offset, _fmt(part.dtype))
        if len(parts) > 4:  # an array: key length, key, type, item type, length, items...
            return Place(parts[4][0], "<Q")
        offset, part = parts[3]
        return Place(offset, _fmt(part.dtype))

    def key_length(self, key: str) -> Place:
        return Place(self.fields[key][0][0], "<Q")

    def key_type(self, key: str) -> Place:
        return Place(self.fields[key][2][0], "<I")

    def tensor_dim(self, name: str, index: int) -> Place:
        offset, _ = self.tensors[name][3]
        return Place(offset + 8 * index, "<Q")

    def tensor_type(self, name: str) -> Place:
        return Place(self.tensors[name][4][0], "<I")

    def tensor_offset(self, name: str) -> Place:
        return Place(self.tensors[name][5][0], "<Q")

    def read(self, place: Place):
        return struct.unpack_from(place.fmt, self.path.read_bytes(), place.offset)[0]


_STRUCT = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "u8": "Q", "i8": "q", "f4": "f",
           "f8": "d", "b1": "?"}


def _fmt(dtype) -> str:
    return "<" + _STRUCT[dtype.str[1:]]


def _parts(field) -> list[tuple[int, object]]:
    offsets, offset = [], field.offset
    for part in field.parts:
        offsets.append((offset, part))
        offset += part.nbytes
    return offsets


def patched(source: Path, target: Path, *edits: tuple[Place, object]) -> Path:
    """``source`` copied to ``target`` with each (place, value) written over it."""
    data = bytearray(source.read_bytes())
    for place, value in edits:
        struct.pack_into(place.fmt, data, place.offset, value)
    target.write_bytes(bytes(data))
    return target
