"""Offline throughput: the engine vs Hugging Face transformers on the same requests, in one run.

Three systems run the same trace back to back, each greedy, each generating exactly every
request's own output length (the engine with ignore_eos; Hugging Face as below):

    engine     pagedllm's offline LLM: continuous batching over the paged KV cache
    hf_static  transformers `generate` in static batches of --hf-batch-size requests, in trace
               order, prompts padded on the left; a batch runs until its longest request is
               done (min_new_tokens = max_new_tokens, so EOS never stops it early) and only
               each request's own output length counts as useful tokens
    hf_cb      transformers' continuous batching manager (the engine behind `generate_batch`),
               each request with its own max_new_tokens; skipped with the error if it fails

Reported per system: elapsed seconds, useful output tokens/s, total (prompt + output) tokens/s,
the engine's ratio over each baseline, and the engine's preemptions.

Time cap (--hf-time-cap, for traces HF cannot finish in a benchmark's time): hf_cb runs with
streaming on and is stopped after the cap; its output tokens are those streamed back to the caller
by the cap (for each request, the length of its last output received before the cap; requests not
yet started count 0) and its rate is that count over the cap. Prompt tokens of a capped run count
only for requests that produced at least one token.

--trace-efficiency also records the engine run's step shapes and compares its wall time with the
matmul-only ideal of the same trace (bench/trace_efficiency.py), in the same run.
--hf-max-requests runs the baselines on the first K requests only (the rate is per token, but a
smaller trace is a different trace: the result says so).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from pagedllm.bench.engine_utils import build_llm, engine_prompts, request_params
from pagedllm.bench.workloads import BenchRequest, trace_stats


def run_engine(llm, requests: list[BenchRequest], progress: bool = True, trace_efficiency: bool = False,
               steps_sink: list | None = None, prior_grid: dict | None = None,
               prior_bandwidth: float | None = None) -> dict:
    """One engine run of the trace. With `trace_efficiency`: its efficiency figures, the matmul grid
    and read bandwidth timed before the run (or `prior_grid` / `prior_bandwidth`, from an earlier run
    of the same engine) and after it, the faster kept; `steps_sink` also gets the run's recorded
    steps (a dict), for scoring several runs against one grid (run_throughput's rounds)."""
    from pagedllm.bench.trace_efficiency import StepRecorder, efficiency_result

    llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids[:8]}],
                 request_params(BenchRequest([], 2)), use_tqdm=False)  # warm-up
    # Every run starts cold: a repeated run (rounds) would otherwise find its prompts cached.
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("cannot empty the prefix cache before the run: KV blocks still in use after the warm-up")
    preemptions_before = llm.engine.stats().num_preemptions
    runner = getattr(llm.engine.core.executor, "runner", None)
    if trace_efficiency and runner is None:
        raise ValueError("trace efficiency times the model in this process: use tensor_parallel_size 1")
    model = runner.model if trace_efficiency else None  # instrumentation: the ideal times the model's own layers
    grid_before, bandwidth_before = prior_grid, prior_bandwidth
    if trace_efficiency and prior_grid is None:
        from pagedllm.bench.attention import read_bandwidth
        from pagedllm.bench.trace_efficiency import time_matmul_grid

        limits = llm.engine.core.scheduler_config
        grid_before = time_matmul_grid(model, limits.max_num_batched_tokens, limits.max_num_seqs)
        bandwidth_before = read_bandwidth()
    with StepRecorder(llm.engine.core, model) as recorder:
        start = time.perf_counter()
        outputs = llm.generate(engine_prompts(requests), [request_params(r) for r in requests], use_tqdm=progress)
        elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    expected = sum(r.output_len * r.n for r in requests)
    assert num_out == expected, f"the engine generated {num_out} tokens, expected {expected}"
    preemptions = llm.engine.stats().num_preemptions - preemptions_before
    result = _rates("engine", requests, num_out, elapsed, num_preemptions=preemptions, num_steps=len(recorder.steps),
                    **engine_memory(llm))
    if trace_efficiency:
        from pagedllm.bench.trace_efficiency import kv_bytes_per_token

        kv_bytes = kv_bytes_per_token(runner.kv_caches)
        result["trace_efficiency"] = efficiency_result(recorder.steps, start, elapsed, model, preemptions,
                                                        grid_before=grid_before, kv_bytes=kv_bytes,
                                                        bandwidth_before=bandwidth_before)
        if steps_sink is not None:
            steps_sink.append({"steps": recorder.steps, "start": start, "elapsed": elapsed,
                               "preemptions": preemptions, "kv_bytes": kv_bytes})
    return result


