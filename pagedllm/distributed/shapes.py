"""Which tensor-parallel sizes a model can be split into, and how its heads fall on each rank.

Query heads and the MLP's intermediate features are split evenly, so N must divide both.
KV heads are split when N divides their number, and replicated when N is a multiple of it
(each rank then holds the one KV head its query heads read):

    8 query / 4 KV heads, N = 2:  rank r: q heads 4r..4r+3, kv heads 2r..2r+1
    9 query / 3 KV heads, N = 3:  rank r: q heads 3r..3r+2, kv head r
    4 query / 2 KV heads, N = 4:  rank r: q head r,         kv head r // 2   (replicated twice)

The vocabulary is padded up to a multiple of N, so it never limits N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TPShape:
    """One rank's share of a model's heads."""

    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """KV heads on this rank (and in its KV cache)."""
    kv_head_start: int
    """The first global KV head this rank holds."""


def _fits(n: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> bool:
    kv_ok = num_kv_heads % n == 0 or n % num_kv_heads == 0
    return n >= 1 and num_heads % n == 0 and intermediate_size % n == 0 and kv_ok


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    return [n for n in range(1, num_heads + 1) if _fits(n, num_heads, num_kv_heads, intermediate_size)]


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise ValueError, naming the valid sizes, if the model cannot be split ``tp_size`` ways."""
    if not _fits(tp_size, num_heads, num_kv_heads, intermediate_size):
        valid = ", ".join(map(str, valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)))
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split this model ({num_heads} query heads, "
            f"{num_kv_heads} KV heads, intermediate size {intermediate_size}); valid sizes: {valid}"
        )


def tp_shape(tp_size: int, tp_rank: int, num_heads: int, num_kv_heads: int) -> TPShape:
    kv_per_rank = max(1, num_kv_heads // tp_size)
    return TPShape(
        num_heads=num_heads // tp_size,
        num_kv_heads=kv_per_rank,
        kv_head_start=tp_rank * num_kv_heads // tp_size,
    )


def head_dim_of(hf_config) -> int:
    """Per-head width: the config's ``head_dim`` if set, else hidden_size / num_attention_heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config) -> int:
    """Global KV heads (GQA); a config without ``num_key_value_heads`` has one per query head."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def config_tp_shape(hf_config, tp_size: int = 1, tp_rank: int = 0) -> TPShape:
    """``tp_shape`` for a Hugging Face config, after checking that it splits ``tp_size`` ways."""
    check_config_tp_size(hf_config, tp_size)
    return tp_shape(tp_size, tp_rank, hf_config.num_attention_heads, num_kv_heads_of(hf_config))


def check_config_tp_size(hf_config, tp_size: int) -> None:
    """``check_tp_size`` for a Hugging Face config. Qwen3-MoE's experts have their own intermediate
    size, sliced like the dense one (model/layers/moe.py), so N must divide both: their gcd stands in."""
    intermediate = hf_config.intermediate_size
    moe_intermediate = getattr(hf_config, "moe_intermediate_size", None)
    if moe_intermediate:
        intermediate = math.gcd(intermediate, moe_intermediate)
    check_tp_size(tp_size, hf_config.num_attention_heads, num_kv_heads_of(hf_config), intermediate)
