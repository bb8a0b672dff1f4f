"""Adapters that cannot be served are refused with a LoRAError naming the reason; the engine carries on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.errors import InvalidRequestError
from pagedllm.lora.request import LoRAError
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter
from tests.model.tiny_models import make_hf_model, save_hf_model

pytest.importorskip("peft")

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = make_hf_model("llama", seed=3)
    model_path = save_hf_model(base, tmp_path_factory.mktemp("base"))
    adapters = {
        "good": make_adapter(base, tmp_path_factory.mktemp("good"), rank=4, alpha=8, target_modules=ALL_PROJECTIONS,
                             seed=0),
        "rank16": make_adapter(base, tmp_path_factory.mktemp("rank16"), rank=16, alpha=16,
                               target_modules=["q_proj"], seed=1),
        "lm_head": make_adapter(base, tmp_path_factory.mktemp("lm_head"), rank=4, alpha=8,
                                target_modules=["q_proj", "lm_head"], seed=2),
    }
    broken = tmp_path_factory.mktemp("alpha-nan")
    for file in Path(adapters["good"]).iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    adapters["alpha NaN"] = str(broken)
    empty = tmp_path_factory.mktemp("empty")
    (empty / "config.json").write_text(json.dumps({"model_type": "llama"}))
    adapters["not an adapter"] = str(empty)
    dora = tmp_path_factory.mktemp("dora")
    llm = LLM(model=model_path, enable_lora=True, max_loras=1, max_lora_rank=8)
    return llm, model_path, adapters, dora


@pytest.mark.parametrize("name, reason", [
    ("missing", "does not exist"),
    ("not an adapter", "is not a PEFT LoRA adapter"),
    ("rank16", "rank 16 exceeds max_lora_rank (8)"),
    ("lm_head", "target modules ['lm_head'] are not in the model"),
    ("alpha NaN", "has lora_alpha nan, not a finite number"),
])
def test_unservable_adapters_are_refused_with_the_reason(setup, name, reason):
    llm, _, adapters, _ = setup
    path = adapters.get(name, "/nonexistent/adapter")
    with pytest.raises(LoRAError, match=reason.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest(name, 7 + len(name), path))
    assert issubclass(LoRAError, InvalidRequestError)  # HTTP 400
    # the engine still serves: the good adapter and the base
    outputs = llm.generate([PROMPT, PROMPT], PARAMS, use_tqdm=False,
                           lora_request=[LoRARequest("good", 1, adapters["good"]), None])
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert llm.engine.core.check_kv_leaks() == []


def test_one_id_never_names_two_adapters(setup):
    llm, _, adapters, _ = setup
    llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest("good", 1, adapters["good"]))
    with pytest.raises(LoRAError, match="lora_int_id 1 already names adapter 'good'"):
        llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest("other", 1, adapters["rank16"]))


def test_unsupported_peft_options_are_refused(setup):
    _, _, adapters, dora = setup
    from pagedllm.lora.peft import read_adapter_config

    config = json.loads((Path(adapters["good"]) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(LoRAError, match="DoRA adapters are not supported"):
        read_adapter_config(str(dora), max_lora_rank=8)


def test_lora_request_without_enable_lora_is_refused(setup):
    _, model_path, adapters, _ = setup
    llm = LLM(model=model_path)
    with pytest.raises(LoRAError, match="LoRA is not enabled"):
        llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest("good", 1, adapters["good"]))
