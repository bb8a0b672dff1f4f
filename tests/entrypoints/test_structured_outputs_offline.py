"""Structured outputs offline, on the embedded SmolLM2: sampled at temperature 1.0, every output of
every sequence parses and validates against its JSON schema, matches its regex or is one of its
choices; under forced preemption too, with n > 1 and seeds reproducible."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["tags", "ok"],
}
RATING = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                   "score": {"type": "number", "minimum": -10, "maximum": 10}},
    "required": ["color", "stars", "score"],
}
SCHEMAS = {"person": PERSON, "tags": TAGS, "rating": RATING}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def _generate(llm, prompt: str, **params) -> list:
    [output] = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return output.outputs


def assert_valid_json(completions, schema) -> None:
    for c in completions:
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sample_of_a_schema_validates(llm, name):
    schema = SCHEMAS[name]
    texts = set()
    for seed in (0, 1):
        outputs = _generate(llm, f"Write a {name} record as JSON.", n=8, seed=seed, temperature=1.0, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json=schema))
        assert_valid_json(outputs, schema)
        texts.update(c.text for c in outputs)
    assert len(texts) > 4  # real sampling, not one forced answer


def test_regex_choice_json_object_and_grammar(llm):
    for c in _generate(llm, "Call me at", n=8, seed=3, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex=PHONE)):
        assert c.finish_reason == "stop" and re.fullmatch(PHONE, c.text), c.text
    picked = _generate(llm, "The movie was great. Sentiment:", n=8, seed=4, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in picked), [c.text for c in picked]
    for c in _generate(llm, "A JSON object:", n=4, seed=5, max_tokens=96,
                       structured_outputs=StructuredOutputsParams(json_object=True)):
        if c.finish_reason == "stop":  # any object may run long at temperature 1: validate the finished ones
            assert isinstance(json.loads(c.text), dict), c.text
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    for c in _generate(llm, "Q: is water wet?", n=4, seed=6, max_tokens=16,
                       structured_outputs=StructuredOutputsParams(grammar=ebnf)):
        assert c.text in ("The answer is yes.", "The answer is no.") and c.finish_reason == "stop"


def test_seeded_n_is_reproducible_and_mixes_with_free_requests(llm):
    params = SamplingParams(n=4, seed=11, max_tokens=96, structured_outputs={"json": RATING})
    free = SamplingParams(n=2, seed=12, max_tokens=20)
    first = llm.generate(["Rate a film:", "Once upon a time"], [params, free], use_tqdm=False)
    second = llm.generate(["Rate a film:"], params, use_tqdm=False)
    assert [c.text for c in first[0].outputs] == [c.text for c in second[0].outputs]
    assert_valid_json(first[0].outputs, RATING)
    assert all(c.token_ids for c in first[1].outputs)  # the unconstrained request was not masked into silence


def test_forced_preemption_rebuilds_the_matchers():
    """A KV cache far smaller than the batch: requests are preempted (recompute) mid-JSON and resume
    with their matchers rebuilt from the tokens already generated; every output still validates."""
    small = LLM(max_model_len=256, num_kv_blocks=24, block_size=16, enable_prefix_caching=False)
    prompts = [f"Person number {i} as JSON:" for i in range(6)]
    params = SamplingParams(n=2, seed=21, max_tokens=96, structured_outputs=StructuredOutputsParams(json=PERSON))
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    for output in outputs:
        assert_valid_json(output.outputs, PERSON)
    # the same seeds without pressure give the same texts: a rebuilt matcher masks exactly as the first did
    roomy = LLM(max_model_len=256, enable_prefix_caching=False)
    again = roomy.generate(prompts[:2], params, use_tqdm=False)
    assert [[c.text for c in o.outputs] for o in again] == [[c.text for c in o.outputs] for o in outputs[:2]]


def test_prefix_cache_and_stop_strings(llm):
    prompt = "Describe a person in JSON. " * 4  # several full blocks: the second request hits the cache
    spec = StructuredOutputsParams(json=PERSON)
    first = llm.generate([prompt], SamplingParams(seed=31, max_tokens=96, structured_outputs=spec), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(seed=31, max_tokens=96, structured_outputs=spec), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].text == first.outputs[0].text
    assert_valid_json(again.outputs, PERSON)
    # a stop string cuts the constrained output early: the text is truncated there, as without a grammar
    [cut] = _generate(llm, prompt, seed=31, max_tokens=96, stop=['"age"'], structured_outputs=spec)
    assert cut.finish_reason == "stop" and first.outputs[0].text.startswith(cut.text) and '"age"' not in cut.text


@pytest.mark.parametrize("spec,words", [
    ({"json": {"type": "objectx"}}, "invalid JSON schema"),
    ({"json": "{not json"}, "invalid JSON schema"),
    ({"regex": "a(b"}, "invalid regex"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
])
def test_invalid_specs_are_refused_naming_the_problem(llm, spec, words):
    with pytest.raises(InvalidRequestError, match=words):
        llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)


def test_params_refuse_ambiguous_or_conflicting_specs():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