def engine_memory(llm) -> dict:
    """Peak resident memory of this process so far vs the engine's weights + KV cache (MiB)."""
    import resource

    core = llm.engine.core
    weights = sum(p.numel() * p.element_size() for p in core.executor.runner.model.parameters())
    kv = core.kv_info.num_blocks * core.kv_info.bytes_per_block
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"peak_rss_mib": peak / 2**20, "weights_mib": weights / 2**20, "kv_cache_mib": kv / 2**20,
            "peak_over_weights_kv_mib": (peak - weights - kv) / 2**20}


def _rates(name: str, requests: list[BenchRequest], num_out: int, elapsed: float, num_in: int | None = None,
           **extra) -> dict:
    num_in = sum(r.prompt_len for r in requests) if num_in is None else num_in
    return {"system": name, "num_requests": len(requests), "elapsed_s": elapsed, "num_output_tokens": num_out,
            "output_tok_s": num_out / elapsed, "total_tok_s": (num_in + num_out) / elapsed, **extra}


def load_hf_model(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf_static(model, requests: list[BenchRequest], batch_size: int, pad_token_id: int,
                  progress: bool = True) -> dict:
    def generate(batch: list[BenchRequest]) -> None:
        max_prompt = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, r in enumerate(batch):
            input_ids[i, max_prompt - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, max_prompt - r.prompt_len:] = 1
        max_new = max(r.output_len for r in batch)
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=pad_token_id)
        assert out.shape[1] == max_prompt + max_new

    generate([BenchRequest(requests[0].prompt_token_ids[:8], 2)])  # warm-up
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"HF generate (batch {batch_size})", disable=not progress, unit="batch"):
        generate(batch)
    elapsed = time.perf_counter() - start
    num_out = sum(r.output_len for r in requests)
    padded = sum(len(b) * max(r.output_len for r in b) for b in batches)
    return _rates("hf_static", requests, num_out, elapsed, batch_size=batch_size,
                  generated_incl_padding=padded)


