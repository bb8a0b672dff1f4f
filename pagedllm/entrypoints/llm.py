"""The offline API: `LLM(model).generate(prompts, params)`, everything in one process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams, score_pairs
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

ChatMessages = list[dict[str, str]]


class LLM:
    """Generate for a batch of prompts with continuous batching.

        llm = LLM()                      # the embedded SmolLM2-135M-Instruct
        outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
        print(outputs[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without any gets: the model's sampling defaults (temperature, top_p, top_k,
        min_p, repetition_penalty; see ``generation_config``) over SamplingParams' own defaults."""
        return self.engine.default_sampling_params()

    def kv_cache_snapshot(self):
        """The KV block pool and the queues now: a KVMapMsg (engine/protocol.py), as the server's /dashboard
        draws it. Between `generate` calls the pool is idle (only cached prefixes remain); to catch it busy,
        take one from a step listener: `llm.engine.core.step_listeners.append(lambda *_: ...)`."""
        return self.engine.core.kv_map()

    def kv_cache_stats(self):
        """The KV occupancy gauges now (KVCacheStats: used / cached / empty blocks, filled slots, sharing, swap)."""
        return self.engine.core.kv_cache_manager.kv_stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        `priority`: one integer per prompt, lower runs sooner (needs scheduling_policy='priority').
        `lora_request`: the LoRA adapter to generate with (needs enable_lora), one for all prompts or one
        per prompt (None: the base model).
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:  # the model's sampling defaults (generation_config), else SamplingParams'
            sampling_params = self.engine.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        return self._run(prompts, params_list, use_tqdm, priorities, loras)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None, prompt_name: str | None = None,
              use_tqdm: bool = False) -> list[list[float]]:
        """One embedding per prompt (a text, token ids, or a list of either), in input order, equal to
        sentence-transformers' `encode` on the same model (needs runner='pooling'; docs/embeddings.md).

        `truncate_prompt_tokens`: keep a too-long input's last k tokens (-1: as many as the model takes)
        instead of refusing it. `dimensions`: a Matryoshka model's leading values, renormalized.
        `prompt_name`: one of the model's prompts put before each text (default: its default_prompt_name).
        """
        prompts = _as_prompt_list(prompts)
        params = PoolingParams(dimensions=dimensions, truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = self._run_requests(
            [lambda request_id, p=p: self.engine.add_pooling_request(request_id, p, params, prompt_name=prompt_name)
             for p in prompts], use_tqdm, "Embedding", queue_order=_by_length([_length_hint(p) for p in prompts]))
        failed = [o for o in outputs if o.data is None]
        if failed:
            raise RuntimeError(f"embedding request {failed[0].request_id} failed: {failed[0].error}")
        return [o.data for o in outputs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              use_tqdm: bool = False) -> list[float]:
        """A cross-encoder's relevance score of each pair, equal to sentence-transformers'
        `CrossEncoder.predict`: `text_1` against each of `text_2` (one string: against each `text_2`;
        two lists of one length: pairwise)."""
        pairs = score_pairs(text_1, text_2)
        outputs = self._run_requests(
            [lambda request_id, a=a, b=b: self.engine.add_pooling_request(request_id, a, text_pair=b)
             for a, b in pairs], use_tqdm, "Scoring",
            queue_order=_by_length([_length_hint(a) + _length_hint(b) for a, b in pairs]))
        failed = [o for o in outputs if o.data is None]
        if failed:
            raise RuntimeError(f"scoring request {failed[0].request_id} failed: {failed[0].error}")
        return [o.data[0] for o in outputs]

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None) -> list[dict]:
        """The documents by the cross-encoder's score for `query`, best first: {index, relevance_score,
        document} each, the first `top_n` (default all)."""
        scores = self.score(query, list(documents))
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:top_n]
        return [{"index": i, "relevance_score": scores[i], "document": documents[i]} for i in order]

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams | Sequence[BeamSearchParams]):
        """Beam search for every prompt (one params for all, or one per prompt), beams sharing KV blocks;
        a list of BeamSearchOutput in input order.

        Greedy, with Hugging Face `generate(num_beams=...)`'s conventions (pagedllm/core/beam_selection.py).
        Each prompt is an ordinary request to the engine, batched with whatever else it runs;
        `generate()` takes beam search too, per prompt: `SamplingParams(use_beam_search=True, ...)`.
        """
        from pagedllm.engine.beam_search import beam_search

        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return beam_search(self.engine, list(prompts), params)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.encode_chat(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: ChatMessages, add_generation_prompt: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        from pagedllm.entrypoints.chat import render_chat  # the sandbox and budget of the server's chats

        return render_chat(tokenizer, list(messages), add_generation_prompt=add_generation_prompt)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool,
             priorities: list[int] | None = None, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        adds = [lambda request_id, prompt=prompt, params=params, priority=priority, lora=lora: self.engine.add_request(
                    request_id, prompt, params, priority=priority, lora_request=lora)
                for prompt, params, priority, lora in zip(prompts, params_list, priorities or [0] * len(prompts),
                                                          loras or [None] * len(prompts))]
        return self._run_requests(adds, use_tqdm, "Generating")

    def _run_requests(self, adds: list, use_tqdm: bool, desc: str, queue_order: list[int] | None = None) -> list:
        """Queue each request (`add(request_id)`; in `queue_order`, indices into `adds`, when given), step
        until all finish; their final outputs in the order of `adds`."""
        request_ids: list[str | None] = [None] * len(adds)
        try:
            for i in (queue_order if queue_order is not None else range(len(adds))):
                request_id = str(next(self._counter))
                adds[i](request_id)
                request_ids[i] = request_id
        except Exception:
            self.engine.abort_request([r for r in request_ids if r is not None])
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc=desc, disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _length_hint(prompt: PromptType) -> int:
    """A prompt's size before tokenizing: characters of a text, else token ids."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt", ""))
    return len(prompt)


def _by_length(lengths: list[int]) -> list[int]:
    """Indices, shortest first. Pooling requests queued so share steps with inputs of similar length, and an
    encoder's attention groups (model/bert.py) pad little, as sentence-transformers sorts its batches."""
    return sorted(range(len(lengths)), key=lengths.__getitem__)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a text, a dict, a list of token ids) as a list of one; a list of prompts as is."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)

