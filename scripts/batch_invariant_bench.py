"""Single-user greedy decode, the batch-invariant mode on vs off, alternating in one process (so the
ratio shares the machine's load), on the default model unless --model is given:

    python scripts/batch_invariant_bench.py [--threads 1] [--new-tokens 64] [--rounds 6] [--cpu-time] [--gguf-dequantize]

Decode tok/s excludes the prompt: the time of a max_tokens=1 run of the same prompt is subtracted.
--cpu-time times the process's CPU seconds instead of the wall clock (with --threads 1, on a loaded
machine: other jobs' time slices then count for neither mode).
Prints each round's rates, the median ratio (on / off) and whether the two modes' greedy tokens agree.
"""

import argparse
import json
import statistics
import time


CLOCK = [time.perf_counter]


def timed(llm, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = CLOCK[0]()
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return CLOCK[0]() - start, list(out[0].outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--gguf-dequantize", action="store_true", help="the float32 path instead of Q4_1")
    args = parser.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.process_time
    from pagedllm import LLM

    common = dict(model=args.model, num_threads=args.threads, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    if args.gguf_dequantize:
        common["gguf_dequantize"] = True
    engines = {"off": LLM(**common), "on": LLM(batch_invariant=True, **common)}
    prompt = list(range(1000, 1000 + args.prompt_len))
    rates = {name: [] for name in engines}
    tokens = {}
    for name, llm in engines.items():  # warm-up
        timed(llm, prompt, 4)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            first, _ = timed(llm, prompt, 1)
            total, tokens[name] = timed(llm, prompt, args.new_tokens + 1)
            rates[name].append(args.new_tokens / max(total - first, 1e-9))
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    print(json.dumps({
        "decode_tok_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "ratio_on_off_per_round": [round(r, 3) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_of_best": round(max(rates["on"]) / max(rates["off"]), 3),
        "same_greedy_tokens": tokens["on"] == tokens["off"],
        "args": vars(args),
    }, indent=1))


if __name__ == "__main__":
    main()
