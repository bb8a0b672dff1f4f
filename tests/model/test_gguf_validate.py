"""Every class of GGUF corruption ends in one InvalidModelFileError naming the file, the key or tensor, and
what is wrong: each case corrupts one place of a tiny valid Llama GGUF written here and loads it."""

import math
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType

from pagedllm.errors import InvalidModelFileError
from pagedllm.model import load_model
from pagedllm.model.gguf_model_checks import validate_gguf
from pagedllm.model.gguf_validate import read_metadata
from tests.model.gguf_corruption import Layout, patched, write_tiny_llama


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, Layout(path)


def _edits(layout: Layout, case: str):
    """The (place, value) edits of each corruption class, on the tiny Llama (hidden 64, 4 heads, 2 kv heads,
    3 layers, feed-forward 128, vocabulary 512, Q8_0 matrices)."""
    q = "blk.0.attn_q.weight"
    return {
        "misaligned offset": [(layout.tensor_offset(q), layout.read(layout.tensor_offset(q)) + 3)],
        "type widened, data overlaps the next tensor": [(layout.tensor_type(q), int(GGMLQuantizationType.F16))],
        "unknown tensor type": [(layout.tensor_type(q), 99)],
        "offset past the end": [(layout.tensor_offset(q), 1 << 40)],
        "zero dimension": [(layout.tensor_dim(q, 1), 0)],
        "swapped dimensions": [(layout.tensor_dim("blk.0.ffn_gate.weight", 0), 128),
                               (layout.tensor_dim("blk.0.ffn_gate.weight", 1), 64)],
        "rope base NaN": [(layout.value("llama.rope.freq_base"), math.nan)],
        "rms epsilon negative": [(layout.value("llama.attention.layer_norm_rms_epsilon"), -1.0)],
        "array length 2^40": [(layout.value("tokenizer.ggml.tokens"), 1 << 40)],
        "key length 2^40": [(layout.key_length("llama.block_count"), 1 << 40)],
        "unknown value type": [(layout.key_type("llama.context_length"), 77)],
        "hyper-parameter of the wrong type": [(layout.key_type("llama.block_count"), 6)],  # FLOAT32
        "tensor count 2^40": [(layout.value("GGUF.tensor_count"), 1 << 40)],
        "block_count 1000": [(layout.value("llama.block_count"), 1000)],
        "block_count 2": [(layout.value("llama.block_count"), 2)],
        "context_length 2^31-1": [(layout.value("llama.context_length"), 2**31 - 1)],
        "head_count 0": [(layout.value("llama.attention.head_count"), 0)],
        "head_count 7": [(layout.value("llama.attention.head_count"), 7)],
        "head_count_kv 3": [(layout.value("llama.attention.head_count_kv"), 3)],
        "embedding_length 128": [(layout.value("llama.embedding_length"), 128)],
        "vocab_size disagrees": [(layout.value("llama.vocab_size"), 511)],
        "special token outside the vocabulary": [(layout.value("tokenizer.ggml.eos_token_id"), 512)],
        "not GGUF": [(layout.value("GGUF.version"), 0x03000000)],
    }[case]


# case -> (where the message points, what it says)
CASES = {
    "misaligned offset": ("tensor 'blk.0.attn_q.weight'", "is not a multiple of general.alignment (32)"),
    "type widened, data overlaps the next tensor": ("tensor 'blk.0.attn_q.weight'", "overlaps tensor 'blk.0.attn_k"),
    "unknown tensor type": ("tensor 'blk.0.attn_q.weight'", "has unknown type 99"),
    "offset past the end": ("tensor 'blk.0.attn_q.weight'", "runs past the end of the data section"),
    "zero dimension": ("tensor 'blk.0.attn_q.weight'", "has a zero dimension (shape [64, 0])"),
    "swapped dimensions": ("tensor 'blk.0.ffn_gate.weight'", "has shape [128, 64] but the hyper-parameters imply "
                           "[64, 128]"),
    "rope base NaN": ("key 'llama.rope.freq_base'", "is nan, not a finite number"),
    "rms epsilon negative": ("key 'llama.attention.layer_norm_rms_epsilon'", "is -1, outside [1e-12, 0.5]"),
    "array length 2^40": ("key 'tokenizer.ggml.tokens'", "array of 1099511627776 STRING items cannot fit"),
    "key length 2^40": ("key-value pair 1", "key is 1099511627776 bytes long (at most 65535)"),
    "unknown value type": ("key 'llama.context_length'", "unknown value type 77"),
    "hyper-parameter of the wrong type": ("key 'llama.block_count'", "must be an integer"),
    "tensor count 2^40": ("header", "claims 1099511627776 tensors"),
    "block_count 1000": ("layer 3", "lacks attn_norm"),
    "block_count 2": ("tensor 'blk.2.attn_q.weight'", "belongs to layer 2 but llama.block_count is 2"),
    "context_length 2^31-1": ("key 'llama.context_length'", "is 2147483647, outside [1, 1048576]"),
    "head_count 0": ("key 'llama.attention.head_count'", "is 0, outside [1, 64]"),
    "head_count 7": ("key 'llama.attention.head_count'", "7 does not divide embedding_length (64)"),
    "head_count_kv 3": ("key 'llama.attention.head_count_kv'", "3 does not divide attention.head_count (4)"),
    "embedding_length 128": ("tensor 'token_embd.weight'", "has shape [64, 512] but the hyper-parameters imply "
                             "[128, 512]"),
    "vocab_size disagrees": ("key 'llama.vocab_size'", "is 511 but token_embd.weight has 512 rows"),
    "special token outside the vocabulary": ("key 'tokenizer.ggml.eos_token_id'", "is 512, outside [0, 511]"),
    "not GGUF": ("header", "version 50331648 is not supported (2 or 3)"),
}


