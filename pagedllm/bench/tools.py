"""`pagedllm bench tools`: what a tool or structured-output grammar costs one request, over HTTP against
`pagedllm serve` (--enable-auto-tool-choice, --tool-call-parser hermes, prefix caching off).

    pagedllm bench tools --repeats 5 --max-tokens 64

One streamed request at a time, the modes alternating (the order rotates every round, so none always
runs first), all with the same prompt tokens: the tools' system prompt as the server writes it for a
template that takes no tools (the default model's), and one question; usage.prompt_tokens is recorded per
mode to show it.

  free         no tools, no format: free text
  json_schema  response_format json_schema (the add tool's parameters)
  required     tools, tool_choice required (the grammar of calls to any tool)
  named        tools, tool_choice naming add
  auto         tools, tool_choice auto (free text; a call is constrained once opened)

Per request: TTFT is the time from sending to the first chunk that carries a generated token (logprobs are
requested so every token step sends a chunk, whatever the parsers hold back); decode tok/s is
(completion tokens - 1) / (last chunk - first token chunk). A warm-up round first compiles each grammar
(the server caches it); its TTFT is reported apart as `cold_ttft_ms`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, write_result

MODES = ("free", "json_schema", "required", "named", "auto")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
QUESTION = "What is the weather in Zürich, and what is 2 + 3?"


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "tools", bench_tools,
                        help="TTFT and decode tok/s: free text vs JSON schema vs tool calls (required, named, auto)")
    p.add_argument("--url", default=None, help="an already running server (skips launching; it needs "
                                               "--enable-auto-tool-choice --tool-call-parser hermes)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--repeats", type=int, default=5, help="timed requests per mode (alternating)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default=",".join(MODES), help="which modes, comma-separated")


def request_body(mode: str, system_prompt: str, seed: int, max_tokens: int) -> dict:
    """The streamed chat request of one mode (the same messages in every mode)."""
    body = {"messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": QUESTION}],
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "max_tokens": max_tokens,
            "temperature": 0.7, "seed": seed}
    if mode == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    elif mode != "free":
        body["messages"] = body["messages"][1:]  # the server writes the same system prompt from the tools
        body["tools"] = TOOLS
        body["tool_choice"] = {"type": "function", "function": {"name": "add"}} if mode == "named" else mode
    return body


def timed_request(client, url: str, body: dict, headers: dict) -> dict:
    """Send one streamed request; its TTFT, decode tok/s, token counts and what it answered."""
    start = time.perf_counter()
    first = last = None
    usage, finish, num_calls, num_argument_pieces = None, None, 0, 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if first is None and (choice.get("logprobs") or delta.get("content") or delta.get("tool_calls")):
                    first = time.perf_counter()
                for call in delta.get("tool_calls") or ():
                    num_calls += "id" in call
                    num_argument_pieces += bool(call["function"].get("arguments"))
                finish = choice.get("finish_reason") or finish
                last = time.perf_counter()
    assert usage is not None and first is not None, "the stream sent no token or no usage"
    tokens = usage["completion_tokens"]
    return {"ttft_ms": 1e3 * (first - start), "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 else None,
            "completion_tokens": tokens, "prompt_tokens": usage["prompt_tokens"], "finish_reason": finish,
            "num_calls": num_calls, "num_argument_pieces": num_argument_pieces}


def run_tools(url: str, modes: list[str], repeats: int, max_tokens: int, api_key: str | None) -> dict:
    import httpx

    from pagedllm.entrypoints.openai.tools import ToolDefinition, fallback_system_prompt

    system_prompt = fallback_system_prompt("hermes", [ToolDefinition.model_validate(t) for t in TOOLS])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    runs: list[dict] = []
    with httpx.Client(timeout=600) as client:
        cold = {mode: timed_request(client, url, request_body(mode, system_prompt, 0, max_tokens), headers)
                for mode in modes}
        for repeat in range(repeats):
            k = repeat % len(modes)
            for mode in modes[k:] + modes[:k]:
                run = timed_request(client, url, request_body(mode, system_prompt, 1 + repeat, max_tokens), headers)
                runs.append({"mode": mode, "repeat": repeat, **run})
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        decode = [r["decode_tok_s"] for r in mine if r["decode_tok_s"] is not None]
        summary[mode] = {
            "ttft_ms": statistics.median(r["ttft_ms"] for r in mine),
            "decode_tok_s": statistics.median(decode) if decode else None,
            "completion_tokens": statistics.median(r["completion_tokens"] for r in mine),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in mine}),
            "num_with_calls": sum(r["num_calls"] > 0 for r in mine),
            "argument_pieces_per_call": (sum(r["num_argument_pieces"] for r in mine) / n
                                         if (n := sum(r["num_calls"] for r in mine)) else None),
            "cold_ttft_ms": cold[mode]["ttft_ms"],
        }
    return {"modes": modes, "repeats": repeats, "max_tokens": max_tokens, "runs": runs, "summary": summary}


def tools_table(result: dict) -> str:
    free = result["summary"].get("free")
    rows = []
    for mode, s in result["summary"].items():
        vs_free = (s["decode_tok_s"] / free["decode_tok_s"] - 1) if free and free["decode_tok_s"] and \
            s["decode_tok_s"] else None
        rows.append([mode, s["ttft_ms"], s["cold_ttft_ms"], s["decode_tok_s"],
                     None if vs_free is None else f"{100 * vs_free:+.1f}%", s["completion_tokens"],
                     ",".join(map(str, s["prompt_tokens"])), f"{s['num_with_calls']}/{result['repeats']}",
                     s["argument_pieces_per_call"]])
    return format_table(["mode", "TTFT ms (median)", "cold TTFT ms", "decode tok/s (median)", "vs free",
                         "completion tokens", "prompt tokens", "answered with calls", "argument pieces per call"],
                        rows, floatfmt="{:.1f}")


def bench_tools(args, engine_args: dict) -> dict:
    import tempfile

    from pagedllm.bench.cli_throughput import serve_args
    from pagedllm.bench.serving import ServerProcess

    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    server, url = None, args.url
    if url is None:
        engine_args = {**engine_args, "enable_prefix_caching": False}  # TTFT of a full prefill in every mode
        log = tempfile.mkstemp(prefix="pagedllm-bench-tools-", suffix=".log")[1]
        server = ServerProcess([*serve_args(engine_args), "--enable-auto-tool-choice", "--tool-call-parser",
                                "hermes"], log)
        url = server.url
    try:
        result = run_tools(url, modes, args.repeats, args.max_tokens, args.api_key)
    finally:
        if server is not None:
            server.stop()
    result["engine_args"] = engine_args if args.url is None else None
    write_result(Path(args.out), "tools", result)
    table = tools_table(result)
    (Path(args.out) / "tools.md").write_text(table + "\n")
    print(table)
    return result
