"""Turns engine-core outputs into RequestOutputs: text, stop strings, logprobs, n > 1.

A stop string is found here, in the front end; the request is then reported finished and its id returned so the
caller aborts it in the core, freeing its blocks.

Text is made a few ids at a time (`IncrementalDetokenizer`, as Hugging Face's text streamer and vLLM do): each
update decodes a small window of ids, not the whole sequence (O(length) per token), with two offsets:

    token_ids:  [ ... already emitted ... | prefix ... | read ... new ids ]
                                          ^ prefix_offset   ^ read_offset

The new text is decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]: a few ids of context
keep a token's text as in the full decode (sentencepiece's leading "▁" space, byte-level BPE pieces of one UTF-8
character). A window ending with U+FFFD ends in an incomplete character: nothing is emitted until more ids arrive
(or `finish()` flushes it). After an emission the window slides (prefix_offset <- read_offset, read_offset <-
len(token_ids)), so each id is decoded in at most two windows. The text equals `tokenizer.decode` of the generated
ids alone (not the prompt: a sentencepiece tokenizer drops the first token's leading space, as `decode` does).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

from pagedllm.core.request import EngineCoreRequest
from pagedllm.core.sched_output import EngineCoreOutput, TokenLogprobs
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
        seq_req_ids = request.sampling_params.sequence_req_ids(request.req_id)
        if request.req_id in self.requests or any(s in self.seq_to_request for s in seq_req_ids):
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        params = request.sampling_params
        # best_of ranks sequences by cumulative logprob even when no logprobs are returned
        keep_logprobs = params.logprobs is not None or (params.best_of or 1) > params.n
        keep_logprobs = keep_logprobs or params.use_beam_search  # a beam's cumulative logprob is its score
        sequences = [
            SequenceState(seq_req_id, index, params,
                          IncrementalDetokenizer(self.tokenizer, params)
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
        return entry[0].request.req_id if entry is not None else None

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
            touched[state.request.req_id] = state
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
                self.requests.pop(state.request.req_id, None)
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
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
            result[token_id] = Logprob(logprob, rank, text)
        return result

    def _append_prompt_logprobs(self, state: RequestState, entries) -> None:
        for entry in entries:
            if len(state.prompt_logprobs) >= len(state.request.prompt_token_ids):
                return  # a recomputed (preempted) prompt repeats what was already sent
            state.prompt_logprobs.append(None if entry is None else self._to_logprobs_dict(entry))

    def _make_request_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        if state.request.pooling_params is not None:  # one output, when finished
            seq = state.sequences[0]
            return PoolingRequestOutput(state.request.req_id, state.request.prompt_token_ids, seq.pooled, True,
                                        seq.error, state.num_cached_tokens) if state.finished else None
        params = state.request.sampling_params
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
            request_id=state.request.req_id, prompt=state.prompt, prompt_token_ids=state.request.prompt_token_ids,
            outputs=completions, finished=state.finished, prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics={"arrival_time": state.request.arrival_time, "first_token_time": state.first_token_time or 0.0})

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
        return CompletionOutput(index=index, text=text, token_ids=token_ids, cumulative_logprob=seq.cumulative_logprob,
                                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                error=seq.error)


# --- text: incremental detokenization and stop strings ---------------------------------------------------------

_REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(text: str, stop: list[str], start: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text` beginning at or after `start` (at the same
    index the first listed wins), or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        index = text.find(s, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, s)
    return best


def check_stop_strings(text: str, num_new_chars: int, stop: list[str],
                       include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """(stop string, length to cut `text` to) for a stop string ending in the last `num_new_chars` characters,
    or None. Only those plus (longest stop string - 1) characters before them are searched: an earlier
    match would have been found by an earlier call."""
    if not stop or num_new_chars <= 0:
        return None
    match = find_stop_string(text, stop, max(0, len(text) - num_new_chars - (max(len(s) for s in stop) - 1)))
    if match is None:
        return None
    index, s = match
    return s, index + len(s) if include_stop_str_in_output else index


class IncrementalDetokenizer:
    """One sequence's generated ids as text, and its stop strings (the module docstring says how).

    `update()` once per step with the step's new ids; `finish()` when the request ends for any other reason
    (length, eos, stop token, abort) to flush text held back for an incomplete character; `get_next_delta()`
    for what to stream.
    """

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.params = params
        self.token_ids: list[int] = []
        """Generated token ids, all of them (a stop string never removes ids)."""
        self.output_text = ""
        """Stable text so far; after a stop string, the final text (cut before or after the stop)."""
        self.stop_reason: str | None = None
        """The stop string that ended the request, if one did."""
        self.finished = False
        self._prefix_offset = self._read_offset = self._num_sent_chars = 0
        self._prefix_text = ""
        self._stop = list(params.stop)
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        # Streaming holds back this many characters: they might begin a stop string the caller must not see.
        hold_back = self._stop and not params.include_stop_str_in_output
        self._stop_buffer_len = max(len(s) for s in self._stop) - 1 if hold_back else 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids, extend `output_text` by the newly stable text, check stop strings.

        Returns the matched stop string (the detokenizer is then finished, `output_text` cut before it, or
        just after it with include_stop_str_in_output), else None. Stop strings count only once more than
        `min_tokens` ids were generated, like stop token ids. Ids arriving once finished (a step in flight
        when a stop string ended the request) are ignored.
        """
        if self.finished or not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if window_text.endswith(_REPLACEMENT_CHAR) or len(window_text) <= len(self._prefix_text):
            return None  # an incomplete character at the end, or no visible text yet: wait for more ids
        return self._emit(window_text)

    def finish(self) -> str | None:
        """Flush held-back text (an incomplete character stays as U+FFFD, like `decode`); mark finished.
        Returns a stop string the flushed text contained (the request stopped by it), else None. Idempotent."""
        if self.finished:
            return self.stop_reason
        stop = None
        if self._read_offset < len(self.token_ids):
            window_text = self._decode(self.token_ids[self._prefix_offset :])
            if len(window_text) > len(self._prefix_text):
                stop = self._emit(window_text)
        self.finished = True
        return stop

    def get_next_delta(self) -> str:
        """Text added since the last call, for streaming. While the request runs, the last (longest stop
        string - 1) characters are held back: a later stop string may start within them and cut them away."""
        end = len(self.output_text)
        if not self.finished:
            end = max(self._num_sent_chars, end - self._stop_buffer_len)
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    def _emit(self, window_text: str) -> str | None:
        new_text = window_text[len(self._prefix_text) :]
        self.output_text += new_text
        # Slide the window: the ids just emitted become the next update's decoding context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        if not self._stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        result = check_stop_strings(self.output_text, len(new_text), self._stop, self.params.include_stop_str_in_output)
        if result is None:
            return None
        self.stop_reason, cut = result
        self.output_text = self.output_text[:cut]
        self.finished = True
        return self.stop_reason


def _decoder(tokenizer, skip_special_tokens: bool):
    """`ids -> tokenizer.decode(ids, skip_special_tokens=...)`, through the Rust tokenizer directly when
    that is provably the same function: a transformers fast tokenizer whose decode is not overridden
    and that cleans up no spaces. Every step decodes two short windows per request, and transformers'
    Python wrapper around the Rust call costs more than the call itself (about 12 vs 5 us)."""
    backend = _plain_fast_backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def _plain_fast_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` when its decode is exactly the backend's, else None."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the wrapper
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (not isinstance(backend, Tokenizer) or not isinstance(tokenizer, TokenizersBackend)
            or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return backend
