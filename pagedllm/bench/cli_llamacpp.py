"""`pagedllm bench llamacpp`: pagedllm's server beside llama.cpp's server on the same GGUF file.

    scripts/build_llama_server.sh                       (once: builds and caches llama-server)
    pagedllm bench llamacpp --rounds 5 --concurrency 64                       (the embedded SmolLM2 Q4_1)
    pagedllm bench llamacpp --random-shape llama-3.2-1b --random-qtype Q4_0   (a random 1 B GGUF, see random_gguf.py)

Both servers are started here as processes (`pagedllm serve`, `llama-server`) with the same thread
count and talked to with the same client (bench/llamacpp.py says what is measured and how). Also
measured, in this process and before the servers start: torch's float32 time for one pass of the
model's weight matmuls at batch 1 (every 2-D weight of the file, the LM head once, as float32 with
the file's shapes) -- the step time a float32 engine cannot go below, so 1 / that time is a bound on
its single-user tok/s that the report divides pagedllm's rate by.

KV caches are sized for every request at once: `--concurrency x (prompt + output + 16)` tokens, in
float32 for pagedllm (its default) and f16 for llama.cpp (its default); the table gives both sizes.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import statistics
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, machine_info, write_result

SLACK_TOKENS = 16  # a KV block of slack per request


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "llamacpp", bench_llamacpp, engine=False,
                        help="pagedllm's server vs llama.cpp's server on one GGUF: single user, N at once, memory")
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--random-shape", default=None,
                   help="instead of --model: write (once, cached) a random-weight GGUF of this shape "
                        "(llama-3.2-1b, smollm2-135m, tiny)")
    p.add_argument("--random-qtype", default="Q4_0", choices=("Q4_0", "Q8_0"))
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each server")
    p.add_argument("--rounds", type=int, default=5, help="alternating single-user rounds")
    p.add_argument("--concurrency", type=int, default=64, help="requests sent at once (0: skip)")
    p.add_argument("--concurrent-rounds", type=int, default=1, help="alternating rounds of the concurrent batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--llama-server", default=None, help="the llama-server binary (default: the cached build)")
    p.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="pagedllm's KV cache dtype (llama.cpp keeps its f16 default)")
    p.add_argument("--pagedllm-args", default="", help="extra `pagedllm serve` flags, one shell-quoted string")
    p.add_argument("--llama-args", default="", help="extra llama-server flags, one shell-quoted string")
    p.add_argument("--no-matmul-bound", dest="matmul_bound", action="store_false",
                   help="skip timing torch's float32 matmuls (they need the model's size in float32)")


def gguf_shapes(path: str | Path) -> dict:
    """From the file's header: each 2-D weight's (out, in) shape by name, and the KV size per token."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()

    def field(key: str):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    hidden, heads = field("embedding_length"), field("attention.head_count")
    head_dim = field("attention.key_length") or hidden // heads
    kv_heads = field("attention.head_count_kv") or heads
    weights = {t.name: (int(t.shape[1]), int(t.shape[0])) for t in reader.tensors if len(t.shape) == 2}
    if "output.weight" not in weights:  # tied: the LM head is the embedding
        weights["output.weight"] = weights["token_embd.weight"]
    weights.pop("token_embd.weight")  # a lookup, not a matmul
    layers = field("block_count")
    return {"weights": weights, "layers": layers, "vocab_size": weights["output.weight"][0],
            "kv_elements_per_token": layers * 2 * kv_heads * head_dim}


