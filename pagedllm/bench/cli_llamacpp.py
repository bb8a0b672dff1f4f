"""`pagedllm bench llamacpp`: pagedllm's server beside llama.cpp's server on the same GGUF file.

    scripts/build_llama_server.sh                       (once: builds and caches llama-server)
    pagedllm bench llamacpp --rounds 5 --concurrency 64                       (the embedded SmolLM2 Q4_1)
    pagedllm bench llamacpp --random-shape llama-3.2-1b --random-qtype Q4_0   (a random 1 B GGUF, see random_gguf.py)

Both servers are started here as processes (`pagedllm serve` at its defaults, `llama-server`) with the
same thread count and talked to with the same client (bench/llamacpp.py says what is measured and how).
llama-server runs at its best settings for each case, one configuration at a time:

    one user, time to first token   `--parallel 1` (one slot: many slots make one user much slower)
    N at once                       `--parallel N` over a unified KV cache (a slot per request)

pagedllm's one server serves every phase. The servers run side by side, rounds alternating between them, unless
the file would not fit in memory twice (twice its size over 90% of the memory available at the start) or
`--one-at-a-time` asks: then each server runs its phases alone and is stopped before the next starts (pagedllm;
llama-server --parallel 1; llama-server --parallel N), and a slow spell of the machine is no longer shared. Also measured, in this process and before the servers start:
the machine's memory read bandwidth (`read_bandwidth`: a sum over 1 GiB, best of several, the same
threads) and the bytes of weights a decode step reads (every 2-D weight of the file but the embedding
table, the LM head once), so bandwidth / bytes is the one-user rate no engine can pass on this machine;
and, unless `--no-weights-held`, the bytes pagedllm holds for the weights once loaded at its defaults (in a child
process, so that its memory is the system's again before the servers start).

KV caches are sized for every request at once: `--concurrency x (prompt + output + 16)` tokens, in
float32 for pagedllm (its default) and f16 for llama.cpp (its default); the table gives both sizes.
Random files (`--random-shape`) are written by bench/random_gguf.py, Q4_K_M and Q3_K_M included (their blocks
written directly, each tensor in the type llama.cpp's mix gives it); the other K-quant mixes (`--random-qtype Q5_K_M`,
...) are made as users make them: a random Q8_0 file requantized by llama.cpp's `llama-quantize
--allow-requantize` (built beside llama-server).
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
LLAMA_QUANTIZE_TYPES = ("Q4_K_S", "Q5_K_M", "Q6_K")
"""Random file types made by llama-quantize from a random Q8_0 file (the rest random_gguf.py writes itself)."""
RANDOM_QTYPES = ("Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q4_K_M", "Q3_K_M")


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "llamacpp", bench_llamacpp, engine=False,
                        help="pagedllm's server vs llama.cpp's server on one GGUF: single user, N at once, memory")
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--random-shape", default=None,
                   help="instead of --model: write (once, cached) a random-weight GGUF of this shape "
                        "(llama-3.2-1b, smollm2-135m, qwen3-30b-a3b, tiny, tiny-qwen3moe)")
    p.add_argument("--random-qtype", default="Q4_0", choices=(*RANDOM_QTYPES, *LLAMA_QUANTIZE_TYPES),
                   help="the random file's type; Q4_0, Q8_0, Q5_0, Q5_1, Q4_K_M and Q3_K_M written directly, the other "
                        "K-quant "
                        "mixes "
                        "requantized from Q8_0 by llama-quantize")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="run one server at a time (the default only for a file that would not fit in memory twice)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each server")
    p.add_argument("--rounds", type=int, default=5, help="alternating single-user rounds")
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests sent at once (0: skip); llama-server gets as many slots")
    p.add_argument("--ttft-prompt-len", type=int, default=1024,
                   help="prompt tokens of the time-to-first-token rounds (0: skip)")
    p.add_argument("--concurrent-rounds", type=int, default=1, help="alternating rounds of the concurrent batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--llama-server", default=None, help="the llama-server binary (default: the cached build)")
    p.add_argument("--llama-quantize", default=None,
                   help="llama.cpp's llama-quantize (default: beside the cached llama-server)")
    p.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="pagedllm's KV cache dtype (llama.cpp keeps its f16 default)")
    p.add_argument("--pagedllm-args", default="", help="extra `pagedllm serve` flags, one shell-quoted string")
    p.add_argument("--llama-args", default="", help="extra llama-server flags, one shell-quoted string")
    p.add_argument("--no-matmul-bound", dest="matmul_bound", action="store_false",
                   help="skip timing torch's float32 matmuls (they need the model's size in float32)")
    p.add_argument("--no-weights-held", dest="weights_held", action="store_false",
                   help="skip loading the model here to count the bytes its weights are held in")


def gguf_shapes(path: str | Path) -> dict:
    """From the file's header: each 2-D weight's (out, in) shape by name, the KV size per token, and the bytes of
    weights a decode step reads per token (every weight but the embedding; of stacked experts, the active share)."""
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
    nbytes = {t.name: int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2}
    if "output.weight" not in weights:  # tied: the LM head is the embedding
        weights["output.weight"] = weights["token_embd.weight"]
        nbytes["output.weight"] = nbytes["token_embd.weight"]
    weights.pop("token_embd.weight")  # a lookup, not a matmul
    nbytes.pop("token_embd.weight")
    layers = field("block_count")
    # Stacked experts (3-D): a token reads the experts it is routed to, expert_used_count of expert_count.
    experts, used = field("expert_count") or 0, field("expert_used_count") or 0
    expert_bytes = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 3)
    return {"weights": weights, "layers": layers, "vocab_size": weights["output.weight"][0],
            "kv_elements_per_token": layers * 2 * kv_heads * head_dim,
            "weight_bytes_per_token": sum(nbytes.values()) + (expert_bytes * used // experts if experts else 0)}


def read_bandwidth(threads: int, nbytes: int = 2**30, repeats: int = 7) -> dict:
    """The machine's memory read bandwidth in GB/s: a float32 sum over ``nbytes`` (far past any cache) with
    ``threads`` threads, best of ``repeats``. A sum reads each byte once and computes next to nothing, as a
    batch-1 decode step reads its weights."""
    import time

    import torch

    torch.set_num_threads(threads)
    data = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return {"gb_s": nbytes / best / 1e9, "bytes": nbytes, "threads": threads}


def weights_held_bytes(model: str) -> dict:
    """Bytes pagedllm holds for ``model``'s weights once loaded at its defaults (float parameters and
    quantized panels), beside the file's size."""
    from pagedllm import LLM

    llm = LLM(model, num_kv_blocks=16, max_model_len=64)
    seen: set[int] = set()  # a tied LM head shares the embedding's tensors: count them once
    total = 0
    for module in llm.engine.core.executor.runner.model.modules():
        held = [*module.parameters(recurse=False), getattr(module, "quant_weight", None)]
        for item in held:
            if item is not None and id(item) not in seen:
                seen.add(id(item))
                total += item.nbytes if hasattr(item, "packed") else item.numel() * item.element_size()
        if hasattr(module, "quantized_nbytes"):  # MoE experts
            total += module.quantized_nbytes
    del llm
    return {"bytes": total, "file_bytes": Path(model).stat().st_size}


