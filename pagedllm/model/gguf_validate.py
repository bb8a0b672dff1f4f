"""One pass over a GGUF file's metadata before anything trusts it: a file from a stranger is input.

``validate_gguf(path)`` parses the header, every key-value pair and every tensor description with
bounds taken from the file itself, then checks the model the metadata describes
(``gguf_model_checks.py``). It reads no tensor data, so a load costs the same; a failure raises one
``InvalidModelFileError`` whose one-line message names the file, the key or tensor, and what is wrong.
Structure (the GGUF spec, v2 and v3, little-endian)::

    magic "GGUF" | version u32 | tensor count u64 | key-value count u64
    key-values:   key (u64 length + bytes) | value type u32 | value (arrays: item type u32, length u64, items)
    tensor infos: name | dimension count u32 | dimensions u64 x n | type u32 | offset u64 (from the data start)
    padding to general.alignment | data section: each tensor at its offset, aligned, none overlapping

Every count and length is checked against the bytes that remain before it is used, so a length of
2^40 is an error at once instead of a loop or an allocation.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from pagedllm.errors import InvalidModelFileError

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
INTEGER_TYPES = frozenset(t for t in _SCALAR_FORMATS if t not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64,
                                                                   GGUFValueType.BOOL))
FLOAT_TYPES = frozenset((GGUFValueType.FLOAT32, GGUFValueType.FLOAT64))

MAX_NAME_BYTES = 64  # llama.cpp's GGML_MAX_NAME: a longer tensor name is rejected there too
MAX_KEY_BYTES = 65535  # the spec's bound on a key
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays exist (e.g. per-layer lists); deeper nesting does not
_KEPT_ARRAY_ITEMS = 4096  # small numeric arrays are kept (per-layer patterns); bigger ones are only counted
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class ArrayValue:
    """A metadata array: its item type, its length, and its items when small and not strings."""

    item_type: GGUFValueType
    length: int
    items: tuple | None


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's description: ``shape`` as GGUF lists it (the fastest dimension first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # from the data section's start
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFMetadata:
    """What a validated file holds, as read without touching tensor data."""

    path: Path
    version: int
    fields: dict[str, tuple[GGUFValueType, object]]  # key -> (type, scalar | str | ArrayValue)
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_start: int
    file_size: int

    def value(self, key: str, default=None):
        found = self.fields.get(key)
        return default if found is None else found[1]


def _show(raw: bytes | str) -> str:
    """A name from the file, safe to print on one line."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return repr(text if len(text) <= 80 else text[:80] + "...")


