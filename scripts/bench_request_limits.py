"""What a request at every limit costs its neighbours (issue 12, item 2). A measurement, not a test.

An ordinary request (short prompt, greedy, a few tokens) is timed from submission to its last token:
  alone;
  beside a "plain" request with the same shape as the hostile one (same prompt length, n, max_tokens)
    but no stop ids, bias, stop strings or logprobs: what sharing the batch costs anyway;
  beside the same request at every limit (stop_token_ids, logit_bias, stop strings, logprobs,
    prompt_logprobs at their limits): what its per-request data costs on top.
The figure that matters is limit / plain (target <= 1.5). Repeats are interleaved so machine load
hits every case alike; medians are reported. Runs on any tree (public surfaces only), so the same
command on an older checkout shows what the per-step rebuilding used to cost.

    PYTHONPATH=$PWD python scripts/bench_request_limits.py [--n 16] [--prompt-len 512] [--repeats 3] [--penalties]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.config import EngineArgs
from pagedllm.sampling_params import SamplingParams


def hostile_params(n: int, vocab_size: int, at_limits: bool, max_tokens: int, penalties: bool) -> SamplingParams:
    base = dict(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    if penalties:  # [N, vocab] penalty tensors for the whole batch, in both cases
        base.update(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)
    if not at_limits:
        return SamplingParams(**base)
    return SamplingParams(
        **base,
        stop_token_ids=list(range(vocab_size - 256, vocab_size)),     # max_stop_token_ids = 256
        logit_bias={t: 0.5 for t in range(100, 400)},               # max_logit_bias = 300
        stop=[f"{i:04d}" + "\u2603" * 1019 for i in range(16)],     # 16 stop strings of 1024 chars
        logprobs=20, prompt_logprobs=20,                             # max_logprobs = 20
        min_tokens=max_tokens // 2,                                  # the eos + stop ids suppressed for a while
    )


def neighbour_latency(engine: LLMEngine, hostile: SamplingParams | None, prompt_len: int, tag: str) -> float:
    if hostile is not None:
        engine.add_request(f"hostile-{tag}", {"prompt_token_ids": [100 + i % 1000 for i in range(prompt_len)]},
                           hostile)
    start = time.perf_counter()
    engine.add_request(f"neighbour-{tag}", {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    latency = None
    while latency is None:
        for out in engine.step():
            if out.request_id == f"neighbour-{tag}" and out.finished:
                latency = time.perf_counter() - start
    engine.abort_request(f"hostile-{tag}")
    while engine.has_unfinished_requests():
        engine.step()
    return latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--penalties", action="store_true", help="the hostile request (plain and at limits) also "
                                                                 "sets repetition, presence and frequency penalties")
    args = parser.parse_args()

    engine = LLMEngine(EngineArgs(model=args.model, enable_prefix_caching=False, max_model_len=2048))
    vocab_size = engine.hf_config.vocab_size
    max_tokens = 64  # the hostile request outlives the neighbour
    cases = {
        "alone": None,
        "beside plain": hostile_params(args.n, vocab_size, False, max_tokens, args.penalties),
        "beside at-limits": hostile_params(args.n, vocab_size, True, max_tokens, args.penalties),
    }
    neighbour_latency(engine, None, args.prompt_len, "warm-up")
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.repeats):
        for name, params in cases.items():
            times[name].append(neighbour_latency(engine, params, args.prompt_len, f"{name}-{r}"))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"neighbour latency (8 tokens), hostile n={args.n}, prompt {args.prompt_len} tokens"
          f"{', penalties' if args.penalties else ''}, median of {args.repeats}:")
    for name, t in medians.items():
        print(f"  {name:18s} {1000 * t:8.1f} ms   runs: {', '.join(f'{1000 * x:.0f}' for x in times[name])}")
    print(f"  at-limits / plain: {medians['beside at-limits'] / medians['beside plain']:.2f}x  (target <= 1.5x)")


if __name__ == "__main__":
    main()
