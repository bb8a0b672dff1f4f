"""Tool-call and reasoning parsers without a server: recorded model outputs parse to the expected calls,
broken calls come back as content, every split of an output (at every UTF-8 byte, so inside a multi-byte
character and inside the markers) streams exactly what the one-shot parse returns (hypothesis), with the
arguments of constrained calls streamed in pieces, and the grammars of forced calls accept what the
parsers read and nothing else."""

from __future__ import annotations

import codecs
import json

import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string

from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCall, assemble
from pagedllm.entrypoints.openai.tool_parsers.grammar import (
    after_reasoning,
    either_grammar,
    opened_call_grammar,
    tool_call_grammar,
)
from pagedllm.entrypoints.openai.tools import ChoiceParser, ToolDefinition, ToolPlan, written_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMES = set(SCHEMAS)


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


# (parser, model output, content, calls). The hermes ones marked "SmolLM2" were recorded from `pagedllm serve`
# (tool_choice required, temperature 1); the others are written as those model families write.
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',  # SmolLM2
     "", [call("get_weather", city="Zürich", unit="celsius"), call("add", a=2, b=3)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "CentraliDiLazio", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "LuxIniDiLazio", "unit": '
               '"celsius"}}\n</tool_call>',  # SmolLM2
     "", [call("get_weather", city="CentraliDiLazio", unit="celsius"),
          call("get_weather", city="LuxIniDiLazio", unit="celsius")]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": '
               '"add", "argum',  # SmolLM2, cut by max_tokens: the unfinished call stays text
     '<tool_call>\n{"name": "add", "argum', [call("add", a=1, b=2)]),
    ("hermes", 'Let me check the weather in 東京 for you.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "東京", "unit": "celsius"}}\n</tool_call>',  # Qwen2.5
     "Let me check the weather in 東京 for you.", [call("get_weather", city="東京", unit="celsius")]),
    ("hermes", "The answer is 5 😀, no tool needed.", "The answer is 5 😀, no tool needed.", []),
    ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # unknown tool: text
     '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call> sorry',  # broken JSON: text
     '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call> sorry', []),
    ("hermes", "a < b and <tool but not a call", "a < b and <tool but not a call", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "São Paulo", "unit": "celsius"}}',
     "", [call("get_weather", city="São Paulo", unit="celsius")]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": '
                    '{"a": 3, "b": 4}}', "", [call("add", a=1, b=2), call("add", a=3, b=4)]),
    ("llama3_json", "It is sunny in Zürich {probably}.", "It is sunny in Zürich {probably}.", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Kraków", "unit": "celsius"}}, '
                '{"name": "add", "arguments": {"a": 2, "b": 2}}]',
     "", [call("get_weather", city="Kraków", unit="celsius"), call("add", a=2, b=2)]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 7, "b": 8}}]', "Sure.", [call("add", a=7, b=8)]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}, {"name": "add", "arguments": '
                '{"a": 3}}]', "", [call("add", a=1, b=2), call("add", a=3)]),  # arguments as JSON text, as some write
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": "not json"}]',
     '[TOOL_CALLS][{"name": "add", "arguments": "not json"}]', []),
    ("mistral", "[TOOL_CALL] is not the marker", "[TOOL_CALL] is not the marker", []),
    ("pythonic", '[get_weather(city="Αθήνα", unit="celsius"), add(a=1, b=2)]',
     "", [call("get_weather", city="Αθήνα", unit="celsius"), call("add", a=1, b=2)]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "No list here [add(a=1)]", "No list here [add(a=1)]", []),
]


@pytest.mark.parametrize("parser,text,content,calls", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_recorded_outputs_parse_to_their_calls(parser, text, content, calls):
    out = TOOL_PARSERS[parser](NAMES).parse(text)
    assert (out.content, out.calls) == (content, calls)
    for c in out.calls:  # arguments are a JSON object as text
        assert isinstance(json.loads(c.arguments), dict)


def _stream(feed, finish, text: str, cuts: list[int]) -> list:
    """Feed `text`'s UTF-8 bytes cut at `cuts` through an incremental decoder (as detokenizing does: a cut
    inside a character yields the bytes before it nothing), collecting what feed and finish return."""
    data = text.encode()
    decoder = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *sorted(set(cuts)), len(data)]
    out = [feed(decoder.decode(data[a:b])) for a, b in zip(bounds, bounds[1:])]
    out.append(finish())
    return out