def _in_child(function, *args):
    """``function(*args)`` in a fresh process: a model loaded to be measured gives its memory back whole when the
    process ends (in this one, freed heap and the engine's threads would stay beside the servers to come)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


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
        from pagedllm.bench.random_gguf import SHAPES, write_random_gguf

        if args.random_shape not in SHAPES:
            raise SystemExit(f"--random-shape {args.random_shape!r}: one of {', '.join(sorted(SHAPES))}")

        root = cache_root() / "random-gguf"
        path = root / f"{args.random_shape}-{args.random_qtype}.gguf"
        if path.exists():
            return str(path)
        if args.random_qtype in LLAMA_QUANTIZE_TYPES:
            source = root / f"{args.random_shape}-Q8_0.gguf"
            if not source.exists():
                print(f"writing {source} (random weights, once)")
                write_random_gguf(source, args.random_shape, "Q8_0")
            requantize(source, path, args.random_qtype, Path(args.llama_quantize) if args.llama_quantize else None)
        else:
            print(f"writing {path} (random weights, once)")
            write_random_gguf(path, args.random_shape, args.random_qtype)
        return str(path)
    return str(Path(args.model).expanduser()) if args.model else str(default_gguf_path())


def requantize(source: Path, target: Path, qtype: str, binary: Path | None = None) -> None:
    """``source`` requantized to ``qtype`` by llama.cpp's llama-quantize (what users run to make K-quant files)."""
    import subprocess

    from pagedllm.bench.llamacpp import llama_server_binary

    binary = binary or llama_server_binary().with_name("llama-quantize")
    if not binary.is_file():
        raise SystemExit(f"llama-quantize is not built: {binary} is missing (scripts/build_llama_server.sh builds it "
                         "beside llama-server), or pass --llama-quantize PATH")
    partial = target.with_name(target.name + ".partial")
    print(f"writing {target} (llama-quantize {qtype} of {source.name}, once)")
    subprocess.run([str(binary), "--allow-requantize", str(source), str(partial), qtype], check=True,
                   stdout=subprocess.DEVNULL)
    partial.replace(target)


def _median_best(rounds: list[dict]) -> tuple[float, float]:
    rates = [r["output_tok_s"] for r in rounds]
    return statistics.median(rates), max(rates)