@torch.inference_mode()
def run_hf_continuous(model, requests: list[BenchRequest], kv_tokens: int, max_batch_tokens: int,
                      progress: bool = True, timeout_s: float = 3600, time_cap_s: float | None = None) -> dict:
    """The clock starts once the manager is up (its KV cache allocated), at the first request.

    With `time_cap_s`, stop there and count the tokens streamed back by then (module docstring)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests))
    page_size = 256
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=max(1, kv_tokens // page_size),
                                         max_batch_tokens=max_batch_tokens)
    no_eos = [-1]  # an id no model emits: every request runs to its max_new_tokens
    streaming = time_cap_s is not None
    deadline = time_cap_s if streaming else timeout_s
    produced: dict[str, int] = {}  # request id -> output tokens received so far
    finished: set[str] = set()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5, warmup=False,
                                                   continuous_batching_config=cb_config) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len,
                                   eos_token_id=no_eos, streaming=streaming) for i, r in enumerate(requests)]
        bar = tqdm(total=len(ids), desc="HF continuous batching", disable=not progress, unit="req")
        capped = False
        while len(finished) < len(ids):
            left = deadline - (time.perf_counter() - start)
            if left <= 0:
                if not streaming:
                    raise TimeoutError(f"HF continuous batching did not finish in {timeout_s} s")
                capped = True
                break
            result = manager.get_result(timeout=min(1.0, left))
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the HF continuous batching thread stopped")
                continue
            if result.error is not None:
                raise RuntimeError(f"HF continuous batching failed a request: {result.error}")
            if time.perf_counter() - start > deadline:
                capped = True  # arrived after the cap: not counted
                break
            produced[result.request_id] = len(result.generated_tokens)
            if result.is_finished() and result.request_id not in finished:
                finished.add(result.request_id)
                bar.update(1)
        bar.close()
        elapsed = time_cap_s if capped else time.perf_counter() - start
        if capped:
            manager.stop(block=True, timeout=30, hard_stop=True)  # drop the unfinished requests
    by_id = dict(zip(ids, requests))
    num_out = sum(produced.values())
    started = [by_id[rid] for rid, n in produced.items() if n > 0]
    extra = {"time_cap_s": time_cap_s, "capped": capped, "num_finished_requests": len(finished)} if streaming else {}
    return _rates("hf_cb", requests, num_out, elapsed, num_in=sum(r.prompt_len for r in started), kv_tokens=kv_tokens,
                  expected_output_tokens=sum(r.output_len for r in requests), **extra)


def run_throughput(requests: list[BenchRequest], engine_args: dict, hf_batch_size: int = 32,
                   hf_max_requests: int | None = None, run_hf: bool = True, run_hf_cb: bool = True,
                   progress: bool = True, hf_time_cap_s: float | None = None, trace_efficiency: bool = False,
                   rounds: int = 1) -> dict:
    """The engine, then the HF baselines, on the same trace. `rounds` > 1: the engine (and HF
    continuous batching, if it runs) run again, alternating, `rounds` times in all, each pair back to
    back; `rounds` then holds each pair's rates and ratio. A shared machine's slow spells last
    minutes, so a ratio of two runs minutes apart can move by a third, and the median of alternating
    pairs is the steadier figure. With `trace_efficiency`, every engine run is scored against the
    same matmul grid, the fastest of those timed around all of them (`efficiency_rounds`); the
    systems table is the first round."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if rounds > 1 and not (run_hf_cb or trace_efficiency):
        raise ValueError("rounds > 1 repeats the engine beside HF continuous batching or for its trace efficiency: "
                         "do not pass --no-hf-cb without --trace-efficiency")
    llm = build_llm(**engine_args)
    recorded: list[dict] = []
    systems = [run_engine(llm, requests, progress, trace_efficiency, steps_sink=recorded)]
    core = llm.engine.core
    kv_tokens = core.kv_info.num_blocks * core.kv_info.block_size
    max_batch_tokens = core.scheduler_config.max_num_batched_tokens
    from pagedllm.model.loader import resolve_hf_dir

    # a GGUF's directory may lack the float32 weights HF reads: converted with them on request
    model_path = str(resolve_hf_dir(engine_args.get("model"))) if run_hf or run_hf_cb else None
    pad = llm.engine.tokenizer.pad_token_id if llm.engine.tokenizer is not None else None
    pad = pad if pad is not None else 0
    if rounds == 1:
        del llm  # its memory and threads are not needed again
    hf_requests = requests[:hf_max_requests] if hf_max_requests else requests
    errors = {}
    model = load_hf_model(model_path) if run_hf or run_hf_cb else None
    if run_hf:
        systems.append(run_hf_static(model, hf_requests, hf_batch_size, pad, progress))
    engine_runs, hf_runs = [systems[0]], []
    for i in range(rounds):
        if i > 0:
            earlier = engine_runs[-1].get("trace_efficiency")
            engine_runs.append(run_engine(
                llm, requests, progress, trace_efficiency, steps_sink=recorded,
                prior_grid=_grid_of(earlier), prior_bandwidth=earlier["read_gb_s"] * 1e9 if earlier else None))
        if run_hf_cb and "hf_cb" not in errors:
            try:
                hf_runs.append(run_hf_continuous(model, hf_requests, kv_tokens, max_batch_tokens, progress,
                                                 time_cap_s=hf_time_cap_s))
            except Exception as e:  # the baseline is optional; say why it is missing
                errors["hf_cb"] = f"{type(e).__name__}: {e}"
    if hf_runs:
        systems.append(hf_runs[0])
    engine = systems[0]
    for s in systems:
        s["engine_output_ratio"] = engine["output_tok_s"] / s["output_tok_s"]
        s["engine_total_ratio"] = engine["total_tok_s"] / s["total_tok_s"]
    result = {"trace": trace_stats(requests), "hf_trace": trace_stats(hf_requests), "systems": systems,
              "errors": errors, "hf_batch_size": hf_batch_size}
    if rounds > 1 and len(hf_runs) == rounds:
        result["rounds"] = [{"engine_s": e["elapsed_s"], "engine_tok_s": e["output_tok_s"], "hf_cb_s": h["elapsed_s"],
                             "hf_cb_tok_s": h["output_tok_s"], "ratio": e["output_tok_s"] / h["output_tok_s"]}
                            for e, h in zip(engine_runs, hf_runs)]
        result["median_round_ratio"] = float(np.median([r["ratio"] for r in result["rounds"]]))
    if rounds > 1 and trace_efficiency:
        _rescore_rounds(result, engine_runs, recorded)
    return result


