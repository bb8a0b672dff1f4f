"""Turns engine-core outputs into RequestOutputs: text, stop strings, logprobs, n > 1.

A stop string is found here, in the front end; the request is then reported finished and
its id returned so the caller aborts it in the core, freeing its blocks.
"""

from __future__ import annotations

import dataclasses

import time
from dataclasses import dataclass, field

from pagedllm.core.request import EngineCoreRequest
from pagedllm.core.sched_output import EngineCoreOutput, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import CompletionOutput, Logprob, LogprobsDict, PoolingRequestOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class SequenceState:
    """One generated sequence (one core request)."""

    req_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_sent_tokens: int = 0
    final_sent: bool = False
    """Streaming: the finished state was delivered; nothing more to send."""
    pooled: list[float] | None = None
    """A pooling request's vector, once finished."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestState:
    """One user request: what was sent to the core, and its n (or best_of) sequences."""

    request: EngineCoreRequest
    """Id, prompt token ids, params and arrival time, as the core received them."""
    prompt: str | None
    sequences: list[SequenceState]
    stream: bool
    """Deltas (text and tokens since the last output) instead of cumulative outputs."""
    first_token_time: float | None = None
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.req_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


class OutputProcessor:
    """The front end's registry of live requests, and the maker of their RequestOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.seq_to_request: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None = None, stream: bool = False) -> None:
        """Register a request and its sequences; InvalidRequestError (nothing registered) if an id is taken."""
        seq_req_ids = request.sequence_req_ids()
        if request.req_id in self.requests or any(s in self.seq_to_request for s in seq_req_ids):
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        params = request.sampling_params
        # best_of ranks sequences by cumulative logprob even when no logprobs are returned
        keep_logprobs = params.logprobs is not None or (params.best_of or 1) > params.n
        keep_logprobs = keep_logprobs or params.use_beam_search  # a beam's cumulative logprob is its score
        sequences = [
            SequenceState(seq_req_id, index, params,
                          IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
                          if self.tokenizer and request.pooling_params is None else None,
                          logprobs=[] if keep_logprobs else None,
                          cumulative_logprob=0.0 if keep_logprobs else None)
            for index, seq_req_id in enumerate(seq_req_ids)
        ]
        state = RequestState(request, prompt, sequences, stream,
                             prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        self.requests[request.req_id] = state
        for seq in sequences:
            self.seq_to_request[seq.req_id] = (state, seq)

    def request_id_of(self, seq_req_id: str) -> str | None:
        """The user request a core request id belongs to (None when unknown or finished)."""
        entry = self.seq_to_request.get(seq_req_id)
        return entry[0].request_id if entry is not None else None

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its core request ids, to abort in the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.sequences:
            self.seq_to_request.pop(seq.req_id, None)
        return [seq.req_id for seq in state.sequences if not seq.finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to deliver and the core request ids to abort (stop strings)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self.seq_to_request.get(out.req_id)
            if entry is None:
                continue
            state, seq = entry
            touched[state.request_id] = state
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None and seq.index == 0:
                self._append_prompt_logprobs(state, out.new_prompt_logprobs)
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            self._update_sequence(seq, out)
            if seq.stop_reason is not None and isinstance(seq.stop_reason, str) and out.finish_reason is None:
                to_abort.append(seq.req_id)  # a stop string: the core does not know yet

        results = []
        for state in touched.values():
            output = self._make_request_output(state)
            if output is not None:
                results.append(output)
            if state.finished:
                self.requests.pop(state.request_id, None)
                for seq in state.sequences:
                    self.seq_to_request.pop(seq.req_id, None)
        return results, to_abort

    def _update_sequence(self, seq: SequenceState, out: EngineCoreOutput) -> None:
        if len(out.new_token_ids) > 1 and seq.detokenizer is not None and seq.detokenizer.params.stop:
            # Several tokens in one step (speculative decoding): a stop string must end the output at
            # the token that completes it, as it does when tokens arrive one per step.
            last = len(out.new_token_ids) - 1
            for i, token_id in enumerate(out.new_token_ids):
                self._update_sequence_one(seq, dataclasses.replace(
                    out, new_token_ids=[token_id],
                    new_logprobs=out.new_logprobs[i:i + 1] if out.new_logprobs is not None else None,
                    finish_reason=out.finish_reason if i == last else None,
                    stop_reason=out.stop_reason if i == last else None))
            return
        self._update_sequence_one(seq, out)

    def _update_sequence_one(self, seq: SequenceState, out: EngineCoreOutput) -> None:
        if seq.finished:
            return
        seq.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and seq.logprobs is not None:
            for entry in out.new_logprobs:
                seq.logprobs.append(self._to_logprobs_dict(entry))
                seq.cumulative_logprob += entry.logprobs[0]
        if out.error is not None:
            seq.error = out.error
        if out.pooled is not None:
            seq.pooled = out.pooled
        stop_string = seq.detokenizer.update(out.new_token_ids) if seq.detokenizer else None
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            if seq.detokenizer:
                flushed_stop = seq.detokenizer.finish()
                if flushed_stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", flushed_stop

    def _to_logprobs_dict(self, entry: TokenLogprobs) -> LogprobsDict:
        result: LogprobsDict = {}
        for column, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if token_id in result:
                continue  # the chosen token is also among the top-k
            rank = entry.rank if column == 0 else column
            result[token_id] = Logprob(logprob, rank, self._decode_token(token_id))
        return result

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _append_prompt_logprobs(self, state: RequestState, entries) -> None:
        for entry in entries:
            if len(state.prompt_logprobs) >= len(state.prompt_token_ids):
                return  # a recomputed (preempted) prompt repeats what was already sent
            state.prompt_logprobs.append(None if entry is None else self._to_logprobs_dict(entry))

    def _make_request_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        if state.request.pooling_params is not None:  # one output, when finished
            seq = state.sequences[0]
            return PoolingRequestOutput(state.request_id, state.prompt_token_ids, seq.pooled, True, seq.error,
                                        state.num_cached_tokens) if state.finished else None
        params = state.params
        # beam search: the core returns the best n beams, already in order
        best_of = params.best_of is not None and params.best_of > params.n and not params.use_beam_search
        if best_of and not state.finished:
            return None  # the n best are known only at the end
        sequences = state.sequences
        if best_of:
            sequences = sorted(sequences, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[: params.n]
        completions = []
        for index, seq in enumerate(sequences):
            completion = self._completion(seq, index if best_of else seq.index, state.stream)
            if completion is not None:
                completions.append(completion)
        if state.stream and not completions and not state.finished:
            return None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics={"arrival_time": state.request.arrival_time, "first_token_time": state.first_token_time or 0.0},
        )

    def _completion(self, seq: SequenceState, index: int, stream: bool) -> CompletionOutput | None:
        if stream:
            if seq.final_sent:
                return None
            text = seq.detokenizer.get_next_delta() if seq.detokenizer else ""
            token_ids = seq.token_ids[seq.num_sent_tokens :]
            logprobs = seq.logprobs[seq.num_sent_tokens :] if seq.logprobs is not None else None
            if not text and not token_ids and not seq.finished:
                return None
            seq.num_sent_tokens = len(seq.token_ids)
            seq.final_sent = seq.finished
        else:
            text = seq.detokenizer.output_text if seq.detokenizer else ""
            token_ids = list(seq.token_ids)
            logprobs = seq.logprobs
        if seq.params.logprobs is None:
            logprobs = None
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            error=seq.error,
        )
