"""Structured outputs with xgrammar: grammars compiled off the step loop, one matcher per sequence,
and a token bitmask for the rows that need one.

    request arrives in a SchedulerOutput ─► compile its grammar on a background thread
                                            (an LRU of compiled grammars, keyed by the spec's text)
    its first sampling step              ─► wait for the compile; a GrammarMatcher per sequence, fed
                                            the tokens already generated (a request recomputed after
                                            preemption arrives with them)
    every sampling step                  ─► fill_next_token_bitmask, one row per constrained sequence;
                                            the sampler sets the disallowed logits to -inf
    after sampling                       ─► accept_token(sampled token)

When the grammar is complete the mask allows only the end-of-sequence ids, so the request ends
with EOS as any other (ignore_eos is refused with structured outputs for that reason).

The JSON grammars are compact (`any_whitespace=False`: ", " and ": " separators, no free
whitespace): a small model sampled at temperature 1 would otherwise spend its budget on newlines.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""

# xgrammar's C++ errors start with "[HH:MM:SS] /path/file.cc:LINE: " and may say "Check failed: ...".
_NATIVE_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false: )?")


class InvalidGrammarError(ValueError):
    """A structured_outputs spec that cannot be turned into a grammar; the message names why."""


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar Grammar of a spec (parsing, and a search over bytes; no tokenizer: cheap);
    InvalidGrammarError if invalid or if it provably accepts no output at all."""
    kind, text = spec.cache_key()
    try:
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        elif kind == "json_object":
            grammar = xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(text)
        else:  # choice: JSON string escapes are EBNF string escapes too
            grammar = xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                     for c in spec.choice))
        accepts_nothing = _accepts_nothing(grammar)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the native message
        raise InvalidGrammarError(f"invalid {_WHAT[kind]}: {_clean(e)}") from None
    if accepts_nothing:
        raise InvalidGrammarError(f"invalid {_WHAT[kind]}: it accepts no output at all (no string matches it), so "
                                  f"no token could ever be sampled")
    return grammar


_BYTES_VOCAB_SIZE = 257  # the 256 bytes and a stop token
_byte_compiler: xgr.GrammarCompiler | None = None
_byte_compiler_lock = threading.Lock()
_SEARCH_STEPS = 512
"""Matcher steps the emptiness search may take; past them the grammar counts as accepting something."""
_CLOSERS = b'"}])\''
"""Bytes tried first: they tend to finish what is open, so a grammar that accepts something shows it soon."""