# The same machine with stream_arguments (the output was generated under a grammar that admits only valid calls):
# a hermes call is committed once its header reaches the arguments' `{`, and its arguments are the text the model
# wrote, streamed as it grows. Broken calls a grammar cannot produce commit all the same; unknown names and headers
# in another shape are held whole, as without a grammar.
LONG_CITY = "Llanfair\\u00e9 \\\"pwll\\\" " + "Zürich 東京 😀 " * 12
RECORDED_STREAMED = [
    *[("hermes", text, content, calls) for parser, text, content, calls in RECORDED[:5] if parser == "hermes"
      and "argum'" not in text[-7:]],
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": '
               '"add", "arguments": {"a": 3',  # cut by max_tokens inside the arguments: a call with what was written
     "", [call("add", a=1, b=2), ToolCall("add", '{"a": 3')]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call> sorry',  # no grammar writes it
     "sorry", [ToolCall("add", '{"a": 1,}')]),
    ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>', "", [call("add", a=1, b=2)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + LONG_CITY + '", "unit": "celsius"}}\n'
               '</tool_call>', "", [ToolCall("get_weather", '{"city": "' + LONG_CITY + '", "unit": "celsius"}')]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": {"x": [1, "}]\\""]}, "b": 2}}\n</tool_call>', "",
     [ToolCall("add", '{"a": {"x": [1, "}]\\""]}, "b": 2}')]),
]
CASES = [(False, *r) for r in RECORDED] + [(True, *r) for r in RECORDED_STREAMED]
CASE_IDS = [f"{r[1]}-{'streamed' if r[0] else 'held'}-{i}" for i, r in enumerate(CASES)]


@pytest.mark.parametrize("stream,parser,text,content,calls", CASES[len(RECORDED):], ids=CASE_IDS[len(RECORDED):])
def test_constrained_outputs_parse_to_their_calls(stream, parser, text, content, calls):
    out = TOOL_PARSERS[parser](NAMES, stream_arguments=stream).parse(text)
    assert (out.content, out.calls) == (content, calls)


@st.composite
def split_outputs(draw):
    stream, parser, text = draw(st.sampled_from(CASES))[:3]
    size = len(text.encode())
    cuts = draw(st.lists(st.integers(0, size), max_size=size))
    return stream, parser, text, cuts


def _check_deltas(deltas) -> None:
    """Each call opens with its name before any of its arguments, and is named once."""
    named: set[int] = set()
    for d in deltas:
        assert d.index in named or d.name is not None, d
        assert d.name is None or d.index not in named, d
        named.add(d.index)


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(split_outputs())
def test_every_split_streams_what_the_whole_parse_returns(case):
    stream, parser_name, text, cuts = case
    whole = TOOL_PARSERS[parser_name](NAMES, stream_arguments=stream).parse(text)
    parser = TOOL_PARSERS[parser_name](NAMES, stream_arguments=stream)
    pieces = _stream(parser.feed, parser.finish, text, cuts)
    deltas = [c for p in pieces for c in p.calls]
    _check_deltas(deltas)
    assert "".join(p.content for p in pieces) == whole.content
    assert assemble(deltas) == whole.calls  # the concatenated argument pieces are the one-shot arguments


@pytest.mark.parametrize("stream,parser,text,content,calls", CASES, ids=CASE_IDS)
def test_one_byte_at_a_time_and_every_single_cut(stream, parser, text, content, calls):
    """The exhaustive small cases beside hypothesis: every single cut, and every byte its own piece."""
    size = len(text.encode())
    for cuts in [[i] for i in range(size + 1)] + [list(range(size + 1))]:
        p = TOOL_PARSERS[parser](NAMES, stream_arguments=stream)
        pieces = _stream(p.feed, p.finish, text, cuts)
        deltas = [c for x in pieces for c in x.calls]
        _check_deltas(deltas)
        assert ("".join(x.content for x in pieces), assemble(deltas)) == (content, calls), cuts


