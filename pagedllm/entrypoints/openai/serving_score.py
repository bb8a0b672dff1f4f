"""POST /v1/score (vLLM's `text_1` / `text_2`) and POST /v1/rerank (Jina's and Cohere's shape) over a
cross-encoder served with runner 'pooling'. Each pair is one engine request; the scores are
sentence-transformers' CrossEncoder.predict (the model's one logit through its activation_fn)."""

from __future__ import annotations

from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.serving import ServingContext, final_outputs, new_id, now_s, open_streams
from pagedllm.entrypoints.openai.errors import APIError, internal_error
from pagedllm.entrypoints.openai.protocol import OpenAIModel
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams, score_pairs

MAX_PAIRS = 1024
"""Most pairs (documents) one request may score."""


class ScoreRequest(OpenAIModel):
    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    priority: int = 0


class RerankRequest(OpenAIModel):
    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: Optional[int] = None
    return_documents: bool = True
    priority: int = 0


def add_score_routes(app: FastAPI, ctx: ServingContext, body, require_engine) -> None:
    """Register POST /v1/score, /v1/rerank (and /rerank, Jina's path)."""

    @app.post("/v1/score")
    async def score(raw_request: Request):
        require_engine()
        request = await body(raw_request, ScoreRequest)
        model = ctx.check_model(request.model)
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as e:
            raise APIError(400, str(e), param="text_1") from None
        outputs = await _score(ctx, raw_request, pairs, request.priority, "text_2")
        return JSONResponse({
            "id": new_id("score"), "object": "list", "created": now_s(), "model": model,
            "data": [{"index": i, "object": "score", "score": o.data[0]} for i, o in enumerate(outputs)],
            "usage": ctx.usage(_num_tokens(outputs), 0)})

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank(raw_request: Request):
        require_engine()
        request = await body(raw_request, RerankRequest)
        model = ctx.check_model(request.model)
        if request.top_n is not None and request.top_n < 1:
            raise APIError(400, f"top_n must be an integer >= 1, got {request.top_n}", param="top_n")
        outputs = await _score(ctx, raw_request, [(request.query, d) for d in request.documents], request.priority,
                               "documents")
        order = sorted(range(len(outputs)), key=lambda i: outputs[i].data[0], reverse=True)[: request.top_n]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": outputs[i].data[0]}
            if request.return_documents:
                result["document"] = {"text": request.documents[i]}
            results.append(result)
        num_tokens = _num_tokens(outputs)
        return JSONResponse({"id": new_id("rerank"), "model": model, "results": results,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def _score(ctx: ServingContext, raw_request: Request, pairs: list[tuple[str, str]],
                 priority: int, field: str) -> list[PoolingRequestOutput]:
    """Score each pair; `field` names the request's list of documents in an error."""
    if not pairs:
        raise APIError(400, f"{field} is empty: there is nothing to score; give at least one document",
                       param=field)
    if len(pairs) > MAX_PAIRS:
        raise APIError(400, f"{field} has {len(pairs)} documents to score; at most {MAX_PAIRS} are allowed",
                       param=field)
    streams = await open_streams(ctx, new_id("score"), pairs, PoolingParams(), None, False, priority)
    outputs = await final_outputs(raw_request, streams)
    for output in outputs:
        if output.data is None:
            raise internal_error(output.error or "the scoring request ended without a score")
    return outputs


def _num_tokens(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)
