"""GGUF files written here from a tiny random HF Llama (llama.cpp Q/K permutation applied) load exactly."""

import copy
import os
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm.errors import InvalidModelFileError, ModelLoadError
from pagedllm.model import gguf_loader, load_model
from pagedllm.model.loader import ensure_converted, resolve_hf_dir
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.paged_kv_helpers import PagedRunner
from tests.model.tiny_models import make_hf_model

IDS = list(range(3, 30))


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["llama", "llama_tied"])
def hf_model(request):
    return make_hf_model(request.param, seed=3)


def logits_of(model, ids):
    return PagedRunner(model, block_size=4).step([(0, ids)])


def hf_logits(hf, ids, state_dict=None):
    if state_dict is not None:
        hf = copy.deepcopy(hf)
        hf.load_state_dict(state_dict)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_f32_round_trip_matches_hf(hf_model, tmp_path):
    path = tmp_path / "tiny-f32.gguf"
    write_llama_gguf(hf_model, path, GGMLQuantizationType.F32)
    loaded = load_model(str(path))
    assert loaded.hf_config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert loaded.hf_config.head_dim == hf_model.config.head_dim
    torch.testing.assert_close(logits_of(loaded.model, IDS), hf_logits(hf_model, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_matches_dequantized_reference(hf_model, tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    reference = write_llama_gguf(hf_model, path, GGMLQuantizationType[qtype])
    loaded = load_model(str(path))
    torch.testing.assert_close(
        logits_of(loaded.model, IDS), hf_logits(hf_model, IDS, reference), atol=1e-4, rtol=0
    )
    # And the converted directory, with weights, is a plain HF checkpoint transformers can read.
    from transformers import AutoModelForCausalLM

    assert str(resolve_hf_dir(str(path))) == loaded.model_path
    again = AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(again, IDS), hf_logits(hf_model, IDS, reference), atol=1e-4, rtol=0)


def test_conversion_is_cached_and_redone_when_file_changes(tmp_path, monkeypatch):
    hf = make_hf_model("llama", seed=4)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf, path, GGMLQuantizationType.F32)
    first = load_model(str(path))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "convert_gguf_to_hf_dir", must_not_convert)
        assert load_model(str(path)).model_path == first.model_path

    reference = write_llama_gguf(hf, path, GGMLQuantizationType.Q8_0)  # same path, new content
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = load_model(str(path))
    assert second.model_path == first.model_path
    torch.testing.assert_close(logits_of(second.model, IDS), hf_logits(hf, IDS, reference), atol=1e-4, rtol=0)


def test_concurrent_conversions_of_one_file(tmp_path):
    hf = make_hf_model("llama", seed=5)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf, path, GGMLQuantizationType.F32)
    out = tmp_path / "cache" / "shared"
    results, errors = [], []

    def convert():
        try:
            results.append(ensure_converted(path, out))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [out] * 4
    assert sorted(p.name for p in out.parent.iterdir()) == ["shared"]  # no temp dirs left behind
    assert load_model(str(out)).hf_config.num_hidden_layers == 3


def test_unsupported_tensor_type_names_supported_ones(tmp_path):
    hf = make_hf_model("llama", seed=6)
    path = tmp_path / "iq.gguf"
    rows, cols = hf.config.hidden_size, hf.config.hidden_size
    raw = np.zeros((rows, cols // 32 * 17), dtype=np.uint8)  # MXFP4: 17 bytes per 32 values
    write_llama_gguf(
        hf, path, GGMLQuantizationType.F32,
        override={"blk.0.attn_output.weight": (raw, GGMLQuantizationType.MXFP4)},
    )
    with pytest.raises(ModelLoadError, match=r"MXFP4.*supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        load_model(str(path))


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(make_hf_model("llama", seed=7), path, GGMLQuantizationType.F32, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'.*llama"):
        load_model(str(path))


def test_truncated_gguf(tmp_path):
    path = tmp_path / "cut.gguf"
    write_llama_gguf(make_hf_model("llama", seed=8), path, GGMLQuantizationType.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelFileError, match="runs past the end of the data section .* file truncated"):
        load_model(str(path))


def test_garbage_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(InvalidModelFileError, match="header: starts with b'not ', not the GGUF magic"):
        load_model(str(path))


def test_the_weights_reader_steps_over_the_tokenizer_arrays_and_reads_the_rest_alike():
    """The default model's GGUF (49 K tokens and merges): every other field and every tensor as the full reader."""
    from gguf import GGUFReader

    from pagedllm.model.loader import default_gguf_path

    full, weights = GGUFReader(default_gguf_path()), gguf_loader.open_for_weights(default_gguf_path())
    skipped = {key for key, field in full.fields.items() if key.startswith("tokenizer.") and len(field.data) > 1}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= skipped
    assert list(weights.fields) == [key for key in full.fields if key not in skipped]
    for key in weights.fields:
        assert gguf_loader._field(weights, key) == gguf_loader._field(full, key), key
    assert len(weights.tensors) == len(full.tensors) > 0
    for ours, theirs in zip(weights.tensors, full.tensors):
        assert (ours.name, ours.tensor_type, list(ours.shape), ours.data_offset) == \
            (theirs.name, theirs.tensor_type, list(theirs.shape), theirs.data_offset)
        assert np.array_equal(ours.data, theirs.data)