def test_the_tiny_file_and_the_default_model_are_valid(tiny):
    from pagedllm.model.loader import default_gguf_path

    assert len(validate_gguf(tiny[0]).tensors) == 1 + 9 * 3 + 2
    metadata = validate_gguf(default_gguf_path())
    assert metadata.value("llama.block_count") == 30 and metadata.value("tokenizer.ggml.tokens").length == 49152


@pytest.mark.parametrize("case", list(CASES))
def test_each_corruption_is_one_clear_error(tiny, tmp_path, case):
    source, layout = tiny
    path = patched(source, tmp_path / "bad.gguf", *_edits(layout, case))
    where, what = CASES[case]
    with pytest.raises(InvalidModelFileError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"invalid model file {str(path)!r}: {where}: "), message
    assert what in message, message


def test_a_tokenizer_shorter_than_the_embedding(tmp_path):
    from tests.model.gguf_writer_helpers import spm_vocab, write_converted_gguf
    from tests.model.tiny_models import make_hf_model

    path = tmp_path / "short-vocab.gguf"
    write_converted_gguf(make_hf_model("llama"), path, GGMLQuantizationType.F32, vocab=spm_vocab(500, []))
    with pytest.raises(InvalidModelFileError, match=r"key 'tokenizer.ggml.tokens': lists 500 tokens but "
                                                    r"token_embd.weight has 512 rows"):
        validate_gguf(path)


def test_truncated_anywhere_in_the_metadata_is_one_clear_error(tiny, tmp_path):
    source, layout = tiny
    data = source.read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in range(0, layout.data_start + 64, 97):
        path.write_bytes(data[:cut])
        with pytest.raises(InvalidModelFileError,
                           match=r"^invalid model file .*(empty|remain|beyond|past the end|can hold)"):
            read_metadata(path)


def test_the_cli_prints_one_line_and_exits_nonzero(tiny, tmp_path):
    source, layout = tiny
    path = patched(source, tmp_path / "bad.gguf", *_edits(layout, "head_count 0"))
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "Hello", "--model",
                             str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "key 'llama.attention.head_count': is 0, outside [1, 64]" in result.stderr, result.stderr


def test_a_file_corrupted_after_its_conversion_was_cached_is_still_refused(tiny, tmp_path, monkeypatch):
    """The conversion cache keys a file by its size and its first and last MiB: a tensor description past the
    first MiB (the default model's lie at 1.7 MB) can change without a new conversion. Every load checks again."""
    from pagedllm.model import loader, model_source

    source, layout = tiny
    path = tmp_path / "model.gguf"
    path.write_bytes(source.read_bytes())
    load_model(str(path))  # converted and cached
    key = model_source._source_key(path)
    patched(path, path, *_edits(layout, "type widened, data overlaps the next tensor"))
    monkeypatch.setattr(model_source, "_source_key", lambda _: key)  # as if the change lay between the edges
    for load in (lambda: load_model(str(path)), lambda: loader.prepare_model_dir(str(path), weights=False)):
        with pytest.raises(InvalidModelFileError, match="overlaps tensor 'blk.0.attn_k"):
            load()
