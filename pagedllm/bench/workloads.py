"""Seeded synthetic request traces shaped like the published ones.

Lengths follow the statistics the vLLM paper reports for its traces (its Fig. 11):

    sharegpt   mean input ~161 tokens, mean output ~338, long-tailed (chat conversations)
    alpaca     mean input ~19, mean output ~58 (short instructions)

Each length is drawn from a lognormal whose mean is the published one (sigma sets the tail:
1.0 for ShareGPT, 0.8 for Alpaca), rounded, then clipped to [1, ...] so that input + output
fits max_model_len; clipping shaves the tail, so the realized means are reported with every
trace (`trace_stats`). `length_scale` shrinks every length (for runs this CPU can afford;
benchmarks report the scale they used).

Prompt tokens are uniform random ids from the vocabulary above the first 100 (which hold the
special tokens of the default model). Attention cost depends on lengths, not on which tokens,
and requests run with ignore_eos and max_tokens = their output length, so every request
generates exactly its trace output length and its final length is known (what the `pow2`
and `oracle` reservation policies need).

Variants: `fixed` (every request the same lengths), `shared_prefix` (a common few-shot prefix
plus a random suffix), and `n` (parallel samples per prompt). Arrivals are all at once
(offline, rate = inf) or a Poisson process at `request_rate` requests/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("sharegpt", "alpaca", "fixed", "shared_prefix")

# (mean input, mean output, lognormal sigma) of the published traces.
TRACE_STATS = {"sharegpt": (161.0, 338.0, 1.0), "alpaca": (19.0, 58.0, 0.8)}
FIRST_ORDINARY_TOKEN = 100


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0
    """Seconds after the start of the run."""
    n: int = 1
    """Parallel samples of this prompt."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class WorkloadSpec:
    name: str = "sharegpt"
    num_requests: int = 100
    max_model_len: int = 2048
    vocab_size: int = 49152
    seed: int = 0
    length_scale: float = 1.0
    """Multiply every sampled length by this (>0) before clipping."""
    input_len: int = 128
    """fixed / shared_prefix: prompt length (shared_prefix: of the per-request suffix)."""
    output_len: int = 128
    """fixed / shared_prefix: output length."""
    prefix_len: int = 256
    """shared_prefix: length of the common prefix."""
    n: int = 1
    request_rate: float = math.inf
    """Poisson arrivals per second; inf = all at time 0."""
    extra: dict = field(default_factory=dict)


def _lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, count: int, scale: float) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, count) * scale)).astype(np.int64)


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The seeded trace `spec` describes; same spec, same requests."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {WORKLOADS}")
    if spec.length_scale <= 0:
        raise ValueError("length_scale must be > 0")
    rng = np.random.default_rng(spec.seed)
    count = spec.num_requests
    max_len = spec.max_model_len
    if spec.name in TRACE_STATS:
        mean_in, mean_out, sigma = TRACE_STATS[spec.name]
        input_lens = np.minimum(_lognormal_lengths(rng, mean_in, sigma, count, spec.length_scale), max_len // 2)
        output_lens = _lognormal_lengths(rng, mean_out, sigma, count, spec.length_scale)
        output_lens = np.minimum(output_lens, max_len - input_lens)
    else:
        input_lens = np.full(count, spec.input_len)
        output_lens = np.full(count, spec.output_len)
        total_in = spec.input_len + (spec.prefix_len if spec.name == "shared_prefix" else 0)
        if total_in + spec.output_len > max_len:
            raise ValueError(f"input ({total_in}) + output ({spec.output_len}) exceeds max_model_len ({max_len})")
    prefix = []
    if spec.name == "shared_prefix":
        prefix = rng.integers(FIRST_ORDINARY_TOKEN, spec.vocab_size, spec.prefix_len).tolist()
    if math.isinf(spec.request_rate):
        arrivals = np.zeros(count)
    else:
        if spec.request_rate <= 0:
            raise ValueError("request_rate must be > 0 (inf = all at once)")
        arrivals = np.cumsum(rng.exponential(1.0 / spec.request_rate, count))
        arrivals -= arrivals[0]
    requests = []
    for i in range(count):
        tokens = rng.integers(FIRST_ORDINARY_TOKEN, spec.vocab_size, int(input_lens[i])).tolist()
        requests.append(BenchRequest(prefix + tokens, int(output_lens[i]), float(arrivals[i]), spec.n))
    return requests


def trace_stats(requests: list[BenchRequest]) -> dict:
    """Realized length statistics of a trace (what the benchmark actually ran)."""
    ins = np.array([r.prompt_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    return {
        "num_requests": len(requests),
        "mean_input_len": float(ins.mean()),
        "mean_output_len": float(outs.mean()),
        "p50_input_len": float(np.median(ins)),
        "p50_output_len": float(np.median(outs)),
        "max_input_len": int(ins.max()),
        "max_output_len": int(outs.max()),
        "total_input_tokens": int(ins.sum()),
        "total_output_tokens": int(outs.sum() * requests[0].n) if requests else 0,
        "duration_s": float(requests[-1].arrival_time) if requests else 0.0,
    }


def add_workload_args(parser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    g.add_argument("--num-requests", type=int, default=None)
    g.add_argument("--input-len", type=int, default=128, help="fixed/shared_prefix: prompt (suffix) length")
    g.add_argument("--output-len", type=int, default=128, help="fixed/shared_prefix: output length")
    g.add_argument("--prefix-len", type=int, default=256, help="shared_prefix: common prefix length")
    g.add_argument("--length-scale", type=float, default=1.0, help="shrink sharegpt/alpaca lengths (report it)")
    g.add_argument("-n", type=int, default=1, help="parallel samples per prompt")
    g.add_argument("--workload-seed", type=int, default=0)


def spec_from_args(args, num_requests_default: int, max_model_len: int, request_rate: float = math.inf) -> WorkloadSpec:
    return WorkloadSpec(
        name=args.workload, num_requests=args.num_requests or num_requests_default, max_model_len=max_model_len,
        seed=args.workload_seed, length_scale=args.length_scale, input_len=args.input_len,
        output_len=args.output_len, prefix_len=args.prefix_len, n=args.n, request_rate=request_rate,
    )
