"""`pagedllm bench structured`: what a JSON schema costs a batch, and what compiling one costs.

    pagedllm bench structured --batch-size 32 --max-tokens 64 --repeats 3

The same batch (same prompts, seeds, temperature 1.0 and max_tokens; no ignore_eos) runs with
and without a JSON schema per request, alternating, in one process; throughput is generated
tokens per second of wall time, the median of the repeats. A warm-up pass of each comes first, so
the grammars are compiled (and cached by the worker) before the timed runs. Compile time is
measured apart, per schema: building the grammar (what the front end validates) and compiling it
against the vocabulary (what the worker does once per schema text).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pagedllm.bench.common import format_table, timer, write_result
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


def add_structured_parser(bsub, common) -> None:
    p = bsub.add_parser("structured", help="a batch with JSON schemas vs the same batch unconstrained; compile times")
    common(p)
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


def _run_batch(llm, batch_size: int, max_tokens: int, constrained: bool) -> dict:
    prompts, params = _batch(batch_size, max_tokens, constrained)
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
    return {"mode": "json_schema" if constrained else "free", "seconds": elapsed(), "output_tokens": num_tokens,
            "tok_s": num_tokens / elapsed(), "num_stopped": len(finished), "num_valid_json": num_valid}


def compile_times(tokenizer, vocab_size: int, repeats: int) -> dict:
    """Per schema: median ms to build the grammar and to compile it for this vocabulary."""
    import xgrammar as xgr

    from pagedllm.worker.structured_output import build_grammar

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
    for constrained in (False, True):  # warm-up: compile the grammars, fault in the buffers
        _run_batch(llm, batch, max_tokens, constrained)
    runs = []
    for _ in range(args.repeats):
        for constrained in (False, True):
            runs.append(_run_batch(llm, batch, max_tokens, constrained))
    free = statistics.median(r["tok_s"] for r in runs if r["mode"] == "free")
    constrained = statistics.median(r["tok_s"] for r in runs if r["mode"] == "json_schema")
    result = {
        "engine_args": engine_args, "batch_size": batch, "max_tokens": max_tokens, "runs": runs,
        "free_tok_s": free, "json_schema_tok_s": constrained, "slowdown": 1.0 - constrained / free,
        "compile": compile_times(llm.get_tokenizer(), llm.engine.hf_config.vocab_size, args.compile_repeats),
    }
    write_result(Path(args.out), "structured", result)
    print(format_table(["mode", "seconds", "output tokens", "tok/s", "stopped", "valid JSON"],
                       [[r["mode"], r["seconds"], r["output_tokens"], r["tok_s"], r["num_stopped"], r["num_valid_json"]]
                        for r in runs]))
    print(f"\nmedian tok/s: free {free:.1f}, json_schema {constrained:.1f} "
          f"({100 * result['slowdown']:+.1f}% slower)\n")
    compile_rows = [[name, v["build_ms"], v["compile_ms"]] for name, v in result["compile"]["schemas"].items()]
    print(format_table(["schema", "grammar build ms", "compile ms"], compile_rows))
    print(f"tokenizer info: {result['compile']['tokenizer_info_ms']:.1f} ms (once per engine)")
    return result