def _grid_of(efficiency: dict | None) -> dict | None:
    from pagedllm.bench.trace_efficiency import grid_of

    return grid_of(efficiency) if efficiency else None


def _rescore_rounds(result: dict, engine_runs: list[dict], recorded: list[dict]) -> None:
    """Every engine round against one grid (every point timed in any round, at its fastest) and the
    highest read bandwidth seen; the first round's figures replace its own in the systems table."""
    from pagedllm.bench.trace_efficiency import score_steps, union_of

    grid = union_of([_grid_of(run["trace_efficiency"]) for run in engine_runs])
    bandwidth = max(run["trace_efficiency"]["read_gb_s"] for run in engine_runs) * 1e9
    scored = [score_steps(r["steps"], r["start"], r["elapsed"], grid, r["preemptions"], r["kv_bytes"], bandwidth)
              for r in recorded]
    engine_runs[0]["trace_efficiency"] = scored[0]
    result["efficiency_rounds"] = [{"engine_s": sc["engine_wall_s"], "ideal_s": sc["ideal_s"],
                                    "efficiency": sc["efficiency"], "kv_read_s": sc["kv_read_s"],
                                    "roofline": sc["roofline"]} for sc in scored]
    result["median_round_efficiency"] = float(np.median([sc["efficiency"] for sc in scored]))


def efficiency_rounds_table(result: dict) -> tuple[list[str], list[list]]:
    """One row per engine round scored against the one grid (run_throughput's `rounds`), then the median."""
    headers = ["round", "engine s", "matmul-only ideal s", "ideal / wall", "KV-read floor s",
               "(ideal + KV read) / wall"]
    rows = [[i + 1, r["engine_s"], r["ideal_s"], r["efficiency"], r["kv_read_s"], r["roofline"]]
            for i, r in enumerate(result["efficiency_rounds"])]
    rows.append(["median", None, None, result["median_round_efficiency"], None, None])
    return headers, rows


def rounds_table(result: dict) -> tuple[list[str], list[list]]:
    """One row per alternating round (run_throughput's `rounds`), then the median ratio."""
    headers = ["round", "engine s", "engine output tok/s", "hf_cb s", "hf_cb output tok/s", "engine / hf_cb"]
    rows = [[i + 1, r["engine_s"], r["engine_tok_s"], r["hf_cb_s"], r["hf_cb_tok_s"], r["ratio"]]
            for i, r in enumerate(result["rounds"])]
    rows.append(["median", None, None, None, None, result["median_round_ratio"]])
    return headers, rows


def throughput_table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["system", "requests", "output tokens", "seconds", "output tok/s", "total tok/s", "engine / system (output)",
               "preemptions"]
    rows = [[_label(s), s["num_requests"], s["num_output_tokens"], s["elapsed_s"], s["output_tok_s"], s["total_tok_s"],
             s["engine_output_ratio"], s.get("num_preemptions")]
            for s in result["systems"]]
    return headers, rows


def _label(system: dict) -> str:
    label = system["system"]
    if "batch_size" in system:
        label += f" (batch {system['batch_size']})"
    if system.get("capped"):
        label += f" (first {system['time_cap_s']:.0f} s; {system['num_finished_requests']} requests finished)"
    return label
