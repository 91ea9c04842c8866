"""The HTTP face of the Gateway: `/s/{session}/v1/chat/completions` (or `/v1/chat/completions` with an
`X-Session-Id` header), `/v1/models`, and `/s/{session}/reward`. Every error is an OpenAI-style body naming the
field; nothing a client sends can take the run down. With `gateway.api_key` set, every route (the unknown ones
too) answers 401 unless the request carries `Authorization: Bearer <key>`, as OpenAI clients send it."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from skyrl_stepwise.gateway.protocol import GatewayError
from skyrl_stepwise.gateway.service import Gateway

logger = logging.getLogger(__name__)
SESSION_HEADER = "x-session-id"


def create_app(gateway: Gateway) -> FastAPI:
    """A FastAPI app over `gateway` (served in-process by the rollout, or mounted by a test's ASGI transport)."""
    app = FastAPI(title="skyrl_stepwise agent endpoint")

    @app.middleware("http")
    async def _authenticated(request: Request, call_next):
        refused = _check_key(request, gateway.gateway.api_key)
        if refused is not None:
            gateway.count("refused/invalid_api_key")
            return JSONResponse(refused.body(), status_code=refused.status, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(GatewayError)
    async def _refused(_: Request, e: GatewayError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _crashed(_: Request, e: Exception) -> JSONResponse:  # a bug of ours: the call fails, the run does not
        logger.exception("agent endpoint: unexpected error")
        gateway.count("errors/internal")
        return JSONResponse(GatewayError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error",
                                         "server_error").body(), status_code=500)

    async def _chat(session: str, request: Request):
        body = await _json(request)
        chat_request, response = await gateway.complete(session, body)
        if chat_request.stream:
            return StreamingResponse(_sse(response), media_type="text/event-stream")
        return response

    @app.post("/s/{session}/v1/chat/completions")
    async def chat_in_path(session: str, request: Request):
        return await _chat(session, request)

    @app.post("/v1/chat/completions")
    async def chat_in_header(request: Request):
        session = request.headers.get(SESSION_HEADER)
        if not session:
            raise GatewayError(400, f"no session: use /s/{{session}}/v1 as the base URL or send {SESSION_HEADER}",
                               "session", "session_not_found")
        return await _chat(session, request)

    @app.get("/s/{session}/v1/models")
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "skyrl_stepwise"}
                                           for m in gateway.model_names]}

    @app.post("/s/{session}/reward")
    async def reward(session: str, request: Request):
        body = await _json(request)
        if not isinstance(body, dict) or "reward" not in body:
            raise GatewayError(400, "the body must be {\"reward\": float, \"metrics\": {...}}", "reward")
        gateway.post_reward(session, body["reward"], body.get("metrics"))
        return {"ok": True}

    return app


def _check_key(request: Request, api_key: str | None) -> GatewayError | None:
    """The 401 a request without the run's key gets (None: it may pass). The key is compared in constant time
    (hmac.compare_digest), so its bytes cannot be guessed from response times."""
    if not api_key:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, sent = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), api_key.encode()):
        return None
    problem = "has no Authorization header" if not header else "carries a wrong key in its Authorization header"
    return GatewayError(401, f"the request {problem}: send `Authorization: Bearer <gateway.api_key>` (an OpenAI "
                             "client does this with api_key=task.api_key)", "authorization", "invalid_api_key")


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise GatewayError(400, f"the body is not JSON: {e}", "body") from e


async def _sse(response: dict[str, Any]) -> AsyncIterator[str]:
    """The finished turn as chat.completion.chunk events: the turn is sampled whole (it is one step sample), so the
    stream carries it in one delta, then the finish reason, then [DONE]."""
    choice = response["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content"):
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    for chunk in ({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "usage": response["usage"]}):
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
