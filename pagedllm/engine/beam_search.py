"""Offline beam search (`LLM.beam_search`): beam-search requests through the ordinary engine.

Each prompt becomes one request with `SamplingParams(use_beam_search=True, n=num_returned,
best_of=beam_width, temperature=0, ...)`. The engine core runs it as a beam group
(pagedllm/core/beam_selection.py, where HF's `_beam_search` conventions are stated): its beams are
core requests batched with every other request, forked copy-on-write from their parents, and
preempted and resumed as a group. This module only builds those requests, steps the engine
until they finish, and shapes the results as `BeamSearchOutput`s.

KV sharing is measured by the core after each step of a group: the distinct blocks its beams
hold against the sum of their block-table lengths (what they would hold without sharing); see
`KVSharingStats`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.core.beam_selection import BeamGroup, KVSharingStats
from pagedllm.core.forking import kv_block_usage  # noqa: F401  (bench.sharing reads it from here)
from pagedllm.engine.input_processor import PromptType
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["BeamSearchOutput", "BeamSequence", "KVSharingStats", "beam_search", "beam_sampling_params"]

_run_ids = itertools.count()


@dataclass(slots=True)
class BeamSequence:
    """One finished beam."""

    token_ids: list[int]
    """Generated tokens only, including a final EOS."""
    text: str
    cumulative_logprob: float
    score: float
    """cumulative_logprob / len(token_ids) ** length_penalty (HF's sequences_scores)."""
    finish_reason: str
    """'stop' (ended by EOS) or 'length' (max_tokens or max_model_len)."""


@dataclass(slots=True)
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    """Best score first."""
    kv_sharing: KVSharingStats = field(default_factory=KVSharingStats)
    """This prompt's beams: blocks held vs without sharing, over the steps it decoded."""


def beam_sampling_params(params: BeamSearchParams, max_tokens: int | None = None) -> SamplingParams:
    """The SamplingParams of a beam-search request (vLLM's fields): best_of beams, the best n returned."""
    return SamplingParams(n=params.num_returned, best_of=params.beam_width, temperature=0.0,
                          max_tokens=params.max_tokens if max_tokens is None else max_tokens,
                          ignore_eos=params.ignore_eos, skip_special_tokens=params.skip_special_tokens,
                          use_beam_search=True, length_penalty=params.length_penalty,
                          early_stopping=params.early_stopping)


def beam_search(engine, prompts: Sequence[PromptType],
                params: BeamSearchParams | Sequence[BeamSearchParams]) -> list[BeamSearchOutput]:
    """Beam search for every prompt on an in-process `LLMEngine` (one params for all, or one per
    prompt); outputs in input order. Other requests in the engine keep running beside them (their
    outputs are not collected here, as with `LLM.generate`). Everything is aborted if it raises."""
    if isinstance(params, BeamSearchParams):
        params_list = [params] * len(prompts)
    elif isinstance(params, Sequence):
        params_list = list(params)
    else:
        raise InvalidRequestError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if len(params_list) != len(prompts):
        raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params_list)} beam search params")
    for p in params_list:
        if not isinstance(p, BeamSearchParams):
            raise InvalidRequestError(f"params must be BeamSearchParams, got {type(p).__name__}")
    run_id = next(_run_ids)
    sharing: dict[str, KVSharingStats] = {}

    def on_group_finished(group: BeamGroup) -> None:
        sharing[group.req_id] = group.sharing

    listeners = engine.core.beams.finished_listeners
    listeners.append(on_group_finished)
    request_ids: list[str] = []
    finished = {}
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            text, token_ids = engine.input_processor.tokenize(prompt)
            room = engine.max_model_len - len(token_ids)
            # max_tokens is capped by what max_model_len leaves (HF stops there too)
            max_tokens = min(p.max_tokens, room) if room > 0 else p.max_tokens
            request_id = f"beam-search-{run_id}-{i}"
            engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids},
                               beam_sampling_params(p, max_tokens))
            request_ids.append(request_id)
        pending = set(request_ids)
        while pending:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine finished without beam-search requests {sorted(pending)}")
            for output in engine.step():
                if output.request_id in pending and output.finished:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
    except BaseException:
        engine.abort_request([r for r in request_ids if r not in finished])
        raise
    finally:
        listeners.remove(on_group_finished)
    results = []
    for request_id, p in zip(request_ids, params_list):
        output = finished[request_id]
        for completion in output.outputs:
            if completion.finish_reason == "abort":
                raise RuntimeError(f"beam search of {request_id} failed: {completion.error or 'aborted'}")
        sequences = [
            BeamSequence(list(c.token_ids), c.text, c.cumulative_logprob,
                         c.cumulative_logprob / len(c.token_ids) ** p.length_penalty, c.finish_reason)
            for c in output.outputs
        ]
        results.append(BeamSearchOutput(output.prompt, output.prompt_token_ids, sequences,
                                        sharing.get(request_id, KVSharingStats())))
    return results
