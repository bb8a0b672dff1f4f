"""`pagedllm bench agent-apis`: the cost of streaming through the agents' APIs, over HTTP against `pagedllm serve`.

    pagedllm bench agent-apis --rounds 5 --max-tokens 128 --concurrency 4

The same greedy conversation streamed through /v1/chat/completions, /v1/responses and /v1/messages, the APIs
alternating (the order rotates every round, so none always runs first), `--concurrency` identical streams
at once per API (the same load on each). Every request generates exactly --max-tokens tokens (ignore_eos),
so the APIs differ only in how the server frames and sends them.

Per stream: decode tok/s is (output tokens - 1) / (last event - first token event); per API and round, the
aggregate output tok/s is every stream's output tokens over the wall time of the round's batch. The table
gives the medians over rounds and each API's ratio to chat completions.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, write_result

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "agent-apis", bench_agent_apis,
                        help="output tok/s streamed through /v1/responses and /v1/messages vs chat completions")
    p.add_argument("--url", default=None, help="an already running server (skips launching)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", dest="model_name", default=None,
                   help="the model name to send (with --url; default: the server's first)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every API once)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request (ignore_eos)")
    p.add_argument("--concurrency", type=int, default=1, help="identical streams at once per API")


def request_body(api: str, model: str, max_tokens: int) -> dict:
    """The streamed request of one API: the same user message, greedy, exactly max_tokens tokens."""
    message = [{"role": "user", "content": PROMPT}]
    common = {"model": model, "stream": True, "temperature": 0, "ignore_eos": True}
    if api == "chat":
        return {**common, "messages": message, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    if api == "responses":
        return {**common, "input": message, "max_output_tokens": max_tokens, "store": False}
    return {**common, "messages": message, "max_tokens": max_tokens}


def _token_event(api: str, event: dict) -> bool:
    """Whether this event carries generated text."""
    if api == "chat":
        return any(c.get("delta", {}).get("content") for c in event.get("choices") or ())
    if api == "responses":
        return event.get("type") == "response.output_text.delta"
    return event.get("type") == "content_block_delta"


def _output_tokens(api: str, event: dict) -> int | None:
    """The output token count when this event reports it (the usage chunk, response.completed, message_delta)."""
    if api == "chat":
        return (event.get("usage") or {}).get("completion_tokens")
    if api == "responses":
        if event.get("type") in ("response.completed", "response.incomplete"):
            return event["response"]["usage"]["output_tokens"]
        return None
    return event["usage"]["output_tokens"] if event.get("type") == "message_delta" else None


def measure_stream(api: str, timed_lines, start: float) -> dict:
    """Time one stream from its (arrival time, SSE line) pairs; `start` is when the request was sent."""
    first = last = None
    tokens = None
    for at, line in timed_lines:
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("type") in ("error", "response.failed"):
            raise RuntimeError(f"{api}: the stream failed: {line[:500]}")
        if first is None and _token_event(api, event):
            first = at
        count = _output_tokens(api, event)
        tokens = count if count is not None else tokens
        last = at
    if first is None or tokens is None:
        raise RuntimeError(f"{api}: the stream sent no text or no output token count")
    return {"ttft_ms": 1e3 * (first - start), "output_tokens": tokens,
            "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first else None,
            "seconds": last - start}


def timed_stream(client, url: str, api: str, body: dict, headers: dict) -> dict:
    start = time.perf_counter()
    with client.stream("POST", url + PATHS[api], json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{api}: {response.status_code}: {response.read().decode()[:500]}")
        lines = [(time.perf_counter(), line) for line in response.iter_lines()]
    return measure_stream(api, lines, start)


def run_round(client, url: str, api: str, body: dict, headers: dict, concurrency: int) -> dict:
    """`concurrency` identical streams at once; the batch's aggregate output tok/s and each stream's timing."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        streams = list(pool.map(lambda _: timed_stream(client, url, api, body, headers), range(concurrency)))
    wall = time.perf_counter() - start
    return {"api": api, "wall_s": wall, "output_tok_s": sum(s["output_tokens"] for s in streams) / wall,
            "streams": streams}