def test_a_long_constrained_call_streams_its_arguments_in_pieces():
    """Fed as a model writes (a few characters at a time), a long call sends its name first, then its arguments
    as they grow, never a partial escape, never the wrapper's closing brace; held, it comes whole at the end."""
    text = CASES[-2][2]
    arguments = CASES[-2][4][0].arguments
    for stream in (True, False):
        parser = TOOL_PARSERS["hermes"](NAMES, stream_arguments=stream)
        deltas = [d for i in range(0, len(text), 3) for d in parser.feed(text[i:i + 3]).calls]
        deltas += parser.finish().calls
        assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
        pieces = [d.arguments for d in deltas[1:]]
        assert all(d.name is None for d in deltas[1:]) and json.loads("".join(pieces)) == json.loads(arguments)
        if not stream:  # held, the arguments come whole, re-encoded (\u00e9 written as é)
            assert len(pieces) == 1
            continue
        assert "".join(pieces) == arguments  # streamed, they are the model's own text
        assert len(pieces) > 20, pieces
        sent = ""
        for piece in pieces:
            sent += piece
            tail = sent[len(sent.rstrip("0123456789abcdefABCDEF")) - 2:]
            assert not sent.endswith("\\") or sent.endswith("\\\\"), sent  # no lone backslash at a piece's end
            assert not tail.startswith("\\u") or len(sent) == len(arguments), sent
        # the name went out before the arguments were complete: the first piece came with the header
        assert len(pieces[0]) < len(arguments) // 4


REASONING = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "It is 4."),
    ("qwen3", "It is 4, no thinking.", "", "It is 4, no thinking."),
    ("qwen3", "<think>unfinished thought", "unfinished thought", ""),
    ("deepseek_r1", "Hmm, 2+2 is 4 — easy.</think>The answer: 4", "Hmm, 2+2 is 4 — easy.", "The answer: 4"),
    ("deepseek_r1", "<think>x < y</think>  ok", "x < y", "ok"),
    ("deepseek_r1", "still thinking about </thin", "still thinking about </thin", ""),
]


@pytest.mark.parametrize("name,text,reasoning,answer", REASONING)
def test_reasoning_is_split_from_the_answer_at_every_cut(name, text, reasoning, answer):
    assert REASONING_PARSERS[name]().parse(text) == (reasoning, answer)
    size = len(text.encode())
    for cuts in [[i] for i in range(size + 1)] + [list(range(size + 1))]:
        p = REASONING_PARSERS[name]()
        pieces = _stream(p.feed, p.finish, text, cuts)
        assert ("".join(r for r, _ in pieces), "".join(a for _, a in pieces)) == (reasoning, answer), cuts


def _plan(parser="hermes", constrained=False) -> ToolPlan:
    tools = [ToolDefinition.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
             for n, s in SCHEMAS.items()]
    return ToolPlan(parser, tools, tools, None, constrained=constrained)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(0, 200), max_size=30), st.booleans())
