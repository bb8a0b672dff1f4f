"""The default KV cache budget, as a rule a user can say in one sentence:

    room for 16 requests of 2048 tokens (32768 tokens), but no more than four times the size of the model's
    weight files (at least 256 MiB), never less than one request of max_model_len, and never more than a quarter
    of the memory available when the engine starts.

Why these numbers, on a CPU server:

* 16 x 2048 tokens: enough for a 1B model to serve 16 chat requests at once; beyond ~16 sequences a CPU decode
  step is bound by memory bandwidth and more concurrency buys little throughput.
* 4x the weights: a full cache then streams at most four weights' worth of K/V per decode step, and a small
  model gets a small cache (the embedded 98 MB SmolLM2 gets ~390 MB instead of 1 GiB). A 1B Q4_0 GGUF (~0.6 GB)
  still reaches the 32768 tokens (2 GiB in float32). The 256 MiB floor keeps tiny models usable.
* one max_model_len request: a request the scheduler admits must be able to fit.
* a quarter of available memory: the cache is allocated (and touched) up front; the rest stays for the weights,
  activations, the front end and everything else on the machine.

`--kv-cache-memory SIZE` or `--num-kv-blocks N` replaces the rule. Pure arithmetic, no torch: the worker supplies
the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_TOKENS = 16 * 2048
"""Tokens the default cache aims to hold: 16 requests of 2048."""
WEIGHTS_MULTIPLE = 4
"""The default cache takes at most this many times the model's weight files..."""
MIN_WEIGHTS_CAP_BYTES = 256 * 2**20
"""...but that cap is never below this."""
AVAILABLE_FRACTION = 0.25
"""The default cache takes at most this share of the memory available at start-up."""


@dataclass(frozen=True, slots=True)
class KVBudget:
    num_bytes: int
    """Bytes for the KV cache of all layers."""
    limited_by: str
    """Which part of the rule decided: 'tokens', 'weights', 'max_model_len' or 'available memory'."""


def default_kv_cache_bytes(bytes_per_token: int, max_model_len: int, weight_bytes: int | None,
                           available_bytes: int | None) -> KVBudget:
    """The rule above. `bytes_per_token`: K and V of every layer for one token; `weight_bytes`: the model's weight
    files (None: unknown, no weights cap); `available_bytes`: memory available now (None: unknown, no cap)."""
    if bytes_per_token < 1 or max_model_len < 1:
        raise ValueError(f"bytes_per_token and max_model_len must be >= 1, got {bytes_per_token}, {max_model_len}")
    budget = KVBudget(DEFAULT_KV_TOKENS * bytes_per_token, "tokens")
    if weight_bytes is not None:
        weights_cap = max(WEIGHTS_MULTIPLE * weight_bytes, MIN_WEIGHTS_CAP_BYTES)
        if weights_cap < budget.num_bytes:
            budget = KVBudget(weights_cap, "weights")
    one_request = max_model_len * bytes_per_token
    if budget.num_bytes < one_request:
        budget = KVBudget(one_request, "max_model_len")
    if available_bytes is not None and int(available_bytes * AVAILABLE_FRACTION) < budget.num_bytes:
        budget = KVBudget(int(available_bytes * AVAILABLE_FRACTION), "available memory")
    return budget


def describe(budget: KVBudget) -> str:
    """A start-up log's words for which limit decided."""
    return {
        "tokens": f"room for {DEFAULT_KV_TOKENS} tokens (16 requests of 2048)",
        "weights": f"{WEIGHTS_MULTIPLE}x the model's weight files (at least {MIN_WEIGHTS_CAP_BYTES // 2**20} MiB)",
        "max_model_len": "one request of max_model_len",
        "available memory": f"{AVAILABLE_FRACTION:.0%} of the memory available",
    }[budget.limited_by]
