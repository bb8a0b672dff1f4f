"""Front-end request preparation: tokenize, validate, resolve defaults.

This is the edge where a request is checked against the model (vocabulary, max_model_len,
tokenizer); SamplingParams check themselves on construction. What is left to the engine core
is what only it knows: whether the KV cache and max_num_seqs can ever hold the request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

from pagedllm.config import LoRAConfig, RequestLimits
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.errors import InvalidRequestError
from pagedllm.lora.peft import read_adapter_config
from pagedllm.lora.request import LoRAError, LoRARequest
from pagedllm.config.embedder import EmbedderConfig
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = Union[str, Sequence[int], Mapping[str, Any]]
"""A string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}."""


class InputProcessor:
    """Turns (request id, prompt, params) into a complete EngineCoreRequest, or InvalidRequestError."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: Sequence[int],
                 limits: RequestLimits | None = None, scheduling_policy: str = "fcfs",
                 lora_config: LoRAConfig | None = None, embedder: EmbedderConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.embedder = embedder
        """The model's pooling: pooling requests only (runner 'pooling'), or both kinds (`generates`, runner
        'both'); None: generation requests only."""
        self.lora_config = lora_config
        """Adapters a request may name (None: LoRA is off, a lora_request is refused)."""
        self._checked_loras: dict[LoRARequest, None] = {}
        self._lora_ids: dict[int, LoRARequest] = {}
        """Each adapter id's request, as first checked: one id never names two adapters."""
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.limits = limits if limits is not None else RequestLimits()
        self._grammars = None  # a GrammarCache of validated structured_outputs, made at the first one
        self.num_structured_requests = 0

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text if any, token ids)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of ints)")
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; give the prompt as token ids")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("the prompt is not valid Unicode (it contains a lone surrogate)") from None
        return self.tokenizer.encode(text)

    def process(self, req_id: str, prompt: PromptType, params: SamplingParams,
                cache_salt: str | None = None, priority: int = 0,
                lora_request: LoRARequest | None = None, num_prompts: int = 1) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize; returns (prompt text if any, the request for the core).

        Raises InvalidRequestError naming what is wrong. With n > 1 the one request stands for
        all sequences (`SamplingParams.sequence_req_ids`). `num_prompts`: as in `check_limits`.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if self.embedder is not None and not self.embedder.generates:
            raise InvalidRequestError("this model is served for embeddings (runner 'pooling'): it does not "
                                      "generate; ask for embeddings (LLM.embed, POST /v1/embeddings) instead")
        self.check_limits(params, num_prompts)
        self.check_priority(priority)
        self.check_structured_outputs(params)
        self.check_lora(lora_request)
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        limit = self.limits.max_prompt_logprobs_positions
        if params.prompt_logprobs is not None and len(token_ids) > limit:
            raise InvalidRequestError(
                f"prompt_logprobs was asked for a prompt of {len(token_ids)} tokens; the limit "
                f"max_prompt_logprobs_positions is {limit}"
            )
        self.check_token_ids(token_ids, "prompt")
        self.check_token_ids(params.token_ids_to_check(), "stop_token_ids/logit_bias")
        num_prompt = len(token_ids)
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; max_model_len is {self.max_model_len}, which must leave "
                f"room for at least one generated token"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} exceeds "
                f"max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens"
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this request may generate"
            )
        return text, EngineCoreRequest(
            req_id=req_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            cache_salt=cache_salt,
            priority=priority,
            lora_request=lora_request,
        )

    def process_pooling(self, req_id: str, prompt: PromptType, params: PoolingParams,
                        cache_salt: str | None = None, priority: int = 0,
                        prompt_name: str | None = None, text_pair: str | None = None) -> tuple[str | None, EngineCoreRequest]:
        """An embedding request for the core, tokenized as sentence-transformers does (the model's prompt
        prefix, lower-casing, the tokenizer's special tokens); InvalidRequestError naming what is wrong.
        With `text_pair`, a cross-encoder's pair (`prompt`, `text_pair`), tokenized as one input with its
        token types.

        A prompt longer than the model takes (max_model_len, and the model's max_seq_length) is refused
        unless `params.truncate_prompt_tokens` asks to keep its last tokens (-1: as many as fit)."""
        embedder = self.embedder
        if embedder is None:
            raise InvalidRequestError("this model is served for generation only (runner 'generate'); start it "
                                      "with runner='pooling' (--runner pooling) to compute embeddings or scores, "
                                      "or runner='both' (--runner both) for a decoder to do both")
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"pooling params must be PoolingParams, got {type(params).__name__}")
        if text_pair is None and embedder.score_activation is not None:
            raise InvalidRequestError("this model is a cross-encoder: it scores text pairs (LLM.score, LLM.rerank, "
                                      "POST /v1/score, /v1/rerank) and does not embed")
        if text_pair is not None:
            return self._process_pair(req_id, prompt, text_pair, params, cache_salt, priority)
        self.check_priority(priority)
        try:
            embedder.check_dimensions(params.dimensions)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if prompt_name is None:
            prompt_name = embedder.default_prompt_name
        elif prompt_name not in embedder.prompts:
            raise InvalidRequestError(f"prompt_name {prompt_name!r} is not one of this model's prompts "
                                      f"{sorted(embedder.prompts)}")
        prefix = embedder.prompts.get(prompt_name, "") if prompt_name is not None else ""
        if isinstance(prompt, str):
            text = prefix + prompt
            token_ids = self._encode(text.lower() if embedder.do_lower_case else text)
        else:
            text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the input is empty; give at least one token")
        self.check_token_ids(token_ids, "input")
        limit = self.max_model_len if embedder.max_seq_length is None else min(self.max_model_len,
                                                                                embedder.max_seq_length)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            if keep > limit:
                raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) exceeds the {limit} tokens this model "
                                          f"takes")
            token_ids = token_ids[-(limit if keep == -1 else keep):]
        elif len(token_ids) > limit:
            raise InvalidRequestError(f"the input has {len(token_ids)} tokens; this model takes at most {limit}; "
                                      f"shorten it or set truncate_prompt_tokens")
        params = dataclasses.replace(params, needs_every_position=embedder.needs_every_position)
        return text, EngineCoreRequest(req_id=req_id, prompt_token_ids=token_ids, sampling_params=_NO_SAMPLING,
                                       eos_token_ids=(), max_tokens=0, cache_salt=cache_salt, priority=priority,
                                       pooling_params=params)

    def _process_pair(self, req_id: str, text: str, text_pair: str, params: PoolingParams, cache_salt: str | None,
                      priority: int) -> tuple[str | None, EngineCoreRequest]:
        if self.embedder.score_activation is None:
            raise InvalidRequestError("this model is an embedder, not a cross-encoder: it does not score text pairs")
        if not isinstance(text, str) or not isinstance(text_pair, str):
            raise InvalidRequestError("a scored pair is two strings")
        if params.truncate_prompt_tokens is not None or params.dimensions is not None:
            raise InvalidRequestError("a scored pair takes neither truncate_prompt_tokens nor dimensions")
        self.check_priority(priority)
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; it cannot score text pairs")
        encoded = self.tokenizer(text, text_pair)
        token_ids = list(encoded["input_ids"])
        limit = self.max_model_len if self.embedder.max_seq_length is None else min(
            self.max_model_len, self.embedder.max_seq_length)
        if len(token_ids) > limit:
            raise InvalidRequestError(f"the pair has {len(token_ids)} tokens; this model takes at most {limit}")
        types = encoded.get("token_type_ids")
        params = dataclasses.replace(params, needs_every_position=True,
                                     token_type_ids=list(types) if types is not None and any(types) else None)
        return text, EngineCoreRequest(req_id=req_id, prompt_token_ids=token_ids, sampling_params=_NO_SAMPLING,
                                       eos_token_ids=(), max_tokens=0, cache_salt=cache_salt, priority=priority,
                                       pooling_params=params)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Refuse an adapter this engine cannot serve (LoRAError naming why); its config is read once."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if lora_request in self._checked_loras:
            return
        if self.lora_config is None:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} was asked for, but LoRA is not enabled; "
                            f"start the engine with enable_lora (--enable-lora)")
        known = self._lora_ids.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise LoRAError(f"lora_int_id {lora_request.lora_int_id} already names adapter {known.lora_name!r} at "
                            f"{known.lora_path!r}; give {lora_request.lora_name!r} another id")
        if not isinstance(lora_request.lora_int_id, int) or lora_request.lora_int_id < 1:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r}: lora_int_id must be an integer >= 1, "
                            f"got {lora_request.lora_int_id!r}")
        read_adapter_config(lora_request.lora_path, self.lora_config.max_lora_rank)
        self._checked_loras[lora_request] = None
        self._lora_ids[lora_request.lora_int_id] = lora_request

    def check_limits(self, params: SamplingParams, num_prompts: int = 1) -> None:
        """Refuse params beyond the engine's RequestLimits, naming the limit (InvalidRequestError).

        `num_prompts`: a request with several prompts (the OpenAI API allows a list) runs
        max(n, best_of) sequences for each; the server checks the whole request with it once.
        """
        limits = self.limits
        num_sequences = num_prompts * params.num_sequences
        if num_sequences > limits.max_sequences_per_request:
            raise InvalidRequestError(
                f"this request would generate {num_sequences} sequences ({num_prompts} prompt(s) x "
                f"max(n, best_of) = {params.num_sequences}); the limit max_sequences_per_request is "
                f"{limits.max_sequences_per_request}"
            )
        _check_count("stop_token_ids", len(params.stop_token_ids), "max_stop_token_ids", limits.max_stop_token_ids)
        _check_count("logit_bias", len(params.logit_bias or ()), "max_logit_bias", limits.max_logit_bias)
        _check_count("stop", len(params.stop), "max_stop_strings", limits.max_stop_strings)
        longest = max((len(s) for s in params.stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise InvalidRequestError(f"a stop string has {longest} characters; the limit max_stop_string_chars "
                                      f"is {limits.max_stop_string_chars}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limits.max_logprobs:
                raise InvalidRequestError(f"{name} is {value}; the limit max_logprobs is {limits.max_logprobs}")

    def check_priority(self, priority: int) -> None:
        """A priority is an integer (lower runs sooner), and only means something under the 'priority' policy."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**63 <= priority < 2**63:
            raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority must be 0 when the engine schedules first come, first served (got {priority}); start "
                f"it with --scheduling-policy priority (scheduling_policy='priority') to use request priorities"
            )
    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Refuse a schema, regex or grammar xgrammar cannot build (InvalidRequestError naming why).

        The grammar is built here, where the request is processed (the server's worker threads, never
        its event loop nor the engine's step), and cached by its text, so a repeated schema costs a
        dictionary lookup; the worker compiles it against the vocabulary on its own thread.
        """
        spec = params.structured_outputs
        if spec is None:
            return
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer; this model has none")
        if self._grammars is None:
            from pagedllm.structured.grammar import GrammarCache, build_grammar  # xgrammar only when used

            self._grammars = GrammarCache(build_grammar)
        try:
            self._grammars.get(spec).result()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        self.num_structured_requests += 1

    def grammar_stats(self) -> tuple[int, int, int]:
        """(structured-output requests accepted, grammar-cache hits, misses) so far, cumulative."""
        if self._grammars is None:
            return self.num_structured_requests, 0, 0
        return self.num_structured_requests, self._grammars.hits, self._grammars.misses

    def check_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"{what} contains token id {t!r}, outside the vocabulary [0, {self.vocab_size})"
                )


_NO_SAMPLING = SamplingParams(max_tokens=1)
"""What a pooling request carries where a generation request has its sampling: it samples nothing."""


def _check_count(field: str, count: int, limit_name: str, limit: int) -> None:
    if count > limit:
        raise InvalidRequestError(f"{field} has {count} entries; the limit {limit_name} is {limit}")
