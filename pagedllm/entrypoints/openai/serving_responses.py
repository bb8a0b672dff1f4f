"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items.

A request becomes a chat request (responses_protocol.py) served by the chat path (tools, grammars,
reasoning parsers), and its answer becomes output items (responses_output.py). With `store` (the
default) the response and its conversation are kept in a bounded store (responses_store.py), under
the caller's API key; `previous_response_id` continues that conversation, so its prompt shares the
earlier turn's prefix and finds it in the prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.auth import request_api_key
from pagedllm.entrypoints.openai.chat_turn import TurnEnd, TurnReader, chat_request
from pagedllm.entrypoints.openai.serving import IndexedOutputs, ServingContext, SSEResponse, named_sse_event, new_id
from pagedllm.entrypoints.openai.errors import APIError, api_error_from
from pagedllm.entrypoints.openai.responses_output import ResponseBuilder, item_id, output_as_items
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, truncated
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedllm.metrics.responses_store import ResponseStoreMetrics


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (it was never stored, was deleted or "
                         f"evicted, or belongs to another API key)", param="response_id", code="not_found")


class ResponsesEndpoint:
    """The Responses routes over one server's engine and store."""

    def __init__(self, ctx: ServingContext, store: ResponseStore) -> None:
        self.ctx = ctx
        self.store = store

    def _echo(self, request: ResponsesRequest) -> dict:
        """The request fields a response object repeats."""
        fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) \
            if request.text is not None and request.text.format is not None else {"type": "text"}
        return {"instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "tools": request.tools or [],
                "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
                "parallel_tool_calls": request.parallel_tool_calls, "text": {"format": fmt},
                "previous_response_id": request.previous_response_id, "store": request.store,
                "metadata": request.metadata or {}, "truncation": request.truncation, "user": request.user,
                "reasoning": request.reasoning}

    async def create(self, request: ResponsesRequest, raw_request: Request):
        request.check()
        api_key = request_api_key(raw_request)
        input_items = [{"id": item.get("id") or item_id("item" if item.get("type") != "message" else "msg"), **item}
                       for item in request.input_items()]
        history: list[dict] = []
        if request.previous_response_id is not None:
            previous = self.store.get(api_key, request.previous_response_id)
            if previous is None:
                raise _not_found(request.previous_response_id)
            history = previous.conversation
        items = history + input_items
        response_id = new_id("resp").replace("-", "_")
        reader = await self._start(request, raw_request, items, response_id)
        builder = ResponseBuilder(response_id, reader.turn.model, self._echo(request))

        def keep(end: TurnEnd | None) -> None:
            if request.store and end is not None:
                self.store.put(api_key, StoredResponse(builder.response, input_items,
                                                       items + output_as_items(builder.output)))

        if request.stream:
            return SSEResponse(reader.turn.streams, lambda outputs: self._events(reader, builder, outputs, keep),
                               frame=named_sse_event, done=False)
        pieces, end = await reader.whole(raw_request)
        for piece in pieces:
            builder.add(piece)
        builder.finish(end)
        keep(end)
        return JSONResponse(builder.response)

    async def _start(self, request: ResponsesRequest, raw_request: Request, items: list[dict],
                     response_id: str) -> TurnReader:
        """Queue the turn; with truncation "auto", drop the oldest turns until the prompt fits."""
        while True:
            chat = chat_request(request.chat_body(items))
            try:
                return await TurnReader.start(self.ctx, raw_request, chat, response_id)
            except Exception as e:  # noqa: BLE001 - only a prompt too long is retried shorter
                error = api_error_from(e)
                shorter = truncated(items) if request.truncation == "auto" and error.status == 400 \
                    and "max_model_len" in error.message else None
                if shorter is None:
                    raise error from None
                items = shorter

    async def _events(self, reader: TurnReader, builder: ResponseBuilder, outputs: IndexedOutputs,
                      keep) -> AsyncIterator[dict]:
        for event in builder.start():
            yield event
        end = None
        try:
            async for piece in reader.streamed(outputs):
                if isinstance(piece, TurnEnd):
                    end = piece
                    continue
                for event in builder.add(piece):
                    yield event
        except Exception as e:  # noqa: BLE001 - the stream ends with response.failed, as OpenAI's
            error = api_error_from(e)
            for event in builder.fail(error.code or "server_error", error.message):
                yield event
            return
        for event in builder.finish(end):
            yield event
        keep(end)

    def get(self, raw_request: Request, response_id: str) -> StoredResponse:
        entry = self.store.get(request_api_key(raw_request), response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry


def add_responses_routes(app: FastAPI, ctx: ServingContext, body, require_engine) -> ResponseStore:
    """Register the Responses routes; the store is bounded by the server's --responses-store-* flags."""
    observer = ResponseStoreMetrics(ctx.metrics.registry, ctx.model_name) if ctx.metrics is not None else None
    store = ResponseStore(ctx.config.responses_store_max_entries, ctx.config.responses_store_max_bytes, observer)
    endpoint = ResponsesEndpoint(ctx, store)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request):
        require_engine()
        return await endpoint.create(await body(raw_request, ResponsesRequest), raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(raw_request: Request, response_id: str):
        return endpoint.get(raw_request, response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(raw_request: Request, response_id: str):
        if not store.delete(request_api_key(raw_request), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(raw_request: Request, response_id: str, order: str = "desc", limit: int = 20,
                          after: str | None = None):
        items = list(endpoint.get(raw_request, response_id).input_items)
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: asc or desc, got {order!r}", param="order")
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        limit = max(1, min(limit, 100))
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    return store
