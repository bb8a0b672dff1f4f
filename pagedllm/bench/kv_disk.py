"""`pagedllm bench kv-disk`: the KV disk tier's time to first token, and a multi-turn trace with the tier on and off.

    pagedllm bench kv-disk --prefix-len 8000 --random-shape llama-3.2-1b

Time to first token of a request whose long prefix was computed before (max_tokens 1, so the time is the
prefill): recomputed (the prefix evicted, no disk tier), read back from disk after the eviction, and read
back after a restart of the engine. Then a multi-turn trace: `--conversations` chats sharing the long prefix
take turns (`--turns` in all), each turn its chat so far plus a new user message, in a KV cache that holds a
few chats at most, with the tier on and off: wall time and the prompt tokens computed (the rest were served
from memory or disk).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, write_result


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "kv-disk", bench_kv_disk, engine=False,
                        help="the KV disk tier: time to first token after eviction and restart; a multi-turn trace")
    p.add_argument("--model", default=None, help="a model directory or .gguf (default: the embedded model)")
    p.add_argument("--random-shape", default=None, help="instead of --model: a random GGUF of this shape (Q4_0)")
    p.add_argument("--prefix-len", type=int, default=4000)
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--turn-tokens", type=int, default=64, help="tokens of each new user message and each answer")
    p.add_argument("--disk-dir", default=None, help="the tier's folder (default: a temporary one)")


def _ttft(llm, prompt: list[int]) -> float:
    from pagedllm import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def _engine(model: str, num_blocks: int, max_len: int, disk: str | None):
    from pagedllm import LLM

    extra = {"kv_disk_cache": disk} if disk else {}
    return LLM(model, num_kv_blocks=num_blocks, max_model_len=max_len, **extra)


def bench_kv_disk(args, engine_args: dict) -> dict:
    model = args.model
    if args.random_shape:
        from pagedllm.bench.random_gguf import write_random_gguf
        from pagedllm.model.loader import cache_root

        path = cache_root() / "random-gguf" / f"{args.random_shape}-Q4_0.gguf"
        if not path.exists():
            write_random_gguf(path, args.random_shape, "Q4_0")
        model = str(path)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    prefix, block = tokens(args.prefix_len), 16
    max_len = args.prefix_len + (args.turns // args.conversations + 2) * 2 * args.turn_tokens + 64
    # room for the prefix and one more chat's worth, so a filler of the same size evicts the prefix
    num_blocks = 2 * (args.prefix_len // block) + 8
    disk = args.disk_dir or tempfile.mkdtemp(prefix="pagedllm-kv-disk-")
    result: dict = {"model": model or "embedded", "prefix_len": args.prefix_len, "num_kv_blocks": num_blocks,
                    "disk_dir": disk}

    def evict(llm):  # two prompts as long as the prefix push it out of memory
        for _ in range(2):
            _ttft(llm, tokens(args.prefix_len))

    off = _engine(model, num_blocks, max_len, None)
    _ttft(off, tokens(32))
    _ttft(off, prefix + tokens(8))
    evict(off)
    result["ttft_recompute_s"] = _ttft(off, prefix + tokens(8))
    del off
    on = _engine(model, num_blocks, max_len, disk)
    _ttft(on, prefix + tokens(8))
    evict(on)
    result["ttft_disk_after_eviction_s"] = _ttft(on, prefix + tokens(8))
    on.engine.core.shutdown()
    del on
    restarted = _engine(model, num_blocks, max_len, disk)
    _ttft(restarted, tokens(32))
    result["ttft_disk_after_restart_s"] = _ttft(restarted, prefix + tokens(8))
    del restarted
    for name in ("disk_after_eviction", "disk_after_restart"):
        result[f"speedup_{name}"] = result["ttft_recompute_s"] / result[f"ttft_{name}_s"]
    result["trace"] = {mode: _trace(model, num_blocks, max_len, prefix, args, tokens,
                                    tempfile.mkdtemp(prefix="pagedllm-kv-trace-") if mode == "on" else None)
                       for mode in ("off", "on")}
    write_result(Path(args.out), "kv-disk", result)
    print(format_result(result))
    return result


def _trace(model, num_blocks, max_len, prefix, args, tokens, disk) -> dict:
    from pagedllm import SamplingParams

    llm = _engine(model, num_blocks, max_len, disk)
    chats = [prefix + tokens(args.turn_tokens) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.turn_tokens, ignore_eos=True)
    prompt_tokens = 0
    start = time.perf_counter()
    for turn in range(args.turns):
        c = turn % args.conversations
        out = llm.generate([{"prompt_token_ids": chats[c]}], params, use_tqdm=False)[0]
        prompt_tokens += len(chats[c])
        chats[c] = chats[c] + list(out.outputs[0].token_ids) + tokens(args.turn_tokens)
    wall = time.perf_counter() - start
    stats = llm.engine.core.stats()
    return {"wall_s": wall, "prompt_tokens": prompt_tokens,
            "prompt_tokens_computed": prompt_tokens - stats.prefix_cache_hits,
            "disk_hit_tokens": stats.kv_disk_hit_tokens}


def format_result(r: dict) -> str:
    lines = [f"prefix {r['prefix_len']} tokens, {r['num_kv_blocks']} KV blocks, model {r['model']}",
             f"time to first token: recomputed {r['ttft_recompute_s']:.2f} s, from disk after eviction "
             f"{r['ttft_disk_after_eviction_s']:.2f} s ({r['speedup_disk_after_eviction']:.1f}x), after a restart "
             f"{r['ttft_disk_after_restart_s']:.2f} s ({r['speedup_disk_after_restart']:.1f}x)"]
    for mode, t in r["trace"].items():
        lines.append(f"trace, tier {mode}: {t['wall_s']:.1f} s, {t['prompt_tokens_computed']} of {t['prompt_tokens']} "
                     f"prompt tokens computed ({t['disk_hit_tokens']} from disk)")
    return "\n".join(lines)
