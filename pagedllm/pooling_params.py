"""How one pooling (embedding) request wants its vector: the counterpart of SamplingParams."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """Parameters of an embedding request, validated on construction.

    Plain data: it crosses the process boundary inside the EngineCoreRequest. The pooling itself
    (mean, last token, Dense layers, Normalize) is the model's, read from its sentence-transformers
    files (pagedllm/config/embedder.py); a request only chooses what the model allows.
    """

    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka models only), renormalized when the model
    normalizes; None keeps the model's full vector."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (vLLM's name; -1: as many as the model takes); None refuses a
    prompt longer than the model takes. Applied by the front end."""
    needs_every_position: bool = True
    """Set by the front end from the model's pooling: the pooler reads every prompt position's hidden
    state (mean, max, CLS, ...), so a prefix-cache hit cannot stand in for computing it. Last-token
    pooling reads the last position only, which the prefix cache never serves."""

    token_type_ids: list[int] | None = None
    """Set by the front end for a text pair given to an encoder (BERT's segment ids); None: all 0."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be None or an integer >= 1, got {self.dimensions!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an integer >= 1, got {k!r}")
        if not isinstance(self.needs_every_position, bool):
            raise ValueError(f"needs_every_position must be a bool, got {self.needs_every_position!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one text_1 against each text_2, or two lists of one length pairwise."""
    if isinstance(text_2, str):
        text_2 = [text_2]
    if isinstance(text_1, str):
        return [(text_1, t) for t in text_2]
    if len(text_1) != len(text_2):
        raise ValueError(f"text_1 has {len(text_1)} texts and text_2 {len(text_2)}: give one text_1, or as many "
                         f"as text_2")
    return list(zip(text_1, text_2))