class _Cursor:
    """Reads little-endian values from the file's bytes; every read is bounds-checked first."""

    def __init__(self, buffer, path: Path) -> None:
        self.buffer, self.size, self.path, self.offset = buffer, len(buffer), path, 0
        self.where = "header"

    def fail(self, what: str, where: str | None = None) -> None:
        raise InvalidModelFileError(self.path, where or self.where, what)

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.size - self.offset:
            self.fail(f"{what} needs {num_bytes} bytes but only {self.size - self.offset} remain (file truncated "
                      "or a length corrupted)")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.scalar("<Q", f"{what}'s length")
        if limit is not None and length > limit:
            self.fail(f"{what} is {length} bytes long (at most {limit})")
        self.need(length, f"{what} of {length} bytes")
        raw = bytes(self.buffer[self.offset:self.offset + length])
        self.offset += length
        return raw

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` strings, checking each length against what remains (a tokenizer's 100 K tokens)."""
        buffer, size, offset, unpack = self.buffer, self.size, self.offset, struct.unpack_from
        for index in range(count):
            if size - offset < 8:
                self.offset = offset
                self.fail(f"{what} item {index} of {count} lies beyond the end of the file")
            (length,) = unpack("<Q", buffer, offset)
            offset += 8
            if length > size - offset:
                self.offset = offset
                self.fail(f"{what} item {index} claims {length} bytes but only {size - offset} remain")
            offset += length
        self.offset = offset


def _value_type(cursor: _Cursor, what: str) -> GGUFValueType:
    raw = cursor.scalar("<I", what)
    try:
        return GGUFValueType(raw)
    except ValueError:
        cursor.fail(f"unknown value type {raw} (known: 0-12)")


def _read_value(cursor: _Cursor, value_type: GGUFValueType, depth: int = 0):
    if value_type == GGUFValueType.STRING:
        return cursor.string("string value").decode("utf-8", "replace")
    if value_type != GGUFValueType.ARRAY:
        return cursor.scalar(_SCALAR_FORMATS[value_type], f"{value_type.name} value")
    if depth >= MAX_ARRAY_DEPTH:
        cursor.fail(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
    item_type = _value_type(cursor, "array item type")
    length = cursor.scalar("<Q", "array length")
    item_bytes = 8 if item_type == GGUFValueType.STRING else (
        12 if item_type == GGUFValueType.ARRAY else struct.calcsize(_SCALAR_FORMATS[item_type]))
    if length * item_bytes > cursor.size - cursor.offset:  # the least its items can take
        cursor.fail(f"array of {length} {item_type.name} items cannot fit in the {cursor.size - cursor.offset} "
                    "bytes that remain")
    if item_type == GGUFValueType.STRING:
        cursor.skip_strings(length, "string array")
        return ArrayValue(item_type, length, None)
    if item_type == GGUFValueType.ARRAY:
        for _ in range(length):
            _read_value(cursor, item_type, depth + 1)
        return ArrayValue(item_type, length, None)
    fmt = _SCALAR_FORMATS[item_type]
    items = None
    if length <= _KEPT_ARRAY_ITEMS:
        items = struct.unpack_from(f"<{length}{fmt[1]}", cursor.buffer, cursor.offset)
    cursor.offset += length * item_bytes
    return ArrayValue(item_type, length, items)


def _read_fields(cursor: _Cursor, count: int) -> dict:
    fields: dict[str, tuple[GGUFValueType, object]] = {}
    for index in range(count):
        cursor.where = f"key-value pair {index}"
        raw_key = cursor.string("key", MAX_KEY_BYTES)
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            cursor.fail(f"key {_show(raw_key)} is not UTF-8")
        cursor.where = f"key {key!r}"
        if key in fields:
            cursor.fail("appears twice")
        value_type = _value_type(cursor, "value type")
        fields[key] = (value_type, _read_value(cursor, value_type))
    return fields


def _read_tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    cursor.where = f"tensor {index}"
    raw_name = cursor.string("tensor name", MAX_NAME_BYTES)
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        cursor.fail(f"name {_show(raw_name)} is not UTF-8")
    cursor.where = f"tensor {name!r}"
    num_dims = cursor.scalar("<I", "dimension count")
    if not 1 <= num_dims <= MAX_DIMS:
        cursor.fail(f"has {num_dims} dimensions (1 to {MAX_DIMS} allowed)")
    shape = tuple(cursor.scalar("<Q", "dimension") for _ in range(num_dims))
    raw_type = cursor.scalar("<I", "tensor type")
    offset = cursor.scalar("<Q", "tensor offset")
    return name, shape, raw_type, offset


def _tensor(cursor: _Cursor, name: str, shape: tuple[int, ...], raw_type: int, offset: int,
            alignment: int, data_size: int) -> TensorInfo:
    where = f"tensor {name!r}"
    if any(d == 0 for d in shape):
        cursor.fail(f"has a zero dimension (shape {list(shape)})", where)
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        cursor.fail(f"has unknown type {raw_type}", where)
    if shape[0] % block_size:
        cursor.fail(f"rows of {shape[0]} values are not whole {qtype.name} blocks of {block_size}", where)
    num_elements = 1
    for d in shape:
        num_elements *= d
    num_bytes = num_elements // block_size * type_size  # exact Python integers: no overflow to wrap around
    if offset % alignment:
        cursor.fail(f"offset {offset} is not a multiple of general.alignment ({alignment})", where)
    if num_bytes > data_size or offset > data_size - num_bytes:
        cursor.fail(f"{qtype.name} data of shape {list(shape)} ({num_bytes} bytes at offset {offset}) runs past the "
                    f"end of the data section ({data_size} bytes; file truncated, or the offset or shape corrupted)",
                    where)
    return TensorInfo(name, shape, qtype, offset, num_bytes)


def _alignment(cursor: _Cursor, fields: dict) -> int:
    found = fields.get("general.alignment")
    if found is None:
        return DEFAULT_ALIGNMENT
    value_type, value = found
    if value_type != GGUFValueType.UINT32 or value == 0 or value & (value - 1):
        cursor.fail(f"must be a power of two stored as UINT32, got {value!r} ({value_type.name})",
                    "key 'general.alignment'")
    return value


def _check_no_overlap(cursor: _Cursor, tensors: list[TensorInfo]) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in zip(ordered, ordered[1:]):
        if before.offset + before.num_bytes > after.offset:
            cursor.fail(f"{before.qtype.name} data ({before.num_bytes} bytes at offset {before.offset}) overlaps "
                        f"tensor {after.name!r} at offset {after.offset}", f"tensor {before.name!r}")


def read_metadata(path: str | os.PathLike) -> GGUFMetadata:
    """The file's metadata, structurally checked (no model-level checks); InvalidModelFileError if malformed."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise InvalidModelFileError(path, "header", "the file is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return _parse(_Cursor(memoryview(mapped), path), size)
    except OSError as e:
        raise InvalidModelFileError(path, "file", f"cannot be read: {e.strerror or e}") from e


def _parse(cursor: _Cursor, size: int) -> GGUFMetadata:
    try:
        cursor.need(4, "the magic number")
        magic = bytes(cursor.buffer[:4])
        if magic != b"GGUF":
            cursor.fail(f"starts with {magic!r}, not the GGUF magic b'GGUF'")
        cursor.offset = 4
        version = cursor.scalar("<I", "version")
        if version not in (2, 3):
            detail = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            cursor.fail(f"version {version} is not supported (2 or 3){detail}")
        num_tensors = cursor.scalar("<Q", "tensor count")
        num_fields = cursor.scalar("<Q", "key-value count")
        remaining = size - cursor.offset
        if num_tensors * 33 + num_fields * 13 > remaining:  # the least one tensor info / key-value pair takes
            cursor.fail(f"claims {num_tensors} tensors and {num_fields} key-value pairs, more than the "
                        f"{remaining} bytes after the header can hold")
        fields = _read_fields(cursor, num_fields)
        alignment = _alignment(cursor, fields)
        raw_tensors = [_read_tensor_info(cursor, i) for i in range(num_tensors)]
        data_start = -(-cursor.offset // alignment) * alignment
        data_size = max(0, size - data_start)
        tensors, names = [], set()
        for name, shape, raw_type, offset in raw_tensors:
            if name in names:
                cursor.fail("appears twice", f"tensor {name!r}")
            names.add(name)
            tensors.append(_tensor(cursor, name, shape, raw_type, offset, alignment, data_size))
        _check_no_overlap(cursor, tensors)
    finally:
        cursor.buffer.release()
    return GGUFMetadata(cursor.path, version, fields, tuple(tensors), alignment, data_start, size)


__all__ = ["ArrayValue", "GGUFMetadata", "TensorInfo", "read_metadata"]