def float32_matmul_step_s(weights: dict[str, tuple[int, int]], layers: int, threads: int,
                          budget_bytes: int = 1536 * 2**20) -> dict:
    """Seconds of one batch-1 pass of F.linear over every weight in float32 (best of several). A model
    over ``budget_bytes`` in float32 is timed on enough distinct layers to exceed 1 GiB (never
    cache-resident) and scaled to all its layers."""
    import torch

    from pagedllm.bench.roofline import matmuls_alone

    torch.set_num_threads(threads)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    rest = []
    for name, shape in weights.items():
        if name.startswith("blk."):
            by_layer.setdefault(int(name.split(".")[1]), []).append(shape)
        else:
            rest.append(shape)
    layer_bytes = 4 * sum(o * i for o, i in by_layer[0])
    total = layer_bytes * layers + 4 * sum(o * i for o, i in rest)
    timed_layers = layers if total <= budget_bytes else min(layers, -(-2**30 // layer_bytes))
    layer_weights = [torch.randn(o, i) for n in range(timed_layers) for o, i in by_layer[n]]
    layers_s = matmuls_alone(layer_weights, 1, repeats=5) * layers / timed_layers
    del layer_weights
    rest_weights = [torch.randn(o, i) for o, i in rest]
    rest_s = matmuls_alone(rest_weights, 1, repeats=5)
    del rest_weights
    step = layers_s + rest_s
    return {"step_s": step, "bound_tok_s": 1 / step, "timed_layers": timed_layers, "layers": layers,
            "float32_mib": total / 2**20}


def resolve_model(args) -> str:
    from pagedllm.model.loader import cache_root, default_gguf_path

    if args.random_shape:
        if args.model:
            raise SystemExit("--model and --random-shape: pass one")
        from pagedllm.bench.random_gguf import write_random_gguf

        path = cache_root() / "random-gguf" / f"{args.random_shape}-{args.random_qtype}.gguf"
        if not path.exists():
            print(f"writing {path} (random weights, once)")
            write_random_gguf(path, args.random_shape, args.random_qtype)
        return str(path)
    return str(Path(args.model).expanduser()) if args.model else str(default_gguf_path())


def _median_best(rounds: list[dict]) -> tuple[float, float]:
    rates = [r["output_tok_s"] for r in rounds]
    return statistics.median(rates), max(rates)


def bench_llamacpp(args, engine_args: dict) -> dict:
    from pagedllm.bench.llamacpp import (
        alternate, llama_server_binary, missing_binary_message, random_prompts, start_llama_server, start_pagedllm)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    binary = Path(args.llama_server) if args.llama_server else llama_server_binary()
    if not binary.is_file():
        raise SystemExit(missing_binary_message(binary))
    model = resolve_model(args)
    shapes = gguf_shapes(model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    result = {"model": model, "file_mib": Path(model).stat().st_size / 2**20, "threads": args.threads,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "rounds": args.rounds,
              "concurrency": args.concurrency, "concurrent_rounds": args.concurrent_rounds,
              "llama_server": str(binary), "machine_at_start": machine_info()}
    if args.matmul_bound:
        result["float32_matmuls"] = float32_matmul_step_s(shapes["weights"], shapes["layers"], args.threads)
        print(f"torch float32 matmuls at batch 1: {1e3 * result['float32_matmuls']['step_s']:.1f} ms a step")

    slots = max(args.concurrency, 1)
    kv_tokens = slots * (args.prompt_len + args.output_len + SLACK_TOKENS)
    kv_dtype_bytes = 4 if args.kv_cache_dtype == "float32" else 2
    result["pagedllm_kv_mib"] = kv_tokens * shapes["kv_elements_per_token"] * kv_dtype_bytes / 2**20
    result["llama_kv_mib"] = kv_tokens * shapes["kv_elements_per_token"] * 2 / 2**20
    servers = []
    try:
        servers.append(start_pagedllm(model, args.threads, int(result["pagedllm_kv_mib"] * 2**20), out,
                                      ["--kv-cache-dtype", args.kv_cache_dtype, "--max-model-len",
                                       str(args.prompt_len + args.output_len + SLACK_TOKENS),
                                       *shlex.split(args.pagedllm_args)]))
        servers.append(start_llama_server(binary, model, args.threads, kv_tokens, slots, out,
                                          shlex.split(args.llama_args)))
        vocab = shapes["vocab_size"]
        result["memory_after_load"] = {s.name: s.memory() for s in servers}

        def progress(name, r, res):
            if args.progress:
                print(f"  {name:9s} round {r}: {res['output_tok_s']:.1f} output tok/s ({res['wall_s']:.1f} s)",
                      flush=True)

        # Warm-up: one short request each (first-call costs are not what either server is like).
        alternate(servers, 1, lambda r: random_prompts(1, args.prompt_len, vocab, seed=10**6), 8)
        print(f"single user: {args.rounds} alternating rounds, {args.prompt_len}-token prompt, "
              f"{args.output_len} output tokens")
        result["single"] = alternate(servers, args.rounds,
                                     lambda r: random_prompts(1, args.prompt_len, vocab, seed=r),
                                     args.output_len, progress)
        write_result(out, "llamacpp-partial", result)  # the concurrent phase can take long on a busy machine
        if args.concurrency > 0:
            print(f"{args.concurrency} at once: {args.concurrent_rounds} alternating rounds")
            result["concurrent"] = alternate(
                servers, args.concurrent_rounds,
                lambda r: random_prompts(args.concurrency, args.prompt_len, vocab, seed=1000 + r),
                args.output_len, progress)
        result["memory"] = {s.name: s.memory() for s in servers}
    finally:
        for s in servers:
            s.stop()
    result["load_avg_1m"] = [load_before, os.getloadavg()[0]]
    write_result(out, "llamacpp", result)
    table = llamacpp_table(result)
    (out / "llamacpp.md").write_text(table + "\n")
    print(table)
    return result


def llamacpp_table(result: dict) -> str:
    """The markdown docs/benchmarks.md shows: one row per measure, the two servers and their ratio."""
    names = ("pagedllm", "llama.cpp")
    rows = []

    def row(label, values, ratio=True, fmt="{:.1f}"):
        a, b = values
        rows.append([label, fmt.format(a), fmt.format(b), f"{a / b:.2f}x" if ratio and b else ""])

    single = [_median_best(result["single"][n]) for n in names]
    row(f"single user, output tok/s (median of {result['rounds']} rounds)", [s[0] for s in single])
    row("single user, output tok/s (best round)", [s[1] for s in single])
    if "concurrent" in result:
        conc = [_median_best(result["concurrent"][n]) for n in names]
        row(f"{result['concurrency']} at once, output tok/s (median of {result['concurrent_rounds']})",
            [c[0] for c in conc])
    mem = result["memory"]
    row("peak resident MiB, all processes", [mem[n]["peak_mib_total"] for n in names], fmt="{:.0f}")
    row("peak resident MiB, largest process (pagedllm: its engine core)",
        [mem[n]["peak_mib_largest"] for n in names], fmt="{:.0f}")
    row("KV cache MiB (allocated)", [result["pagedllm_kv_mib"], result["llama_kv_mib"]], fmt="{:.0f}")
    lines = [format_table(["", *names, "pagedllm / llama.cpp"], rows)]
    file_mib = result["file_mib"]
    engine_peak = mem["pagedllm"]["peak_mib_largest"]
    lines.append("")
    lines.append(f"File {file_mib:.0f} MiB, {result['threads']} threads each, prompt {result['prompt_len']} tokens, "
                 f"output {result['output_len']} tokens. pagedllm's engine process peak / (file + its KV cache): "
                 f"{engine_peak / (file_mib + result['pagedllm_kv_mib']):.2f}x; all its processes: "
                 f"{mem['pagedllm']['peak_mib_total'] / (file_mib + result['pagedllm_kv_mib']):.2f}x.")
    if "float32_matmuls" in result:
        mm = result["float32_matmuls"]
        lines.append(f"torch float32 weight matmuls at batch 1: {1e3 * mm['step_s']:.1f} ms a step, a bound of "
                     f"{mm['bound_tok_s']:.1f} tok/s; pagedllm single user (median) / that bound: "
                     f"{single[0][0] / mm['bound_tok_s']:.2f}x.")
    load = result.get("load_avg_1m")
    if load:
        lines.append(f"Machine load (1-minute average) {load[0]:.1f} at the start, {load[1]:.1f} at the end "
                     f"({result['machine_at_start']['num_cpus']} CPUs).")
    return "\n".join(lines)


if __name__ == "__main__":  # re-render a result file: python -m pagedllm.bench.cli_llamacpp OUT/llamacpp.json
    import sys

    print(llamacpp_table(json.loads(Path(sys.argv[1]).read_text())))
