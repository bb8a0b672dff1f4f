"""load_model's errors on Hugging Face directories: each names what went wrong and what is supported."""

import json

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
