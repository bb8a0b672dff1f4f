"""Chat templates are untrusted code: rendered in Jinja's immutable sandbox (nothing outside it is reached)
and stopped, with a clear ChatTemplateError, when they take too long or produce too much; a well-behaved
template renders exactly the ids transformers' apply_chat_template gives."""

import time

import pytest
from jinja2.exceptions import SecurityError

from pagedllm.entrypoints.chat import ChatTemplateError, render_chat
from tests.engine.tiny_llama_dir import default_model_dir

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello <|im_end|> there"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And then?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def test_the_models_template_renders_as_transformers_does(tokenizer):
    for add_generation_prompt in (True, False):
        reference = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True)
        reference = reference["input_ids"] if hasattr(reference, "keys") else reference
        assert render_chat(tokenizer, MESSAGES, add_generation_prompt=add_generation_prompt) == list(reference)


@pytest.mark.parametrize("template", [
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ joiner.__init__.__globals__ }}{{ 'touch {marker}' }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ namespace.__init__.__globals__['os'].system('touch {marker}') }}",
    "{{ messages.append('x') }}{{ messages.__class__ }}",
    "{% set x = messages.pop() %}",
])
def test_a_template_reaching_outside_the_sandbox_fails_and_nothing_runs(tokenizer, tmp_path, template):
    marker = tmp_path / "ran"
    with pytest.raises(SecurityError, match="unsafe|not safely callable"):
        render_chat(tokenizer, MESSAGES, chat_template=template.replace("{marker}", str(marker)))
    assert not marker.exists()


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # outputs nothing
    "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i|string|length }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(100000) %}{{ f }}{% endfor %}{% endmacro %}"
    "{% for i in range(100000) %}{{ f(i)|length }}{% endfor %}",
])
def test_a_template_that_runs_too_long_is_stopped_in_bounded_time(tokenizer, template):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"ran past its render budget of 0.5 s"):
        render_chat(tokenizer, MESSAGES, chat_template=template, budget_s=0.5)
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("template,words", [
    ("{{ 'x' * 10**10 }}", "output exceeds 1000000 characters"),
    ("{{ ['x'] * 10**10 }}", "output exceeds 1000000 characters"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "output exceeds 1000000 characters"),
    ("{{ 'ab'|center(10**9) }}", "passes 1000000000 to center"),
    ("{{ 7 ** 10000000 }}", "a number over 4096 bits"),
    ("{{ 'ab'.center(10**9) }}", "passes 1000000000 to center"),
    ("{{ '%*s'|format(10**9, 'x') }}", "passes 1000000000 to format"),
    ("{{ '%*s' % (10**9, 'x') }}", "passes 1000000000 to %"),
    ("{{ 'x'|indent(10**9, true) }}", "passes 1000000000 to indent"),
    ("{% set a = 'a' * 1000 %}{{ (a * 999)|replace('a', a) }}", "output exceeds 1000000 characters"),
    ("{% set a = 'a' * 1000 %}{{ (a * 999).replace('a', a) }}", "output exceeds 1000000 characters"),
    ("{{ messages|tojson(indent=10**9) }}", "passes 1000000000 to tojson"),
])
def test_a_template_that_produces_too_much_is_stopped(tokenizer, template, words):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=words):
        render_chat(tokenizer, MESSAGES, chat_template=template, max_chars=1_000_000)
    assert time.monotonic() - start < 3.0


def test_the_models_own_template_is_under_the_same_budget(tokenizer):
    hostile = tokenizer.__class__.from_pretrained(str(default_model_dir()))
    hostile.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="render budget"):
        render_chat(hostile, MESSAGES, budget_s=0.3)
    assert render_chat(tokenizer, MESSAGES)  # and the next render is budgeted afresh


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"messages": []}, {"return_tensors": "pt"}])
def test_template_variables_cannot_override_the_arguments(tokenizer, kwargs):
    with pytest.raises(ChatTemplateError, match=f"may not set {next(iter(kwargs))}"):
        render_chat(tokenizer, MESSAGES, template_kwargs=kwargs)


def test_template_variables_reach_the_template(tokenizer):
    ids = render_chat(tokenizer, MESSAGES, chat_template="{{ greeting }} {{ messages[0].content }}",
                      template_kwargs={"greeting": "Howdy"})
    assert tokenizer.decode(ids) == "Howdy Be brief."
