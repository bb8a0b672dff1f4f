"""A converted GGUF's config is read back from its resolved attributes, without transformers' config classes
(whose import costs a serving engine core ~55 MB), and equals what transformers resolves."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from transformers import AutoConfig

from pagedllm.model import load_model, resolved_config
from pagedllm.model.loader import load_model_info, resolve_hf_dir
from tests.model.gguf_writer_helpers import write_llama_gguf
from tests.model.tiny_models import make_hf_model


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(make_hf_model("llama", seed=3), path, GGMLQuantizationType.Q8_0)
    return path


def _plain(value):
    return json.loads(json.dumps(value))  # tuples read back as lists


def test_the_saved_attributes_equal_transformers_config(gguf_file):
    hf_dir = Path(load_model_info(str(gguf_file), weights=False).model_path)  # the first read saves them
    saved = resolved_config.load(hf_dir)
    reference = AutoConfig.from_pretrained(str(hf_dir))
    assert saved is not None and saved.model_type == "llama" and saved.architectures == ["LlamaForCausalLM"]
    attributes = resolved_config.resolved_attributes(reference)
    for name in ("hidden_size", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
                 "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "max_position_embeddings"):
        assert name in attributes, name  # class defaults and derived values are saved, not only config.json's
    assert {name: _plain(value) for name, value in attributes.items()} == saved.to_dict()


def test_a_load_reads_them_without_transformers_config_classes(gguf_file):
    load_model(str(gguf_file))  # converts (saving the attributes)
    code = ("import sys; from pagedllm.model import load_model; loaded = load_model(sys.argv[1]); "
            "print(type(loaded.hf_config).__name__, 'transformers.activations' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(gguf_file)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ResolvedConfig", "False", "False"], out.stderr[-2000:]


def test_an_edited_config_or_another_transformers_is_read_again(gguf_file, monkeypatch):
    hf_dir = Path(load_model(str(gguf_file)).model_path)
    assert type(load_model(str(gguf_file)).hf_config) is resolved_config.ResolvedConfig
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert resolved_config.load(hf_dir) is None  # the saved attributes belong to the old config.json
    reread = load_model(str(gguf_file)).hf_config
    assert type(reread) is not resolved_config.ResolvedConfig and reread.rms_norm_eps == 1e-3
    assert resolved_config.load(hf_dir).rms_norm_eps == 1e-3  # saved again, from the edited file
    monkeypatch.setattr(resolved_config, "version", lambda package: "0.0.1")
    assert resolved_config.load(hf_dir) is None


def _loads_without_config_classes(gguf_file, *args) -> list[str]:
    code = ("import sys; from pagedllm.model import load_model; "
            "loaded = load_model(sys.argv[1], gguf_dequantize=sys.argv[2:] == ['dequantize']); "
            "print(type(loaded.hf_config).__name__, 'transformers.activations' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(gguf_file), *args], capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


@pytest.mark.parametrize("dequantize", [False, True])
def test_the_front_end_prepares_what_the_core_loads(gguf_file, dequantize):
    """What AsyncLLM.start does before it starts the engine core, on a GGUF never converted: the core's first
    load (here a fresh process) then converts nothing and imports none of transformers' config classes. With
    --gguf-dequantize the core reads float32 weights from the directory: they are written here too."""
    from pagedllm.config import EngineArgs
    from pagedllm.worker.executor import prepare_model_files

    prepare_model_files(EngineArgs(model=str(gguf_file), gguf_dequantize=dequantize))
    expected = ["ResolvedConfig", "False", "False"]
    assert _loads_without_config_classes(gguf_file, *(["dequantize"] if dequantize else [])) == expected
    hf_dir = resolve_hf_dir(str(gguf_file), weights=False)  # reads no config
    assert bool(list(hf_dir.glob("*.safetensors"))) == dequantize
