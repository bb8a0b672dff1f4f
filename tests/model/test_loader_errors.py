"""load_model's errors on Hugging Face directories: each names what went wrong and what is supported."""

import json
import re

import pytest

from pagedllm.errors import InvalidModelFileError, ModelLoadError
from pagedllm.model import load_model
from pagedllm.model.registry import resolve_model_class, supported_architectures
from tests.model.tiny_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny"))


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model-dir")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert name in str(info.value)


def test_registry():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(supported_architectures())
    assert supported_architectures() == sorted(supported_architectures())
    with pytest.raises(ModelLoadError, match="supported"):
        resolve_model_class(None)


def test_truncated_safetensors(tiny_dir, tmp_path):
    import shutil
    from pathlib import Path

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = Path(broken) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelFileError, match=r"data_offsets .* not a range inside .*\(file truncated"):
        load_model(str(broken))


def test_no_weights(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text((__import__("pathlib").Path(tiny_dir) / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_sharded_checkpoint(tmp_path):
    hf = make_hf_model("qwen2", seed=9)
    hf.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(str(tmp_path))
    assert loaded.hf_config.model_type == "qwen2"


def test_a_tokenizer_file_past_its_bound_is_refused_before_it_is_read(tiny_dir, tmp_path, monkeypatch):
    import shutil

    from pagedllm.model import checkpoint_validate
    from pagedllm.model.loader import load_model_info

    broken = tmp_path / "big-tokenizer"
    shutil.copytree(tiny_dir, broken)
    (broken / "tokenizer.json").write_text("{}" + " " * 4096)
    monkeypatch.setattr(checkpoint_validate, "MAX_TOKENIZER_FILE_BYTES", 4096)
    with pytest.raises(InvalidModelFileError, match=r"tokenizer.json': file: is 4098 bytes, more than the 4096"):
        load_model_info(str(broken)).tokenizer


def test_config_values_past_their_bounds_name_the_key(tiny_dir, tmp_path):
    import shutil

    for key, value, words in (("num_hidden_layers", 1_000_000, "is 1000000, outside [1, 1024]"),
                              ("rms_norm_eps", float("nan"), "is nan, not a finite number"),
                              ("eos_token_id", 512, "512 is not a token id of the vocabulary (0 to 511)"),
                              ("max_position_embeddings", 2**31 - 1, "is 2147483647, outside [1, 1048576]")):
        broken = tmp_path / key
        shutil.copytree(tiny_dir, broken)
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(InvalidModelFileError, match=rf"config.json': key '{key}': {re.escape(words)}"):
            load_model(str(broken))


def test_safetensors_headers_name_the_tensor(tiny_dir, tmp_path):
    import shutil
    import struct

    cases = {"unknown dtype": ({"dtype": "F12"}, "has unknown dtype 'F12'"),
             "shape disagrees": ({"shape": [3, 3]}, "F32 of shape [3, 3] takes 36 bytes but its data_offsets span 256"),
             "negative dimension": ({"shape": [-1]}, "has shape [-1], not a list of non-negative integers")}
    for name, (change, words) in cases.items():
        broken = tmp_path / name.replace(" ", "-")
        shutil.copytree(tiny_dir, broken)
        weights = broken / "model.safetensors"
        data = weights.read_bytes()
        (length,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + length])
        header["model.norm.weight"].update(change)
        raw = json.dumps(header).encode()  # offsets count from the data's start: a new header length keeps them
        weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
        with pytest.raises(InvalidModelFileError, match=rf"tensor 'model.norm.weight': {re.escape(words)}"):
            load_model(str(broken))
