"""POST /v1/embeddings (OpenAI's shape, vLLM's extras) over a model served with runner 'pooling'.

`input`: a string, a list of strings, a list of token ids, or a list of token-id lists; each one
becomes one engine request, batched with the rest. `encoding_format` 'base64' is the little-endian
float32 bytes OpenAI's clients decode. `dimensions`: Matryoshka models only. `truncate_prompt_tokens`
(vLLM): keep a too-long input's last k tokens instead of refusing it.
"""

from __future__ import annotations

import base64
from typing import Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import StrictInt

from pagedllm.entrypoints.openai.serving import ServingContext, final_outputs, new_id, open_streams
from pagedllm.entrypoints.openai.errors import APIError, internal_error
from pagedllm.entrypoints.openai.protocol import OpenAIModel
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

MAX_EMBEDDING_INPUTS = 2048
"""Most inputs in one /v1/embeddings request (OpenAI's own limit)."""


class EmbeddingRequest(OpenAIModel):
    model: Optional[str] = None
    # strict: a token id is a JSON integer (true, 1.0 or "1" is a 400, not token 1)
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    priority: int = 0
    cache_salt: Optional[str] = None

    def inputs(self) -> list[str | list[int]]:
        """`input` as a list of inputs (text or token ids)."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)

    def to_pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(dimensions=self.dimensions, truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


def add_embedding_routes(app: FastAPI, ctx: ServingContext, body, require_engine) -> None:
    """Register POST /v1/embeddings; `body` reads and validates a request body, `require_engine` 503s."""

    @app.post("/v1/embeddings")
    async def embeddings(raw_request: Request):
        require_engine()
        request = await body(raw_request, EmbeddingRequest)
        return await create_embedding(request, raw_request, ctx)


async def create_embedding(request: EmbeddingRequest, raw_request: Request, ctx: ServingContext) -> JSONResponse:
    """Serve one /v1/embeddings request (validated body)."""
    model = ctx.check_model(request.model)
    inputs = request.inputs()
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"input has {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} are allowed",
                       param="input")
    empty = next((i for i, item in enumerate(inputs) if len(item) == 0), None)
    if empty is not None:  # refused as OpenAI does, whatever the tokenizer would add to an empty text
        where = "input" if isinstance(request.input, str) else f"input[{empty}]"
        kind = "an empty string" if isinstance(inputs[empty], str) else "an empty list of token ids"
        raise APIError(400, f"{where} is {kind}; give a non-empty text or at least one token id", param="input")
    params = request.to_pooling_params()
    salt = ctx.cache_salt(raw_request, request.cache_salt)
    streams = await open_streams(ctx, new_id("embd"), inputs, params, salt, False, request.priority)
    outputs = await final_outputs(raw_request, streams)
    return await ctx.engine.run_blocking(_response, ctx, request, outputs, model)


def _response(ctx: ServingContext, request: EmbeddingRequest, outputs: list[PoolingRequestOutput],
              model: str) -> JSONResponse:
    data, num_prompt = [], 0
    for index, output in enumerate(outputs):
        if output.data is None:
            raise internal_error(output.error or "the embedding request ended without a vector")
        num_prompt += len(output.prompt_token_ids)
        vector = output.data
        if request.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": vector})
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}})
