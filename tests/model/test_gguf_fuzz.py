"""Fuzzing the GGUF reader: hypothesis corrupts a tiny valid Llama GGUF at the byte level (set, flip, insert,
delete, truncate; mostly in the metadata) and at the field level (header counts, key lengths and types, array
lengths and item types, hyper-parameter values, tensor name lengths, dimensions, types and offsets).

Property: every mutation ends in ``InvalidModelFileError`` or a valid file, within a second and without
reading tensor data (``validate_gguf``); and a mutated file the validator passes loads, or fails with a
``ModelLoadError``, within a time limit and an address-space limit (a timer and ``RLIMIT_AS`` around the load
in this process: the validator bounds every size by the file's, so no load needs more). Derandomized and
bounded so CI is deterministic and quick; raise ``max_examples`` locally to search harder.
"""

from __future__ import annotations

import contextlib
import math
import resource
import signal
import struct
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from pagedllm.errors import InvalidModelFileError, ModelLoadError
from pagedllm.model import load_model
from pagedllm.model.gguf_model_checks import validate_gguf
from tests.model.gguf_corruption import Layout, Place, write_tiny_llama

BERT_FILE = Path(__file__).parent / "data" / "bert-tiny-mean-f16.gguf"
"""A BERT encoder with a WordPiece vocabulary, written by llama.cpp's converter (tests/model/test_gguf_bert.py)."""
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
VALIDATE_LIMIT_S = 1.0
LOAD_LIMIT_S = 60.0
LOAD_EXTRA_ADDRESS_SPACE = 4 << 30


class _Source:
    def __init__(self, path) -> None:
        self.path, self.layout, self.data = path, Layout(path), path.read_bytes()
        self.places = _places(self.layout)


def _places(layout: Layout) -> list[tuple[str, Place]]:
    """(label, place) of every count, length, type, value, dimension and offset in the file's metadata."""
    places = []
    for key, parts in layout.fields.items():
        if key.startswith("GGUF."):
            places.append((key, layout.value(key)))
            continue
        places += [(f"{key} key length", layout.key_length(key)), (f"{key} type", layout.key_type(key)),
                   (f"{key} value", layout.value(key))]
        if len(parts) > 4:
            places.append((f"{key} item type", Place(parts[3][0], "<I")))
    for name, parts in layout.tensors.items():
        info = layout.tensor_info[name]
        places += [(f"{name} name length", Place(parts[0][0], "<Q")), (f"{name} dims", Place(parts[2][0], "<I")),
                   (f"{name} type", layout.tensor_type(name)), (f"{name} offset", layout.tensor_offset(name))]
        places += [(f"{name} dim {i}", layout.tensor_dim(name, i)) for i in range(len(info.shape))]
    return places


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-sources")
    return {"vocab": _Source(write_tiny_llama(folder / "vocab.gguf")),
            "plain": _Source(write_tiny_llama(folder / "plain.gguf", with_vocab=False)),
            "bert": _Source(BERT_FILE)}  # an encoder with a WordPiece vocabulary, from llama.cpp's converter


_INT_LIMITS = {"B": 0xFF, "b": 0x7F, "H": 0xFFFF, "h": 0x7FFF, "I": 0xFFFFFFFF, "i": 0x7FFFFFFF,
               "Q": 2**64 - 1, "q": 2**63 - 1}


@st.composite
def field_edit(draw, source: _Source):
    label, place = draw(st.sampled_from(source.places))
    code = place.fmt[1]
    original = struct.unpack_from(place.fmt, source.data, place.offset)[0]
    if code in "fd":
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30, 1e-30, original * 2,
                                      original / 2]) | st.floats(allow_nan=False, width=32 if code == "f" else 64))
    elif code == "?":
        value = draw(st.booleans())
    else:
        top = _INT_LIMITS[code]
        low = -top - 1 if code.islower() else 0
        candidates = [v for v in (0, 1, 2, 3, 7, 31, 33, original - 1, original + 1, original * 2, original // 2,
                                  top, top - 1, 2**31 - 1, 2**32, 2**40, 2**63) if low <= v <= top]
        value = draw(st.sampled_from(candidates) | st.integers(low, top))
    return f"{label} = {value!r}", lambda data: struct.pack_into(place.fmt, data, place.offset, value)


@st.composite
def byte_edit(draw, source: _Source):
    size = len(source.data)
    metadata_end = source.layout.data_start + 64
    position = draw(st.integers(0, metadata_end - 1) | st.integers(0, size - 1))
    op = draw(st.sampled_from(["set", "flip", "insert", "delete", "truncate"]))
    if op == "set":
        byte = draw(st.integers(0, 255))
        return f"byte {position} = {byte}", lambda data: data.__setitem__(position, byte)
    if op == "flip":
        bit = draw(st.integers(0, 7))
        return f"flip bit {bit} of byte {position}", lambda data: data.__setitem__(position, data[position] ^ 1 << bit)
    if op == "insert":
        extra = draw(st.binary(min_size=1, max_size=9))
        return f"insert {extra!r} at {position}", lambda data: data.__setitem__(slice(position, position), extra)
    if op == "delete":
        length = draw(st.integers(1, 16))
        return f"delete {length} bytes at {position}", lambda data: data.__delitem__(slice(position, position + length))
    return f"truncate at {position}", lambda data: data.__delitem__(slice(position, None))


