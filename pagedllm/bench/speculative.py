"""`pagedllm bench speculative`: speculative decoding (n-gram, a draft model) against the same engine without it.

Two workloads, each at every batch size (max_num_seqs = B, B requests in flight):

    copy       chat prompts to the default model whose answers repeat spans of the prompt ("repeat
               this text", "fix the typos in", "quote the sentence"), greedy, EOS honoured (the
               outputs are token-for-token the same with and without speculation, so both runs
               produce the same tokens)
    alpaca     the Alpaca-like synthetic trace (bench/workloads.py), greedy, ignore_eos

Per (workload, batch size, proposer): wall seconds, output tokens/s, time per output token
(TPOT = B x wall / output tokens: the time one of the B concurrent sequences waits per token), the
speed-up over no speculation, and the acceptance rate (kept / proposed), overall and per position.
The engines run side by side in one process, each warmed up first; the runs alternate
(off, ngram, draft_model, off, ...) over `--repeats` and the best wall time of each counts.

`--methods ngram,draft_model` adds the draft-model proposer. Its draft is `--draft-model`, else a
cut of the target: its first `--draft-layers` layers with the final norm and the (tied) head
(model/truncate.py; no smaller SmolLM2 is available offline). Such a cut is a weak draft: on the
default model 4 layers agree with the full model's greedy token about 1 time in 12, 24 layers 1 in 3.
"""

from __future__ import annotations

import time

from pagedllm.bench.common import bench_subparser, format_table
from pagedllm.bench.engine_utils import engine_prompts, request_params
from pagedllm.bench.workloads import WorkloadSpec, make_workload

PASSAGES = [
    "Paged attention stores the key-value cache in fixed-size blocks, so memory is allocated on demand, "
    "fragmentation stays below one block per sequence, and parallel samples share their prompt's blocks.",
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
    "members agreed to fund the reading room, the children's corner and a small cafe near the entrance.",
    "To reset the router, unplug it for thirty seconds, plug it back in, wait until the status light turns "
    "green, and then connect to the network named in the label on the bottom of the device.",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs light, water is split "
    "into oxygen and hydrogen, and carbon dioxide is fixed into sugars in the Calvin cycle.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Dear Ms. Carter, thank you for your order of twelve blue notebooks and three packs of pens. Your parcel "
    "left our warehouse this morning and should arrive within three working days.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Fix any typos in the following text and return the whole corrected text:\n\n{}",
    "Rewrite the following text, changing nothing but making every sentence start on a new line:\n\n{}",
]


def copy_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    """Chat prompts whose answers copy spans of the prompt."""
    prompts = []
    for i in range(num_requests):
        text = TASKS[i % len(TASKS)].format(PASSAGES[i % len(PASSAGES)])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return prompts


def _workload(name: str, llm, num_requests: int, output_len: int, length_scale: float, max_model_len: int):
    """(prompts for LLM.generate, sampling params per request)."""
    from pagedllm.sampling_params import SamplingParams

    if name == "copy":
        prompts = copy_prompts(llm.get_tokenizer(), num_requests)
        params = [SamplingParams(temperature=0, max_tokens=output_len) for _ in prompts]
        return [{"prompt_token_ids": p} for p in prompts], params
    requests = make_workload(WorkloadSpec(name="alpaca", num_requests=num_requests, max_model_len=max_model_len,
                                          length_scale=length_scale))
    return engine_prompts(requests), [request_params(r) for r in requests]