def _accepts_nothing(grammar: xgr.Grammar) -> bool:
    """Whether `grammar` provably accepts no string: a depth-first search over single bytes (closing
    bytes first) that finds no way to the end within _SEARCH_STEPS steps and runs out of choices.

    A grammar that accepts nothing (`root ::= root`, the regex `[^\\s\\S]`, a schema whose pattern
    matches nothing) would otherwise reach the sampler with no token allowed: a 500, not a 400."""
    global _byte_compiler
    with _byte_compiler_lock:
        if _byte_compiler is None:
            info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], vocab_type=xgr.VocabType.RAW,
                                     vocab_size=_BYTES_VOCAB_SIZE, stop_token_ids=[256])
            _byte_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = _byte_compiler.compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=_SEARCH_STEPS)
    bitmask = xgr.allocate_token_bitmask(1, _BYTES_VOCAB_SIZE)
    order = list(_CLOSERS) + [b for b in range(256) if b not in _CLOSERS]
    budget = _SEARCH_STEPS

    def allowed() -> list[int]:
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        return [t for t in [256, *order] if (words[t // 32] >> (t % 32)) & 1]

    stack = [allowed()]  # the untried choices at each depth
    while stack:
        if not stack[-1]:
            stack.pop()
            if stack:
                matcher.rollback(1)
            continue
        token = stack[-1].pop(0)
        if token == 256:
            return False  # the end is allowed here: the grammar accepts the path so far
        budget -= 1
        if budget <= 0 or len(stack) >= _SEARCH_STEPS - 1:
            return False  # unknown: do not refuse what may be valid
        if not matcher.accept_token(token):
            continue
        stack.append(allowed())
    return True


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "grammar": "grammar",
         "choice": "choice"}


def _clean(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _NATIVE_PREFIX.sub("", first).strip()


class GrammarCache:
    """An LRU of grammars keyed by the spec's text, made by `make`; counts hits and misses.

    `get` returns a Future: with an executor the work runs there and concurrent requests for the
    same text share one job; without one it runs inline (the future is already done)."""

    def __init__(self, make: Callable[[StructuredOutputsParams], object], capacity: int = GRAMMAR_CACHE_SIZE,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self._make = make
        self.capacity = capacity
        self._executor = executor
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, spec: StructuredOutputsParams) -> Future:
        key = spec.cache_key()
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return future
            self.misses += 1
            if self._executor is not None:
                future = self._executor.submit(self._make, spec)
            else:
                future = Future()
                try:
                    future.set_result(self._make(spec))
                except Exception as e:  # noqa: BLE001 - delivered through the future
                    future.set_exception(e)
            self._entries[key] = future
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return future

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class _Sequence:
    compiled: Future
    """Future[xgr.CompiledGrammar]."""
    eos_token_ids: list[int]
    matcher: xgr.GrammarMatcher | None = None
    num_accepted: int = 0
    """Output tokens the matcher has consumed; compared with the sequence's output to resynchronise."""


def _allow_only(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    bitmask_row.zero_()
    for t in token_ids:
        word = int(bitmask_row[t // 32]) | (1 << (t % 32))
        bitmask_row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 two's complement


class StructuredOutputManager:
    """The worker's grammar state: compiled grammars (shared) and a matcher per constrained sequence."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 max_compile_threads: int = 1) -> None:
        # The logits may be wider than the tokenizer (a padded vocabulary): the mask covers vocab_size.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.device = device
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_compile_threads, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache = GrammarCache(self._compile, executor=self._executor)
        self._sequences: dict[str, _Sequence] = {}

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(build_grammar(spec))

    def add_sequence(self, req_id: str, spec: StructuredOutputsParams, eos_token_ids: list[int]) -> None:
        """Start compiling (or find) the sequence's grammar now: the step loop waits for it only at the
        sequence's first sampling step. A resumed sequence keeps its matcher if it has one."""
        if req_id not in self._sequences:
            self._sequences[req_id] = _Sequence(self.cache.get(spec), sorted(eos_token_ids))

    def drop(self, req_id: str) -> None:
        self._sequences.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._sequences

    def fill_bitmask(self, rows: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, list[int]] | None:
        """For (req_id, output token ids) rows of one step: ([N, ceil(V/32)] int32 bitmask on the
        device, indices of the constrained rows), or None when no row is constrained.

        A matcher behind its sequence's output (new, or recomputed after preemption) is rebuilt by
        accepting the generated tokens; a ValueError names a token the grammar refuses."""
        constrained = [(i, req_id, out) for i, (req_id, out) in enumerate(rows) if req_id in self._sequences]
        if not constrained:
            return None
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        indices = []
        for i, req_id, output in constrained:
            seq = self._sequences[req_id]
            matcher = self._synced_matcher(req_id, seq, output)
            if matcher.is_terminated():  # the grammar ended with EOS already: EOS is all that is left
                _allow_only(bitmask[i], seq.eos_token_ids)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
            indices.append(i)
        return bitmask.to(self.device, non_blocking=True), indices

    def _synced_matcher(self, req_id: str, seq: _Sequence, output: list[int]) -> xgr.GrammarMatcher:
        if seq.matcher is None or seq.num_accepted != len(output):
            try:
                compiled = seq.compiled.result()
            except InvalidGrammarError:
                raise
            except Exception as e:  # noqa: BLE001
                raise InvalidGrammarError(f"the grammar could not be compiled: {_clean(e)}") from None
            seq.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=seq.eos_token_ids or None)
            seq.num_accepted = 0
            for token in output:
                self._accept(req_id, seq, token)
        return seq.matcher

    def accept(self, req_id: str, token: int) -> None:
        """Advance the sequence's matcher past its sampled token (no-op for unconstrained ids)."""
        seq = self._sequences.get(req_id)
        if seq is not None and seq.matcher is not None:
            self._accept(req_id, seq, token)

    @staticmethod
    def _accept(req_id: str, seq: _Sequence, token: int) -> None:
        if seq.matcher.is_terminated() or not seq.matcher.accept_token(token):
            seq.matcher = None  # out of sync: rebuilt from the output at the next step if it continues
            raise ValueError(f"structured output of {req_id}: token {token} is not allowed by the grammar "
                             f"after {seq.num_accepted} tokens")
        seq.num_accepted += 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
