"""`pagedllm bench embed-mixed`: does a generation load slow down by more than the embedding requests' share of
the tokens when those requests share its engine?

    pagedllm bench embed-mixed --rounds 2                 (the default model, served with --runner both)

One `pagedllm serve --runner both` in a subprocess, over HTTP. A round runs the same generation load (all its
streaming completions at once, greedy, a fixed number of tokens each) twice: alone, then with embedding
requests (lists of token-id inputs to /v1/embeddings) arriving evenly over the time the load took alone.
Alone and mixed alternate, so the machine's other load hits both alike. The figure is the generation's
wall time mixed / alone, beside the bound 1 / (1 - share), where share is the embedding inputs' tokens over
all tokens the server processed (generation prompts, generated tokens, embedding inputs): below the bound,
the embeddings took less than their share of the engine's time from generation.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, write_result


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "embed-mixed", bench_embed_mixed, engine=False,
                        help="a generation load's slowdown from embedding requests sharing its engine (runner both)")
    p.add_argument("--model", default=None, help="a decoder with its LM head (default: pagedllm's default model)")
    p.add_argument("--num-generations", type=int, default=8, help="streaming completions in the generation load")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens in each completion's prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens each completion generates")
    p.add_argument("--num-embed-requests", type=int, default=8, help="/v1/embeddings requests in a mixed run")
    p.add_argument("--embed-inputs", type=int, default=4, help="inputs in each embedding request")
    p.add_argument("--embed-len", type=int, default=128, help="tokens in each embedding input")
    p.add_argument("--rounds", type=int, default=2, help="alone/mixed pairs, alternating")
    p.add_argument("--threads", type=int, default=None, help="the server's --num-threads")
    p.add_argument("--seed", type=int, default=0)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 10000) for _ in range(n)]  # ordinary tokens of any vocabulary over 10k


async def _embed(client, url: str, inputs: list[list[int]], delay: float) -> int:
    await asyncio.sleep(delay)
    response = await client.post(f"{url}/v1/embeddings", json={"input": inputs, "encoding_format": "base64"})
    if response.status_code != 200:
        raise SystemExit(f"/v1/embeddings answered {response.status_code}: {response.text[:300]}")
    return response.json()["usage"]["prompt_tokens"]


async def _round(url: str, generations: list, embeds: list[list[list[int]]], spread_s: float) -> tuple[float, int, int]:
    """(seconds until the last completion finished, generated tokens, embedded tokens) of one run."""
    import httpx

    from pagedllm.bench.serving import _send

    limits = httpx.Limits(max_connections=len(generations) + len(embeds) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        start = time.perf_counter()

        async def generate(request):
            record = await _send(client, url, None, request)
            if not record.ok:
                raise SystemExit(f"a completion failed: {record.error}")
            return time.perf_counter() - start, record.output_tokens

        gaps = [spread_s * i / max(len(embeds), 1) for i in range(len(embeds))]
        results = await asyncio.gather(*(generate(r) for r in generations),
                                       *(_embed(client, url, e, d) for e, d in zip(embeds, gaps)))
    done = results[:len(generations)]
    return max(t for t, _ in done), sum(n for _, n in done), sum(results[len(generations):])


def bench_embed_mixed(args, engine_args: dict) -> dict:
    from pagedllm.bench.serving import ServerProcess
    from pagedllm.bench.workloads import BenchRequest

    rng = random.Random(args.seed)
    generations = [BenchRequest(_ids(rng, args.prompt_len), args.output_len) for _ in range(args.num_generations)]
    embeds = [[_ids(rng, args.embed_len) for _ in range(args.embed_inputs)] for _ in range(args.num_embed_requests)]
    serve = ["--runner", "both", *(["--model", args.model] if args.model else []),
             *(["--num-threads", str(args.threads)] if args.threads else [])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(serve, str(out / "embed-mixed-server.log"))
    alone, mixed = [], []
    try:
        url = server.url
        asyncio.run(_round(url, generations[:2], embeds[:1], 0.0))  # warm-up: both kinds once
        for _ in range(args.rounds):
            seconds, generated, _ = asyncio.run(_round(url, generations, [], 0.0))
            alone.append(seconds)
            seconds, generated_mixed, embedded = asyncio.run(_round(url, generations, embeds, 0.8 * seconds))
            mixed.append(seconds)
    finally:
        server.stop()
    generation_tokens = args.num_generations * args.prompt_len + generated
    share = embedded / (embedded + generation_tokens)
    slowdowns = [m / a for a, m in zip(alone, mixed)]
    result = {"serve_args": serve, "generation": {"requests": args.num_generations, "prompt_len": args.prompt_len,
                                                  "output_len": args.output_len, "tokens": generation_tokens},
              "embedding": {"requests": args.num_embed_requests, "inputs_each": args.embed_inputs,
                            "input_len": args.embed_len, "tokens": embedded},
              "alone_s": alone, "mixed_s": mixed, "slowdown": slowdowns,
              "slowdown_median": statistics.median(slowdowns), "token_share": share, "bound": 1 / (1 - share),
              "within_share": statistics.median(slowdowns) <= 1 / (1 - share)}
    assert generated_mixed == generated, "the mixed run generated another number of tokens"
    write_result(out, "embed-mixed", result)
    print(format_table(["round", "generation alone s", "with embeddings s", "slowdown", "bound 1/(1-share)"],
                       [[i + 1, a, m, f"{m / a:.2f}x", f"{result['bound']:.2f}x"]
                        for i, (a, m) in enumerate(zip(alone, mixed))], floatfmt="{:.2f}"))
    print(f"embedding tokens {embedded} of {embedded + generation_tokens} ({share:.0%}); "
          f"median slowdown {result['slowdown_median']:.2f}x, within the share: {result['within_share']}")
    return result