def _ttft_median(rounds: list[dict]) -> float:
    return statistics.median(r["latency_s_mean"] for r in rounds)


def bench_llamacpp(args, engine_args: dict) -> dict:
    from pagedllm.bench.llamacpp import llama_server_binary, missing_binary_message
    from pagedllm.bench.llamacpp_phases import Phases, fits_twice, one_at_a_time as run_one_at_a_time, side_by_side
    from pagedllm.worker.kv_cache_sizing import available_memory_bytes

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
              "ttft_prompt_len": args.ttft_prompt_len, "llama_server": str(binary),
              "machine_at_start": machine_info(), "weight_bytes_per_token": shapes["weight_bytes_per_token"]}
    result["read_bandwidth"] = read_bandwidth(args.threads)
    print(f"memory read bandwidth: {result['read_bandwidth']['gb_s']:.1f} GB/s ({args.threads} threads)")
    if args.matmul_bound:
        result["float32_matmuls"] = float32_matmul_step_s(shapes["weights"], shapes["layers"], args.threads)
        print(f"torch float32 matmuls at batch 1: {1e3 * result['float32_matmuls']['step_s']:.1f} ms a step")
    if args.weights_held:
        result["weights_held"] = _in_child(weights_held_bytes, model)
        print(f"weights held by pagedllm: {result['weights_held']['bytes'] / 2**20:.0f} MiB "
              f"(file {result['file_mib']:.0f} MiB)")

    slots = max(args.concurrency, 1)
    one_user_tokens = max(args.prompt_len + args.output_len, args.ttft_prompt_len + 8) + SLACK_TOKENS
    kv_tokens = max(slots * (args.prompt_len + args.output_len + SLACK_TOKENS), one_user_tokens)
    kv_dtype_bytes = 4 if args.kv_cache_dtype == "float32" else 2
    result["pagedllm_kv_mib"] = kv_tokens * shapes["kv_elements_per_token"] * kv_dtype_bytes / 2**20
    result["llama_kv_mib"] = kv_tokens * shapes["kv_elements_per_token"] * 2 / 2**20
    vocab = shapes["vocab_size"]
    extra_llama = shlex.split(args.llama_args)

    def progress(name, r, res):
        if args.progress:
            print(f"  {name:9s} round {r}: {res['output_tok_s']:.1f} output tok/s ({res['wall_s']:.1f} s)", flush=True)

    one_at_a_time = args.one_at_a_time or not fits_twice(Path(model).stat().st_size, available_memory_bytes())
    result["one_at_a_time"] = one_at_a_time
    result["llama_slots"] = {"one_user": 1, "at_once": slots}
    pagedllm_args = ["--kv-cache-dtype", args.kv_cache_dtype, "--max-model-len", str(one_user_tokens),
                     *shlex.split(args.pagedllm_args)]
    phases = Phases(args, vocab, progress)
    if one_at_a_time:
        print("one server at a time (the file would not fit in memory twice, or --one-at-a-time)")
        memory = run_one_at_a_time(phases, result, binary, model, one_user_tokens, kv_tokens, slots, out,
                                pagedllm_args, extra_llama)
    else:
        memory = side_by_side(phases, result, binary, model, one_user_tokens, kv_tokens, slots, out,
                               pagedllm_args, extra_llama)
    result["memory"] = memory
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
    if "ttft" in result:
        row(f"time to first token, {result['ttft_prompt_len']}-token prompt, s (median)",
            [_ttft_median(result["ttft"][n]) for n in names], fmt="{:.2f}")
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
    if result.get("one_at_a_time"):
        lines.append("The servers ran one at a time (each stopped before the next started), not side by side.")
    slots = result.get("llama_slots")
    if slots:
        lines.append(f"llama-server ran with --parallel {slots['one_user']} for one user and the time to first "
                     f"token, --parallel {slots['at_once']} for {result['concurrency']} at once.")
    if "weights_held" in result:
        held = result["weights_held"]
        lines.append(f"Weights held by pagedllm: {held['bytes'] / 2**20:.0f} MiB, {held['bytes'] / held['file_bytes']:.2f}x "
                     "the file.")
    if "read_bandwidth" in result and result.get("weight_bytes_per_token"):
        bw = result["read_bandwidth"]["gb_s"]
        bound = bw * 1e9 / result["weight_bytes_per_token"]
        lines.append(f"Memory read bandwidth {bw:.1f} GB/s; {result['weight_bytes_per_token'] / 2**20:.0f} MiB of weights "
                     f"read per token: a one-user bound of {bound:.1f} tok/s; pagedllm reaches {single[0][0] / bound:.2f} "
                     f"of it, llama.cpp {single[1][0] / bound:.2f}.")
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
