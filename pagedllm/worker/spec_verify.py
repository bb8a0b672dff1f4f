"""Speculative decoding in the model runner: score a request's proposals, keep the verified prefix.

The scheduler sends proposals in `SchedulerOutput.scheduled_spec_tokens` and schedules them like
prompt tokens. `attach_proposals` appends them to the runner's copy of each request's tokens, so
input preparation writes their KV like any other token; `verify_rows` computes the logits of all
k + 1 positions (the LM head over those rows only) and verifies them (model/sampling/rejection_sampler.py);
`commit` replaces the proposals by what was kept. The rollback (how many tokens stay computed, how
long the block table stays) is computed once, by the scheduler's SpecDecoder.settle
(core/spec_planner.py), and arrives with the request's next CachedRequestData.
"""

from __future__ import annotations

import torch

from pagedllm.core.sched_output import ModelRunnerOutput, TokenLogprobs
from pagedllm.model.sampling.logprobs import gather_logprobs
from pagedllm.model.sampling.metadata import MIN_TEMPERATURE, SamplingMetadata, SamplingRow
from pagedllm.model.sampling.rejection_sampler import SpecRequestRows, verify


def attach_proposals(requests: dict, spec_tokens: dict[str, list[int]]) -> None:
    """Append each request's proposals to the runner's copy of its tokens (removed again by `commit`)."""
    for req_id, proposals in spec_tokens.items():
        requests[req_id].token_ids.extend(proposals)


def verify_rows(runner, states, rows: list[int], spec_tokens: dict[str, list[int]], metadata,
                hidden_states: torch.Tensor, output: ModelRunnerOutput) -> dict[str, list[int]]:
    """Verify the proposals of states[i] for i in `rows`; fills `output` and returns req_id -> kept tokens."""
    hidden_index: list[int] = []
    sampling_rows: list[SamplingRow] = []
    requests: list[SpecRequestRows] = []
    query_start = [0]
    for n in metadata.query_lens_host:  # on the host already: no device sync
        query_start.append(query_start[-1] + n)
    for i in rows:
        state = states[i]
        proposals = spec_tokens[state.req_id]
        k = len(proposals)
        num_real = len(state.token_ids) - k
        generator = runner.generators.get(state.req_id)
        requests.append(SpecRequestRows(len(hidden_index), proposals,
                                        state.params.temperature < MIN_TEMPERATURE, generator))
        hidden_index.extend(range(query_start[i], query_start[i] + k + 1))
        prompt = state.token_ids[: state.num_prompt_tokens]
        for j in range(k + 1):  # position j has seen the proposals before it, as plain decoding would
            sampling_rows.append(SamplingRow(params=state.params, prompt_token_ids=prompt,
                                             output_token_ids=state.token_ids[state.num_prompt_tokens: num_real + j],
                                             generator=generator, eos_token_ids=state.eos_token_ids,
                                             tensors=state.tensors))
    logits = runner.model.compute_logits(hidden_states[hidden_index])  # [sum(k + 1), vocab]
    sampling = SamplingMetadata.from_requests(sampling_rows, runner.vocab_size, runner.device)
    kept_lists = verify(logits, sampling, requests)
    kept_by_req: dict[str, list[int]] = {}
    for i, r, kept in zip(rows, requests, kept_lists):
        state = states[i]
        kept_by_req[state.req_id] = kept
        output.sampled_token_ids[state.req_id] = kept
    if sampling.max_num_logprobs is not None:
        _logprobs(states, rows, requests, kept_lists, logits, output)
    return kept_by_req


def _logprobs(states, rows, requests, kept_lists, logits, output) -> None:
    """Logprobs of each kept token from the raw logits of its position (a second sync, only when asked)."""
    want = [(i, r, kept) for i, r, kept in zip(rows, requests, kept_lists) if states[i].params.logprobs is not None]
    if not want:
        return
    num_logprobs = max(states[i].params.logprobs for i, _, _ in want)
    row_index = [r.first + j for _, r, kept in want for j in range(len(kept))]
    token_ids = torch.tensor([t for _, _, kept in want for t in kept], dtype=torch.int64, device=logits.device)
    raw = torch.log_softmax(logits[row_index].to(torch.float32), dim=-1)
    ids, values, ranks = gather_logprobs(raw, token_ids, num_logprobs)
    ids, values, ranks = ids.tolist(), values.tolist(), ranks.tolist()
    cursor = 0
    for i, _, kept in want:
        n = states[i].params.logprobs + 1
        output.logprobs[states[i].req_id] = [
            TokenLogprobs(ids[cursor + j][:n], values[cursor + j][:n], ranks[cursor + j]) for j in range(len(kept))]
        cursor += len(kept)


def commit(state, num_proposals: int, kept: list[int]) -> None:
    """Replace the proposals in the runner's tokens by the kept tokens (the accepted prefix and the
    model's own). The computed count and block table are left to the scheduler's next diff."""
    del state.token_ids[len(state.token_ids) - num_proposals:]
    state.token_ids.extend(kept)