def _timed_run(llm, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def _acceptance(before, after) -> tuple[int, int, list[float | None]]:
    """(proposed, accepted, acceptance per position) between two stats snapshots of one engine."""
    k = len(after.spec_accepted_per_position)
    per_position = [
        round((a1 - a0) / (p1 - p0), 3) if p1 > p0 else None
        for a0, a1, p0, p1 in zip(before.spec_accepted_per_position or [0] * k, after.spec_accepted_per_position,
                                  before.spec_proposed_per_position or [0] * k, after.spec_proposed_per_position)]
    return (after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            after.spec_num_accepted_tokens - before.spec_num_accepted_tokens, per_position)


def run_speculative(engine_args: dict, workloads: list[str], batch_sizes: list[int], num_requests: int,
                    output_len: int, speculative_configs: dict[str, dict], repeats: int = 1,
                    length_scale: float = 1.0) -> dict:
    """Every (workload, batch size): the engine without speculation and with each config of
    `speculative_configs` (label -> speculative_config), side by side."""
    from pagedllm.entrypoints.llm import LLM

    engine_args = {k: v for k, v in engine_args.items() if k != "speculative_config"}
    rows = []
    for batch_size in batch_sizes:
        engines = {"off": LLM(**{**engine_args, "max_num_seqs": batch_size})}
        for label, config in speculative_configs.items():
            engines[label] = LLM(**{**engine_args, "max_num_seqs": batch_size}, speculative_config=config)
        for llm in engines.values():  # warm-up: first-call costs are not the proposer's
            llm.generate([{"prompt_token_ids": [1, 2, 3, 1, 2, 3]}], request_params_warmup(), use_tqdm=False)
        plain = engines["off"]
        max_model_len = plain.engine.core.scheduler_config.max_model_len
        for name in workloads:
            n = max(num_requests, batch_size) if name == "copy" else max(num_requests, 2 * batch_size)
            prompts, params = _workload(name, plain, n, output_len, length_scale, max_model_len)
            best = {label: float("inf") for label in engines}
            outputs = {}
            before = {label: llm.engine.stats() for label, llm in engines.items()}
            for _ in range(repeats):
                for label, llm in engines.items():
                    elapsed, outputs[label] = _timed_run(llm, prompts, params)
                    best[label] = min(best[label], elapsed)
            for label in speculative_configs:
                if outputs["off"] != outputs[label]:
                    raise AssertionError(f"{name} at batch {batch_size}: greedy outputs differ with {label}")
            num_out = sum(len(t) for t in outputs["off"])
            for label, llm in engines.items():
                row = dict(workload=name, batch_size=batch_size, proposer=label, num_requests=n,
                           output_tokens=num_out, seconds=best[label], tokens_per_s=num_out / best[label],
                           tpot_ms=1000 * batch_size * best[label] / num_out, speedup=best["off"] / best[label],
                           acceptance_rate=None, proposed_tokens=None, acceptance_per_position=None)
                if label != "off":
                    proposed, accepted, per_position = _acceptance(before[label], llm.engine.stats())
                    row.update(acceptance_rate=accepted / proposed if proposed else 0.0, proposed_tokens=proposed,
                               acceptance_per_position=per_position)
                rows.append(row)
        del plain, engines
    return {"speculative_configs": speculative_configs, "repeats": repeats, "rows": rows}


def request_params_warmup():
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def format_speculative(result: dict) -> str:
    headers = ["workload", "batch", "proposer", "tok/s", "TPOT ms", "speed-up", "accept", "accept by position"]
    rows = [[r["workload"], r["batch_size"], r["proposer"], r["tokens_per_s"], r["tpot_ms"], r["speedup"],
             r["acceptance_rate"], ", ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_per_position"] or [])]
            for r in result["rows"]]
    return format_table(headers, rows)


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "speculative", bench_speculative,
                        help="speculative decoding (n-gram, draft model) vs none: copy-heavy and "
                             "Alpaca-like, per batch")
    p.add_argument("--workloads", default="copy,alpaca", help="copy (prompts whose answers repeat them), alpaca")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--num-requests", type=int, default=16, help="requests per run (at least the batch size)")
    p.add_argument("--spec-output-len", type=int, default=160, help="copy: max_tokens of each answer")
    p.add_argument("--length-scale", type=float, default=1.0, help="alpaca: multiply the trace's lengths")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="alternating timed runs per engine; the best counts")
    p.add_argument("--methods", default="ngram", help="proposers to compare with none: ngram, draft_model")
    p.add_argument("--draft-model", default=None,
                   help="draft_model: the draft's directory (default: the target's first --draft-layers layers)")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the target kept in the default draft")


def bench_speculative(args, engine_args: dict) -> dict:
    from pagedllm.bench.common import write_result

    import tempfile

    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - {"ngram", "draft_model"})
    if unknown:
        raise ValueError(f"unknown --methods {unknown}; known: ngram, draft_model")
    configs = {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-draft-") as scratch:
        for method in methods:
            config = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
            if method == "ngram":
                config.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
            else:
                config["model"] = args.draft_model or cut_draft(engine_args.get("model"), args.draft_layers, scratch)
            configs[method] = config
        result = run_speculative(engine_args, [w for w in args.workloads.split(",") if w],
                                 [int(b) for b in args.batch_sizes.split(",") if b], args.num_requests,
                                 args.spec_output_len, configs, repeats=args.repeats, length_scale=args.length_scale)
    if "draft_model" in configs and args.draft_model is None:
        result["draft_layers"] = args.draft_layers
    print(format_speculative(result))
    write_result(args.out, "speculative", result)
    return result


def cut_draft(model: str | None, num_layers: int, directory: str) -> str:
    """A draft model made of the target's first `num_layers` layers, written under `directory`."""
    from pagedllm.model.loader import resolve_hf_dir
    from pagedllm.model.truncate import write_truncated_model

    return str(write_truncated_model(resolve_hf_dir(model), f"{directory}/draft-{num_layers}-layers", num_layers))