def test_choice_parser_streams_reasoning_then_calls_as_openai_deltas(cuts, constrained):
    text = ('<think>Weather first, in Zürich.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Zürich", "unit": "celsius"}}\n</tool_call>')
    whole = ChoiceParser(_plan(constrained=constrained), "qwen3").message(text)
    assert whole["reasoning_content"] == "Weather first, in Zürich." and whole["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [("get_weather", '{"city": "Zürich", "unit": "celsius"}')]
    parser = ChoiceParser(_plan(constrained=constrained), "qwen3")
    pieces = _stream(lambda t: parser.deltas(t, final=False), lambda: parser.deltas("", final=True), text, cuts)
    deltas = [d for p in pieces for d in p]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert not any(d.get("content") for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in calls[1:])
    if not constrained:
        assert len(calls) == 2  # held: the name, then the arguments whole
    assert "".join(tc["function"]["arguments"] for tc in calls) == whole["tool_calls"][0]["function"]["arguments"]
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_forced_call_grammars_accept_valid_calls_and_nothing_else(parser):
    functions = list(SCHEMAS.items())
    weather = '{"city": "Zürich", "unit": "celsius"}'
    one, two = written_call(parser, "get_weather", weather), written_call(parser, "add", '{"a": 1, "b": 2}')
    from pagedllm.entrypoints.openai.tool_parsers.grammar import FORMATS
    fmt = FORMATS[parser]
    single, pair = fmt.open + one + fmt.close, fmt.open + one + fmt.separator + two + fmt.close
    parallel = xgr.Grammar.from_ebnf(tool_call_grammar(parser, functions, parallel=True))
    serial = xgr.Grammar.from_ebnf(tool_call_grammar(parser, functions, parallel=False))
    named = xgr.Grammar.from_ebnf(tool_call_grammar(parser, [("add", ADD)], parallel=True))
    assert _is_grammar_accept_string(parallel, single) and _is_grammar_accept_string(parallel, pair)
    assert _is_grammar_accept_string(serial, single) and not _is_grammar_accept_string(serial, pair)
    assert not _is_grammar_accept_string(named, single) and _is_grammar_accept_string(named, fmt.open + two + fmt.close)
    for bad in ('{"city": "Zürich"}', '{"city": "Zürich", "unit": "kelvin"}', '{"city": 5, "unit": "celsius"}'):
        assert not _is_grammar_accept_string(parallel, fmt.open + written_call(parser, "get_weather", bad) + fmt.close)
    assert not _is_grammar_accept_string(parallel, "Sure! " + single)
    # what the grammar admits, the parser reads back as the same calls, valid against their schemas
    out = TOOL_PARSERS[parser](NAMES).parse(pair)
    assert [c.name for c in out.calls] == ["get_weather", "add"] and out.content == ""
    for c in out.calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_auto_grammar_leaves_text_free_and_constrains_an_opened_call():
    functions = list(SCHEMAS.items())
    good = written_call("hermes", "add", '{"a": 1, "b": 2}')
    for parallel in (True, False):
        g = xgr.Grammar.from_ebnf(opened_call_grammar("hermes", functions, parallel))
        assert _is_grammar_accept_string(g, "Any text at all, 😀 < > { }")
        assert _is_grammar_accept_string(g, "Let me add. " + good)
        assert not _is_grammar_accept_string(g, "Let me add. " + written_call("hermes", "add", '{"a": "one"}'))
        assert not _is_grammar_accept_string(g, written_call("hermes", "subtract", '{"a": 1, "b": 2}'))
        assert _is_grammar_accept_string(g, good + "\n" + good) == parallel
    assert opened_call_grammar("pythonic", functions, True) is None  # no marker that opens a call mid-text
    either = xgr.Grammar.from_ebnf(either_grammar(xgr.Grammar.from_json_schema(ADD, any_whitespace=False),
                                                  tool_call_grammar("hermes", functions, False)))
    assert _is_grammar_accept_string(either, '{"a": 1, "b": 2}') and _is_grammar_accept_string(either, good)
    assert not _is_grammar_accept_string(either, "free text") and not _is_grammar_accept_string(either, good + "\n" + good)


def test_grammars_apply_after_the_reasoning():
    calls = xgr.Grammar.from_ebnf(tool_call_grammar("hermes", [("add", ADD)], False))
    call_text = written_call("hermes", "add", '{"a": 1, "b": 2}')
    r1 = xgr.Grammar.from_ebnf(after_reasoning(calls, "deepseek_r1"))
    assert _is_grammar_accept_string(r1, "Two numbers < 3, so add.</think>\n\n" + call_text)
    assert not _is_grammar_accept_string(r1, call_text)  # the template opened <think>: it must be closed first
    assert not _is_grammar_accept_string(r1, "thought</think>\nI will not call.")
    q3 = xgr.Grammar.from_ebnf(after_reasoning(calls, "qwen3"))
    assert _is_grammar_accept_string(q3, call_text) and _is_grammar_accept_string(q3, "<think>hm</think>" + call_text)
    assert not _is_grammar_accept_string(q3, "hm</think>" + call_text)
    # what such an output parses to: reasoning apart, then the call
    message = ChoiceParser(_plan(), "qwen3").message("<think>hm</think>" + call_text)
    assert message["reasoning_content"] == "hm" and message["tool_calls"][0]["function"]["name"] == "add"
