"""`pagedllm bench agent-apis`: its stream timing reads the events the server's own builders write for each API
(no server: the Responses and Messages builders, and chat chunks as OpenAI's API shapes them), and its
summary gives each API's ratio to chat completions."""

from __future__ import annotations

import pytest

from pagedllm.bench.agent_apis import APIS, agent_apis_table, measure_stream, request_body, summarize
from pagedllm.entrypoints.anthropic.serving_messages import MessageBuilder
from pagedllm.entrypoints.openai.chat_turn import Piece, TurnEnd
from pagedllm.entrypoints.openai.responses_output import ResponseBuilder
from pagedllm.entrypoints.openai.serving import named_sse_event, sse_event

WORDS = ["Once", " upon", " a", " time"]
END = TurnEnd("length", None, num_prompt_tokens=9, num_output_tokens=len(WORDS), num_cached_tokens=0)


def _lines(frames: list[str]) -> list[str]:
    return [line for frame in frames for line in frame.splitlines()]


def stream_lines(api: str) -> list[str]:
    """The SSE lines of a 4-token answer, as the server frames them for `api`."""
    if api == "chat":
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        chunks += [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in WORDS]
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                   {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(WORDS)}}]
        return _lines([sse_event(c) for c in chunks] + [sse_event("[DONE]")])
    builder = ResponseBuilder("resp_1", "m", {}) if api == "responses" else MessageBuilder("msg_1", "m", 9)
    events = builder.start()
    for w in WORDS:
        events += builder.add(Piece("text", w))
    events += builder.finish(END) if api == "responses" else builder.finish(END, None)
    return _lines([named_sse_event(e) for e in events])


@pytest.mark.parametrize("api", APIS)
def test_measure_stream_reads_each_api(api):
    lines = stream_lines(api)
    # one second between lines: the first token arrives at its line's index, the last event at the end
    first = next(i for i, line in enumerate(lines) if WORDS[0] in line)
    result = measure_stream(api, [(float(i), line) for i, line in enumerate(lines)], start=-1.0)
    assert result["output_tokens"] == len(WORDS)
    assert result["ttft_ms"] == pytest.approx(1e3 * (first + 1))
    last = max(i for i, line in enumerate(lines) if line.startswith("data: {"))
    assert result["decode_tok_s"] == pytest.approx((len(WORDS) - 1) / (last - first))


def test_measure_stream_raises_on_an_error_event():
    lines = _lines([named_sse_event({"type": "error", "error": {"type": "api_error", "message": "boom"}})])
    with pytest.raises(RuntimeError, match="boom"):
        measure_stream("messages", [(0.0, line) for line in lines], start=0.0)


def test_request_bodies_ask_the_same_of_each_api():
    bodies = {api: request_body(api, "m", 32) for api in APIS}
    assert bodies["chat"]["max_tokens"] == bodies["responses"]["max_output_tokens"] == bodies["messages"]["max_tokens"]
    assert bodies["chat"]["messages"] == bodies["responses"]["input"] == bodies["messages"]["messages"]
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies.values())


def test_summary_ratios_to_chat():
    def run(api, tok_s, decode):
        return {"api": api, "output_tok_s": tok_s, "wall_s": 1.0,
                "streams": [{"decode_tok_s": decode, "ttft_ms": 10.0, "output_tokens": 32}]}
    runs = [run("chat", 100, 50), run("responses", 95, 40), run("messages", 110, 55),
            run("chat", 100, 50), run("responses", 97, 45), run("messages", 90, 55)]
    summary = summarize(runs, list(APIS))
    assert summary["chat"]["output_vs_chat"] == 1.0
    assert summary["responses"]["output_tok_s"] == 96 and summary["responses"]["output_vs_chat"] == 0.96
    assert summary["messages"]["decode_vs_chat"] == pytest.approx(1.1)
    table = agent_apis_table({"summary": summary})
    assert table.startswith("| API |") and "| responses | 96.0 | 0.960 |" in table


@pytest.mark.slow  # a real server in a subprocess
def test_agent_apis_bench_smoke(tmp_path):
    import json

    from pagedllm.entrypoints.cli import main
    from tests.engine.tiny_llama_dir import build_tiny_llama_dir

    model = build_tiny_llama_dir(tmp_path / "tiny", max_position_embeddings=1024)
    out = tmp_path / "out"
    argv = ["--log-level", "WARNING", "bench", "agent-apis", "--no-progress", "--out", str(out), "--model", str(model),
            "--max-model-len", "512", "--num-kv-blocks", "96", "--max-num-seqs", "4", "--rounds", "2",
            "--max-tokens", "24", "--concurrency", "2"]
    assert main(argv) == 0
    result = json.loads((out / "agent_apis.json").read_text())
    assert [r["api"] for r in result["runs"]] == [*APIS, *APIS[1:], APIS[0]]  # alternating, rotated
    for api, s in result["summary"].items():
        assert s["output_tokens"] == [24], api  # ignore_eos: every API generated exactly max_tokens
        assert s["output_tok_s"] > 0 and s["output_vs_chat"] > 0, api
    assert all(len(r["streams"]) == 2 for r in result["runs"])
    assert (out / "agent_apis.md").read_text().startswith("| API |")
