"""Request bodies of the OpenAI-compatible API (pydantic), and how they become SamplingParams.

Field names and defaults follow OpenAI's API; the extras (top_k, min_p, ...) follow vLLM.
Range checks that SamplingParams already makes are left to it, so each rule lives once;
only bounds SamplingParams has no notion of (n, best_of, seed, list lengths) are here.
Chat messages follow OpenAI's per-role rules (entrypoints/chat.py).

Where OpenAI's API refuses more, this server follows vLLM on purpose: up to 64 stop strings
(OpenAI: 4), completion logprobs up to 20 (OpenAI: 5), best_of up to 64 (OpenAI: 20),
temperature up to 100 (OpenAI: 2). Where it refuses more than OpenAI: n up to 64 (OpenAI: 128),
top_p above 0, and what it cannot serve (images, the deprecated functions; see entrypoints/chat.py).
Tools: see tools.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from pagedllm.entrypoints.chat import ChatMessage, check_tool_history
from pagedllm.entrypoints.openai.tools import NamedToolChoice, ToolDefinition, check_tools
from pagedllm.errors import InvalidRequestError
from pagedllm.request_limits import MAX_N, MAX_PROMPTS
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LENGTH_PENALTY = 10.0
"""Largest |length_penalty|: a beam's score divides by length ** length_penalty, which at 1e308 overflowed
(and at -1e5 underflowed to a division by zero) inside the engine core and killed it. 10 is far past any
useful value (HF's examples use 0.6 to 2) and keeps length ** 10 finite for any context length."""
_INT64 = 2**63 - 1


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (as vLLM does); a field of the wrong type is a 400.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class SamplingFields(OpenAIModel):
    """The sampling fields both endpoints share."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: int = 0
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Optional[str] = Field(None, max_length=256)
    priority: int = Field(0, ge=-_INT64 - 1, le=_INT64)
    """vLLM's extra: lower runs sooner; needs a server started with --scheduling-policy priority."""
    # beam search, as vLLM: max(n, best_of) beams, the best n returned, each beam's text once final
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: Union[bool, Literal["never"]] = False
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format or structured_outputs as StructuredOutputsParams (None: free text).

        OpenAI's json_schema is always enforced (as if strict were true): a constraint the sampler
        applies costs nothing extra to apply fully."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if self.structured_outputs is not None:
                raise InvalidRequestError("give either response_format or structured_outputs, not both")
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError("response_format of type json_schema needs json_schema.schema")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        so = self.structured_outputs
        if so is None:
            return None
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object)

    def make_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                             model_defaults: Mapping[str, Any] | None = None, **extra: Any) -> SamplingParams:
        """Build validated SamplingParams; a bad value raises InvalidRequestError naming it. A sampling field
        the body leaves out takes the model's generation-config value (`model_defaults`), else OpenAI's."""
        # Beam search is greedy over the raw logprobs: a model's sampling defaults do not apply to it.
        model_defaults = {} if self.use_beam_search or not model_defaults else model_defaults
        logit_bias = None
        if self.logit_bias:
            logit_bias = {}
            for key, bias in self.logit_bias.items():
                try:
                    logit_bias[int(key)] = bias
                except ValueError:
                    raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}") from None
        top_k = self.top_k if self.top_k is not None else model_defaults.get("top_k")
        if top_k is not None and top_k in (0, -1):
            top_k = None  # vLLM's "disabled"
        if self.use_beam_search:  # greedy by nature: an unset temperature means 0, not OpenAI's 1
            extra.update(use_beam_search=True, length_penalty=self.length_penalty, early_stopping=self.early_stopping)
        default_temperature = 0.0 if self.use_beam_search else model_defaults.get("temperature", 1.0)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options must be left out unless stream is true (as OpenAI's API says)")
        try:
            structured_outputs = self.structured_outputs_params()
            if structured_outputs is not None and self.min_tokens:
                # the grammar's end allows only EOS, which min_tokens forbids: no token would be left to sample
                raise InvalidRequestError("min_tokens must be 0 with structured outputs (response_format or "
                                          "structured_outputs): a constrained output ends with EOS when its "
                                          "grammar is complete")
            return SamplingParams(
                n=self.n,
                best_of=extra.pop("best_of", None),
                temperature=default_temperature if self.temperature is None else self.temperature,
                top_p=model_defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
                top_k=top_k,
                min_p=model_defaults.get("min_p", 0.0) if self.min_p is None else self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(model_defaults.get("repetition_penalty", 1.0) if self.repetition_penalty is None
                                    else self.repetition_penalty),
                logit_bias=logit_bias,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured_outputs,
                **extra,
            )
        except (ValueError, TypeError, OverflowError) as e:  # whatever a hostile value trips, it is a 400
            raise InvalidRequestError(str(e)) from None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: Optional[int] = 16
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt):
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
        elif not prompt:
            raise ValueError("the prompt list is empty")
        elif isinstance(prompt[0], list) and any(not p for p in prompt):
            raise ValueError("a token-id prompt is empty")
        elif isinstance(prompt[0], str) and any(not p for p in prompt):
            raise ValueError("a prompt string is empty")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def to_sampling_params(self, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.stream and self.best_of is not None and self.best_of > self.n and not self.use_beam_search:
            raise InvalidRequestError("best_of > n cannot be streamed; set stream to false")
        return self.make_sampling_params(
            self.max_tokens, self.logprobs, model_defaults, best_of=self.best_of,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: bool = True
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    # vLLM's extras: a template (and variables for it) from the request, refused unless the server trusts them
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    _tool_grammar: Optional[str] = PrivateAttr(None)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value, info):
        if value and value != "none":  # an empty list asks for nothing
            raise ValueError(f"{info.field_name} is not supported (OpenAI deprecated it): use tools and tool_choice")
        return value

    @model_validator(mode="after")
    def _tools_and_history(self) -> ChatCompletionRequest:
        check_tool_history(self.messages)
        if self.tools or self.tool_choice is not None:  # else no tools are in play: nothing to check
            self.tool_choice = check_tools(self.tools, self.tool_choice)
        return self

    @property
    def named_tool_choice(self) -> NamedToolChoice | None:
        return self.tool_choice if isinstance(self.tool_choice, NamedToolChoice) else None

    def set_grammar(self, grammar: str | None, forced_call: bool) -> None:
        """Generate under `grammar` (EBNF: tool calls, reasoning then an answer) instead of response_format or
        structured_outputs, which a forced call refuses and the other grammars have folded in already."""
        if grammar is None:
            return
        if forced_call and (self.response_format is not None and self.response_format.type != "text"
                       or self.structured_outputs is not None):
            field = "response_format" if self.structured_outputs is None else "structured_outputs"
            raise InvalidRequestError(f"{field} must be left out when tool_choice forces a call (required or a "
                                      f"named function): the answer is the call, in the tool-call format")
        if self.min_tokens:
            raise InvalidRequestError("min_tokens must be 0 with tools constrained by a grammar (tool_choice "
                                      "required, named, or auto with --tool-call-parser hermes): it ends with EOS")
        self._tool_grammar = grammar

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        if self._tool_grammar is not None:
            return StructuredOutputsParams(grammar=self._tool_grammar)
        return super().structured_outputs_params()

    def to_sampling_params(self, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.make_sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, model_defaults)


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[ToolDefinition]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]
