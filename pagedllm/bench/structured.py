"""`pagedllm bench structured`: what a JSON schema costs a batch, and what compiling one costs.

    pagedllm bench structured --batch-size 32 --max-tokens 64 --repeats 3

The same batch (same prompts, seeds, temperature 1.0; no ignore_eos) runs in three modes, in
turn, in one process; throughput is generated tokens per second of wall time:

  json_schema    each request constrained by a JSON schema, max_tokens as given (they end early,
                 with EOS, when the JSON closes)
  free_matched   unconstrained, each request's max_tokens set to the length its JSON took: the same
                 batch shape step by step, so the difference is what the grammar costs
  free           unconstrained, max_tokens as given (longer outputs: prefill is amortised over more
                 tokens, so this ratio also counts the shorter outputs, not only the grammar)

The slowdown is the median over repeats of 1 - json_schema / free_matched (each pair run back to
back, since a shared machine drifts; the order alternates between repeats, so neither mode always
runs first). Seeded sampling makes the JSON lengths the same in every run. A warm-up pass comes
first, so the grammars are compiled (and cached by the worker) before the timed runs.

Apart from the engine: the mask's own cost per step (fill the bitmask of every row, apply it to
[batch, vocab] logits, accept the tokens), replayed on the JSON outputs; and, per schema, building
the grammar (what the front end validates) and compiling it against the vocabulary (what the
worker does once per schema text).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pagedllm.bench.common import bench_subparser, format_table, timer, write_result
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 16},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]},
        },
        "required": ["name", "age", "address"],
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "minItems": 1, "maxItems": 3},
                       "ok": {"type": "boolean"}},
        "required": ["tags", "ok"],
    },
    "rating": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "score": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["color", "stars", "score"],
    },
}


def add_parser(subparsers) -> None:
    p = bench_subparser(subparsers, "structured", bench_structured,
                        help="a batch with JSON schemas vs the same batch unconstrained; compile times")
    p.add_argument("--batch-size", type=int, default=32, help="requests in the batch (one sequence each)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (alternating)")
    p.add_argument("--compile-repeats", type=int, default=5, help="compilations timed per schema (median)")


def _batch(batch_size: int, max_tokens: int, constrained: bool) -> tuple[list[str], list[SamplingParams]]:
    names = sorted(SCHEMAS)
    prompts, params = [], []
    for i in range(batch_size):
        name = names[i % len(names)]
        prompts.append(f"Write one {name} record as JSON (example {i}):")
        spec = StructuredOutputsParams(json=SCHEMAS[name]) if constrained else None
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=spec))
    return prompts, params


def _run_batch(llm, batch_size: int, max_tokens: int | list[int], constrained: bool, mode: str) -> dict:
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * batch_size
    prompts, params = _batch(batch_size, 1, constrained)
    for p, budget in zip(params, budgets):
        p.max_tokens = budget
    with timer() as elapsed:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    num_tokens = sum(len(c.token_ids) for c in completions)
    finished = [c for c in completions if c.finish_reason == "stop"]
    num_valid = 0
    for c in finished:
        try:
            json.loads(c.text)
            num_valid += 1
        except ValueError:
            pass
    return {"mode": mode, "seconds": elapsed(), "output_tokens": num_tokens, "tok_s": num_tokens / elapsed(),
            "num_stopped": len(finished), "num_valid_json": num_valid,
            "lengths": [len(c.token_ids) for c in completions], "token_ids": [list(c.token_ids) for c in completions]}


def mask_cost(tokenizer, vocab_size: int, token_ids: list[list[int]]) -> dict:
    """Replay the JSON outputs through the worker's matchers: ms per step to fill every row's bitmask,
    apply it to [batch, vocab] float32 logits and accept the sampled tokens."""
    import torch

    from pagedllm.model.sampling.logits_processors import apply_token_bitmask
    from pagedllm.structured.grammar import StructuredOutputManager

    names = sorted(SCHEMAS)
    eos = [tokenizer.eos_token_id]
    manager = StructuredOutputManager(tokenizer, vocab_size, eos, torch.device("cpu"))
    for i in range(len(token_ids)):
        manager.add_sequence(str(i), StructuredOutputsParams(json=SCHEMAS[names[i % len(names)]]), eos)
    logits = torch.zeros(len(token_ids), vocab_size)
    manager.fill_bitmask([(str(i), []) for i in range(len(token_ids))])  # waits for the compiles: not timed
    fill = apply = accept = 0.0
    steps = max(len(t) for t in token_ids)
    for step in range(steps):
        live = [i for i, t in enumerate(token_ids) if step < len(t)]
        t0 = time.perf_counter()
        bitmask, rows = manager.fill_bitmask([(str(i), token_ids[i][:step]) for i in live])
        t1 = time.perf_counter()
        apply_token_bitmask(logits[: len(live)], bitmask, rows)
        t2 = time.perf_counter()
        for i in live:
            manager.accept(str(i), token_ids[i][step])
        t3 = time.perf_counter()
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
    manager.shutdown()
    return {"steps": steps, "fill_ms_per_step": 1e3 * fill / steps, "apply_ms_per_step": 1e3 * apply / steps,
            "accept_ms_per_step": 1e3 * accept / steps}


def compile_times(tokenizer, vocab_size: int, repeats: int) -> dict:
    """Per schema: median ms to build the grammar and to compile it for this vocabulary."""
    import xgrammar as xgr

    from pagedllm.structured.grammar import build_grammar

    with timer() as elapsed:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    tokenizer_ms = elapsed() * 1e3
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    rows = {}
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        build, compile_ = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            grammar = build_grammar(spec)
            t1 = time.perf_counter()
            compiler.compile_grammar(grammar)
            build.append((t1 - t0) * 1e3)
            compile_.append((time.perf_counter() - t1) * 1e3)
        rows[name] = {"build_ms": statistics.median(build), "compile_ms": statistics.median(compile_)}
    return {"tokenizer_info_ms": tokenizer_ms, "schemas": rows}


def bench_structured(args, engine_args: dict) -> dict:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**engine_args)
    batch, max_tokens = args.batch_size, args.max_tokens
    # warm-up: compile the grammars, fault in the buffers; the seeded JSON lengths are those of every run
    lengths = _run_batch(llm, batch, max_tokens, True, "warm-up")["lengths"]
    _run_batch(llm, batch, max_tokens, False, "warm-up")
    runs, ratios = [], []
    for repeat in range(args.repeats):
        order = [("json_schema", max_tokens, True), ("free_matched", lengths, False), ("free", max_tokens, False)]
        done = {mode: _run_batch(llm, batch, budget, constrained, mode)
                for mode, budget, constrained in (order if repeat % 2 == 0 else order[::-1])}
        runs += done.values()
        ratios.append(done["json_schema"]["tok_s"] / done["free_matched"]["tok_s"])
    tok_s = {mode: statistics.median(r["tok_s"] for r in runs if r["mode"] == mode)
             for mode in ("json_schema", "free_matched", "free")}
    vocab_size = llm.engine.hf_config.vocab_size
    result = {
        "engine_args": engine_args, "batch_size": batch, "max_tokens": max_tokens,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
        "tok_s": tok_s, "slowdown": 1.0 - statistics.median(ratios),
        "slowdown_vs_free_same_max_tokens": 1.0 - tok_s["json_schema"] / tok_s["free"],
        "mask": mask_cost(llm.get_tokenizer(), vocab_size,
                          next(r["token_ids"] for r in runs if r["mode"] == "json_schema")),
        "compile": compile_times(llm.get_tokenizer(), vocab_size, args.compile_repeats),
    }
    write_result(Path(args.out), "structured", result)
    print(format_table(["mode", "seconds", "output tokens", "tok/s", "stopped", "valid JSON"],
                       [[r["mode"], r["seconds"], r["output_tokens"], r["tok_s"], r["num_stopped"], r["num_valid_json"]]
                        for r in runs]))
    mask = result["mask"]
    print(f"\nmedian tok/s: json_schema {tok_s['json_schema']:.1f}, free_matched {tok_s['free_matched']:.1f}, "
          f"free {tok_s['free']:.1f}; slowdown vs free_matched (median of pairs) {100 * result['slowdown']:+.1f}%, "
          f"vs free at the same max_tokens {100 * result['slowdown_vs_free_same_max_tokens']:+.1f}%")
    print(f"mask per step at batch {batch}: fill {mask['fill_ms_per_step']:.2f} ms, apply "
          f"{mask['apply_ms_per_step']:.2f} ms, accept {mask['accept_ms_per_step']:.2f} ms\n")
    compile_rows = [[name, v["build_ms"], v["compile_ms"]] for name, v in result["compile"]["schemas"].items()]
    print(format_table(["schema", "grammar build ms", "compile ms"], compile_rows))
    print(f"tokenizer info: {result['compile']['tokenizer_info_ms']:.1f} ms (once per engine)")
    return result