def summarize(runs: list[dict], apis: list[str]) -> dict:
    """Per API: medians over rounds of aggregate output tok/s, per-stream decode tok/s and TTFT; the ratios of
    the first two to chat completions'."""
    summary = {}
    for api in apis:
        mine = [r for r in runs if r["api"] == api]
        decode = [s["decode_tok_s"] for r in mine for s in r["streams"] if s["decode_tok_s"] is not None]
        summary[api] = {"output_tok_s": statistics.median(r["output_tok_s"] for r in mine),
                        "decode_tok_s": statistics.median(decode) if decode else None,
                        "ttft_ms": statistics.median(s["ttft_ms"] for r in mine for s in r["streams"]),
                        "output_tokens": sorted({s["output_tokens"] for r in mine for s in r["streams"]})}
    chat = summary.get("chat")
    for s in summary.values():
        s["output_vs_chat"] = s["output_tok_s"] / chat["output_tok_s"] if chat else None
        s["decode_vs_chat"] = s["decode_tok_s"] / chat["decode_tok_s"] \
            if chat and chat["decode_tok_s"] and s["decode_tok_s"] else None
    return summary


def agent_apis_table(result: dict) -> str:
    rows = [[api, s["output_tok_s"], None if s["output_vs_chat"] is None else f"{s['output_vs_chat']:.3f}",
             s["decode_tok_s"], None if s["decode_vs_chat"] is None else f"{s['decode_vs_chat']:.3f}", s["ttft_ms"],
             ",".join(map(str, s["output_tokens"]))] for api, s in result["summary"].items()]
    return format_table(["API", "output tok/s (median)", "vs chat", "decode tok/s per stream (median)", "vs chat",
                         "TTFT ms (median)", "output tokens"], rows, floatfmt="{:.1f}")


def run_agent_apis(url: str, model: str, rounds: int, max_tokens: int, concurrency: int,
                   api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    apis = list(APIS)
    runs: list[dict] = []
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=2 * concurrency)) as client:
        for api in apis:  # warm-up: the first request of each route pays for imports and template caches
            run_round(client, url, api, request_body(api, model, max_tokens), headers, 1)
        for i in range(rounds):
            k = i % len(apis)
            for api in apis[k:] + apis[:k]:
                run = run_round(client, url, api, request_body(api, model, max_tokens), headers, concurrency)
                runs.append({"round": i, **run})
    return {"rounds": rounds, "max_tokens": max_tokens, "concurrency": concurrency, "runs": runs,
            "summary": summarize(runs, apis)}


def _served_name(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def bench_agent_apis(args, engine_args: dict) -> dict:
    import tempfile

    from pagedllm.bench.cli_throughput import serve_args
    from pagedllm.bench.serving import ServerProcess

    if args.rounds < 1 or args.max_tokens < 2 or args.concurrency < 1:
        raise SystemExit("--rounds and --concurrency must be at least 1, --max-tokens at least 2")
    server, url = None, args.url
    if url is None:
        log = tempfile.mkstemp(prefix="pagedllm-bench-agent-apis-", suffix=".log")[1]
        server = ServerProcess(serve_args(engine_args), log)
        url = server.url
    try:
        model = args.model_name or _served_name(url, args.api_key)
        result = run_agent_apis(url, model, args.rounds, args.max_tokens, args.concurrency, args.api_key)
    finally:
        if server is not None:
            server.stop()
    result["engine_args"] = engine_args if args.url is None else None
    write_result(Path(args.out), "agent_apis", result)
    table = agent_apis_table(result)
    (Path(args.out) / "agent_apis.md").write_text(table + "\n")
    print(table)
    return result
