"""Incremental detokenization and stop strings, run in the front end per request.

Decoding the whole sequence at every step costs O(length) per token. Instead each update decodes a
small window of ids with two offsets (the technique of Hugging Face's text streamer and vLLM):

    token_ids:  [ ... already emitted ... | prefix ... | read ... new ids ]
                                          ^ prefix_offset   ^ read_offset

    prefix_text = decode(ids[prefix_offset:read_offset])   text already emitted, decoded in context
    window_text = decode(ids[prefix_offset:])              the same plus the new ids

The new text is `window_text[len(prefix_text):]`. Decoding a few tokens of context keeps what a
token's text depends on its neighbours (sentencepiece's leading "▁" space, byte-level BPE pieces of
one UTF-8 character) the same as in the full decode. When the window ends with U+FFFD, the last
character is still incomplete: nothing is emitted and the offsets stay put until more ids arrive (or
`finish()` flushes it). After an emission the window slides: prefix_offset <- read_offset,
read_offset <- len(token_ids), so each id is decoded in at most two updates' windows: amortized
O(new ids) per update.

The emitted text therefore equals `tokenizer.decode(token_ids, skip_special_tokens=...)` of the
generated ids alone (the prompt is not used as decoding context, so a sentencepiece tokenizer drops
the first generated token's leading space exactly like `decode` does).
"""

from __future__ import annotations

import functools

from pagedllm.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(text: str, stop: list[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in `text` that begins at or after `start`.

    Returns (index, stop string), or None. Among stop strings matching at the same index, the first
    listed wins.
    """
    best: tuple[int, str] | None = None
    for s in stop:
        index = text.find(s, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, s)
    return best


def check_stop_strings(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Look for a stop string that ends inside the last `num_new_chars` characters of `text`.

    Only the new characters plus (longest stop string - 1) characters before them are searched: an
    earlier match would have been found by an earlier call. Returns (matched stop string, length to
    cut `text` to), or None when nothing matched.
    """
    if not stop or num_new_chars <= 0:
        return None
    max_len = max(len(s) for s in stop)
    start = max(0, len(text) - num_new_chars - (max_len - 1))
    match = find_stop_string(text, stop, start)
    if match is None:
        return None
    index, s = match
    return s, index + len(s) if include_stop_str_in_output else index


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a few ids at a time, and checks stop strings.

    `update()` once per step with the step's new ids; `finish()` when the request ends for any other
    reason (length, eos, stop token, abort) to flush text held back for an incomplete character;
    `get_next_delta()` for what to stream.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        """Kept for callers; not used as decoding context (see the module docstring)."""
        self.params = params
        self.token_ids: list[int] = []
        """Generated token ids, all of them (a stop string never removes ids)."""
        self.output_text = ""
        """Stable text so far; after a stop string, the final text (cut before or after the stop)."""
        self.stop_reason: str | None = None
        """The stop string that ended the request, if one did."""
        self.finished = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._num_sent_chars = 0
        self._stop = list(params.stop)
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        # Streaming holds back this many characters: they might turn out to begin a stop string
        # that the caller must not see. Not needed when the stop string stays in the output.
        if self._stop and not params.include_stop_str_in_output:
            self._stop_buffer_len = max(len(s) for s in self._stop) - 1
        else:
            self._stop_buffer_len = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids, extend `output_text` by the newly stable text, check stop strings.

        Returns the matched stop string (and marks the detokenizer finished; `output_text` is then
        cut before it, or just after it with include_stop_str_in_output), else None. Stop strings are
        checked only once more than `min_tokens` ids have been generated, like stop token ids.
        Ids arriving after the detokenizer finished (a step already in flight when a stop string
        ended the request) are ignored.
        """
        if self.finished or not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if window_text.endswith(_REPLACEMENT_CHAR) or len(window_text) <= len(self._prefix_text):
            # An incomplete character at the end, or no visible text yet: wait for more ids.
            return None
        return self._emit(window_text)

    def finish(self) -> str | None:
        """Flush held-back text (an incomplete character stays as U+FFFD, like `decode`); mark finished.

        Returns a stop string if the flushed text contained one (the caller should then report the
        request as stopped by it), else None. Idempotent.
        """
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
        """Text added since the last call, for streaming.

        While the request runs, the last (longest stop string - 1) characters are held back, since
        a later stop string may start within them and cut them away; `finish()` or a stop releases
        them.
        """
        end = len(self.output_text)
        if not self.finished:
            end = max(self._num_sent_chars, end - self._stop_buffer_len)
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def _emit(self, window_text: str) -> str | None:
        new_text = window_text[len(self._prefix_text) :]
        self.output_text += new_text
        # Slide the window: the ids just emitted become the next update's decoding context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        return self._check_stop(len(new_text))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self._stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        result = check_stop_strings(
            self.output_text, num_new_chars, self._stop, self.params.include_stop_str_in_output
        )
        if result is None:
            return None
        stop, cut = result
        self.output_text = self.output_text[:cut]
        self.stop_reason = stop
        self.finished = True
        return stop


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
