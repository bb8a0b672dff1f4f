"""The front end's torch-free tokenizer is the tokenizer transformers' AutoTokenizer gives (the reference): same ids
for text and chats; --chat-template replaces the model's template in what chat requests render."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.frontend_files import load_tokenizer
from tests.engine.tiny_llama_dir import default_model_dir

TEXTS = ["What is the capital of France?", "  leading spaces, émojis 🙂 and\nnewlines\t", "<|im_start|>user"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


def test_the_named_class_tokenizes_as_autotokenizer(model_dir):
    ours, reference = load_tokenizer(str(model_dir)), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(reference)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(reference.encode(text)) == reference.decode(reference.encode(text))
    assert (ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]
            == reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        reference.eos_token_id, reference.bos_token_id, reference.all_special_ids)


def test_without_a_named_class_autotokenizer_decides(tmp_path, model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(tmp_path)).encode(TEXTS[0]) == AutoTokenizer.from_pretrained(
        str(model_dir)).encode(TEXTS[0])
    assert load_tokenizer(str(tmp_path / "missing")) is None


def test_chat_template_flag_replaces_the_models(model_dir):
    from pagedllm.entrypoints.openai.api_server import set_chat_template
    from pagedllm.entrypoints.chat import ChatMessage
    from pagedllm.entrypoints.openai.serving_chat import apply_chat_template

    tokenizer = load_tokenizer(str(model_dir))
    messages = [ChatMessage(role="user", content="hi")]
    before = tokenizer.decode(apply_chat_template(tokenizer, messages, add_generation_prompt=True))
    set_chat_template(tokenizer, "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[bot]")
    after = tokenizer.decode(apply_chat_template(tokenizer, messages, add_generation_prompt=True))
    assert "<|im_start|>" in before
    assert after == "[user] hi\n[bot]"
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        set_chat_template(None, "{{ messages }}")