def mutations(source: _Source):
    return st.lists(field_edit(source) | byte_edit(source), min_size=1, max_size=3)


@st.composite
def soft_edit(draw, source: _Source):
    """An edit a file may survive: a byte of tensor data, a float hyper-parameter moved within reason."""
    floats = [(label, place) for label, place in source.places if place.fmt in ("<f", "<d")]
    if draw(st.booleans()) or not floats:
        position = draw(st.integers(source.layout.data_start, len(source.data) - 1))
        byte = draw(st.integers(0, 255))
        return f"data byte {position} = {byte}", lambda data: data.__setitem__(position, byte)
    label, place = draw(st.sampled_from(floats))
    original = struct.unpack_from(place.fmt, source.data, place.offset)[0]
    value = original * draw(st.sampled_from([0.5, 2.0, 10.0, 1e3]))
    return f"{label} = {value!r}", lambda data: struct.pack_into(place.fmt, data, place.offset, value)


def loader_mutations(source: _Source):
    """Mostly edits a file may survive (the loader runs only on files the validator passes), some of any kind."""
    return st.lists(soft_edit(source), min_size=1, max_size=3) | mutations(source)


def _apply(source: _Source, edits, path) -> list[str]:
    data = bytearray(source.data)
    for _, edit in edits:
        if len(data) == len(source.data):  # once the bytes moved, later places are elsewhere: apply what fits
            edit(data)
        else:
            with contextlib.suppress(IndexError, struct.error):
                edit(data)
    path.write_bytes(bytes(data))
    return [label for label, _ in edits]


def _validate(path) -> str:
    start = time.monotonic()
    try:
        validate_gguf(path)
        outcome = "valid"
    except InvalidModelFileError as e:
        assert "\n" not in str(e) and str(e).startswith("invalid model file "), str(e)
        outcome = e.where.split(" ")[0]
    elapsed = time.monotonic() - start
    assert elapsed < VALIDATE_LIMIT_S, f"validation took {elapsed:.2f} s"
    return outcome


class _OverTime(Exception):
    pass


@contextlib.contextmanager
def _bounded(seconds: float, extra_bytes: int):
    """A timer that raises _OverTime in this thread, and an address-space limit a little over today's use."""
    def over(*_):
        raise _OverTime(f"took more than {seconds} s")

    with open("/proc/self/statm") as f:
        in_use = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = in_use + extra_bytes if hard == resource.RLIM_INFINITY else min(hard, in_use + extra_bytes)
    previous = signal.signal(signal.SIGALRM, over)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


OUTCOMES: Counter = Counter()


@settings(FUZZ, max_examples=400)
@given(data=st.data(), which=st.sampled_from(["vocab", "vocab", "vocab", "bert"]))
def test_fuzz_the_validator(sources, tmp_path, data, which):
    source = sources[which]
    labels = _apply(source, data.draw(mutations(source)), tmp_path / "mutant.gguf")
    note(labels)
    OUTCOMES["validator " + _validate(tmp_path / "mutant.gguf")] += 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf dequantizing a scale fuzzed to NaN
@settings(FUZZ, max_examples=40)
@given(data=st.data(), which=st.sampled_from(["plain", "plain", "vocab", "bert"]))
def test_fuzz_the_loader(sources, tmp_path, monkeypatch, data, which):
    source = sources[which]
    path = tmp_path / f"mutant-{which}.gguf"
    labels = _apply(source, data.draw(loader_mutations(source)), path)
    note(labels)
    outcome = _validate(path)
    if outcome != "valid":
        OUTCOMES["loader refused by the validator"] += 1
        return
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    try:
        with _bounded(LOAD_LIMIT_S, LOAD_EXTRA_ADDRESS_SPACE):
            load_model(str(path))
        OUTCOMES["loader loaded"] += 1
    except ModelLoadError as e:
        assert "\n" not in str(e).strip(), str(e)
        OUTCOMES["loader ModelLoadError"] += 1


def test_the_fuzzing_reached_both_outcomes():
    """The runs above exercised refusals and loads alike (their counts, printed with -s, go in the report)."""
    print(dict(OUTCOMES))
    if not OUTCOMES:
        pytest.skip("run with the fuzz tests")
    assert OUTCOMES["validator valid"] > 0 and sum(v for k, v in OUTCOMES.items() if k.startswith("validator ")
                                                   and k != "validator valid") > 100
    assert OUTCOMES["loader loaded"] > 0
