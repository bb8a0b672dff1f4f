"""How one request wants its tokens chosen and when it should stop."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from pagedllm.request_limits import MAX_LOGPROBS, MAX_STOP_STRINGS

MAX_TEMPERATURE = 100.0
"""Beyond this the distribution is uniform to float32 precision: a larger value is a mistake."""
REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""A penalty outside it scales logits by more than 100x: float32 logits overflow or lose all order."""
_SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_CHOICES = 256
"""The most alternatives a `choice` constraint may list."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a request's output to a grammar: set exactly one field.

    Plain data (it crosses the process boundary inside SamplingParams); the grammar itself is
    built (pagedllm.structured.grammar) and compiled on the worker, and validated by the
    front end before the request is queued.
    """

    json: Union[dict[str, Any], str, None] = None
    """A JSON schema (a dict, or its JSON text): the output is a JSON value it validates."""
    regex: str | None = None
    """The output matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """The output is a sentence of this EBNF grammar (xgrammar's GBNF dialect, root rule `root`)."""
    json_object: bool | None = None
    """True: the output is any JSON object (OpenAI's response_format {"type": "json_object"})."""

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", list(self.choice))
        set_fields = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                      if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(set_fields) != 1:
            shown = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
                             f"(got {shown})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice entries must be non-empty strings")
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for text in (self.regex, self.grammar, *(self.choice or ())):
            if text is not None and not _is_valid_unicode(text):
                raise ValueError("structured_outputs must be valid Unicode (it contains a lone surrogate)")

    @property
    def kind(self) -> str:
        """Which constraint: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def cache_key(self) -> tuple[str, str]:
        """(kind, text): grammars are compiled once per key. A schema dict keeps its key order (the
        grammar follows the declared property order), so equal texts mean equal grammars."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        else:
            text = getattr(self, kind) if kind != "json_object" else ""
        return kind, text


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request, validated on construction.

    Defaults follow the OpenAI API and vLLM: temperature 1.0 samples from the model's
    distribution; temperature 0 is greedy.
    """

    n: int = 1
    """Number of sequences to return."""
    best_of: int | None = None
    """Sequences generated before choosing the `n` with the highest cumulative logprob."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int | None = None
    """Keep only the k most likely tokens; None keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens seen in prompt or output."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids before sampling."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens are generated."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; they are cut from the returned text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (kept in token_ids, cut from text when special)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    logprobs: int | None = None
    """Return this many top logprobs per generated token (plus the sampled token's)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token (plus the prompt token's)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    use_beam_search: bool = False
    """Beam search (as vLLM's field): max(n, best_of) beams, the best n returned; greedy, with Hugging
    Face `generate(num_beams=...)`'s conventions (pagedllm/core/beam_selection.py). temperature must be 0."""
    length_penalty: float = 1.0
    """Beam search: a finished beam's score is cumulative logprob / (generated length ** length_penalty)."""
    early_stopping: bool | str = False
    """Beam search: HF's early_stopping, False (heuristic), True or "never"."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict of the same fields is
    accepted too); the request then ends when the grammar does, with EOS."""

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        """Every value must be of its type, finite and in range; the message names the field."""
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None (disabled) or an integer >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if not _is_valid_unicode(s):
                raise ValueError("stop strings must be valid Unicode (a lone surrogate cannot be matched)")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
                if not _is_finite(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be StructuredOutputsParams, "
                                 f"got {type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                # The grammar's end is signalled by EOS: past it no token is allowed at all.
                raise ValueError("structured_outputs cannot be combined with ignore_eos: a constrained output "
                                 "ends with EOS when its grammar is complete")
        if self.use_beam_search is not False:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """Beam search ranks beams by the model's own logprobs: whatever would change them is refused."""
        if self.use_beam_search is not True:
            raise ValueError(f"use_beam_search must be a bool, got {self.use_beam_search!r}")
        if not _is_finite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not any(self.early_stopping is mode or (isinstance(mode, str) and self.early_stopping == mode)
                   for mode in _EARLY_STOPPING_MODES):
            raise ValueError(f"early_stopping must be False, True or 'never', got {self.early_stopping!r}")
        if self.num_sequences > 10:
            raise ValueError(f"beam search takes at most 10 beams (max(n, best_of)), got {self.num_sequences}")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 with use_beam_search (beam search is greedy), got {self.temperature!r}")
        unsupported = {
            "top_p": self.top_p != 1.0, "top_k": self.top_k is not None, "min_p": self.min_p != 0.0,
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens != 0, "stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
            "logprobs > 0": self.logprobs is not None and self.logprobs > 0,
        }
        refused = [name for name, given in unsupported.items() if given]
        if refused:
            raise ValueError(f"use_beam_search does not support {', '.join(refused)} (each beam's chosen-token "
                             f"logprobs are reported with logprobs=0)")

    @property
    def num_sequences(self) -> int:
        """How many sequences are generated (best_of, or n)."""
        return self.best_of if self.best_of is not None else self.n

    def sequence_req_ids(self, req_id: str) -> list[str]:
        """The core request id of each sequence of request `req_id`: `req_id`, or `req_id#i` for n > 1 /
        best_of (beam search: one per returned beam, n). The only place the fan-out is spelled: the front end
        registers these ids, the core creates one Request per id (`Request.for_sequences`)."""
        num_sequences = self.n if self.use_beam_search else self.num_sequences  # beam width: num_sequences
        return [req_id] if num_sequences == 1 else [f"{req_id}#{i}" for i in range(num_sequences)]

    def for_sequence(self, index: int) -> SamplingParams:
        """The params of sequence `index` of an n > 1 / best_of request: one sequence each.

        A seeded request gives each sequence its own seed (seed + index), so the samples differ
        and stay reproducible. best_of ranks by cumulative logprob, so logprobs are computed.
        """
        # A shallow copy, not dataclasses.replace: the validated stop_token_ids and logit_bias are
        # shared by every sequence (never mutated), not copied and re-validated n times.
        params = copy.copy(self)
        params.n, params.best_of = 1, None
        if self.seed is not None:
            params.seed = self.seed + index
        if self.best_of is not None and self.best_of > self.n and self.logprobs is None:
            params.logprobs = 0
        return params

    def token_ids_to_check(self) -> list[int]:
        """Every token id these params mention, to be checked against the vocabulary."""
        ids = list(self.stop_token_ids)
        if self.logit_bias:
            ids.extend(self.logit_bias)
        return ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_finite(value: object) -> bool:
    """A real number, not NaN or infinite (an int too large for a float is not finite either)."""
    if not _is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_range(name: str, value: object, low: float, high: float) -> None:
    if not _is_finite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}")


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_EARLY_STOPPING_MODES = (False, True, "never")


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Parameters of `LLM.beam_search`, validated on construction.

    The defaults reproduce Hugging Face `generate(num_beams=beam_width, do_sample=False)`; see
    `pagedllm/core/beam_selection.py` for the exact conventions (length penalty, early stopping).
    """

    beam_width: int
    """Beams kept alive per prompt (HF `num_beams`); at most 10 (each beam reads 2 x width logprobs)."""
    max_tokens: int = 16
    """Most tokens generated per beam (HF `max_new_tokens`); capped by what max_model_len leaves."""
    length_penalty: float = 1.0
    """A finished beam's score is cumulative logprob / (generated length ** length_penalty)."""
    ignore_eos: bool = False
    """Treat EOS as an ordinary token: no beam finishes before max_tokens (HF: eos_token_id=None)."""
    early_stopping: bool | str = False
    """HF's early_stopping: False (heuristic), True (stop once beam_width beams finished) or "never"."""
    num_return_sequences: int | None = None
    """Finished beams returned per prompt, best first; None returns beam_width."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in [1, 10], got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_finite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not any(self.early_stopping is mode or (isinstance(mode, str) and self.early_stopping == mode)
                   for mode in _EARLY_STOPPING_MODES):
            raise ValueError(f"early_stopping must be False, True or 'never', got {self.early_stopping!r}")
        if self.num_return_sequences is not None and (
            not _is_int(self.num_return_sequences) or not 1 <= self.num_return_sequences <= self.beam_width
        ):
            raise ValueError(
                f"num_return_sequences must be None or an integer in [1, beam_width={self.beam_width}], "
                f"got {self.num_return_sequences!r}"
            )

    @property
    def num_returned(self) -> int:
        return self.num_return_sequences if self.num_return_sequences is not None else self.beam_width
