"""The retrieval HTTP server: `POST /retrieve` speaking both Search-R1's and SkyRL's request shapes.

Search-R1 sends `{"queries": [...], "topk": 3, "return_scores": true}`, SkyRL sends `{"query": "..."}`;
both get `{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}` (one list per query).
With `return_scores: false` each list holds bare documents (Search-R1's server crashes on that path).
Limits on queries per request, query length and topk answer 422 with a message naming the field;
a body over `max_body_bytes` answers 413 before any JSON is parsed, and a request beyond
`max_concurrent_requests` in flight answers 429 with `Retry-After` at once rather than queueing.
/health is exempt from both, so probes still see a busy server as alive.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skyrl_stepwise.retrieval.index import RETRIEVERS, Retriever, load_or_build

logger = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    """Request bounds: a runaway client gets a clear 422 instead of stalling the retriever for everyone."""

    default_topk: int = 3
    max_topk: int = 50
    max_queries: int = 512
    max_query_chars: int = 2048
    max_body_bytes: int = 4 * 1024 * 1024  # 512 queries x 2048 chars of JSON is ~1.1 MB; 4 MiB leaves room
    max_concurrent_requests: int = 32  # below anyio's 40 worker threads, so admitted requests never queue
    retry_after_s: int = 1  # what a 429 tells the client to wait


UNLIMITED_PATHS = frozenset({"/health"})  # liveness probes must answer even when the retriever is saturated


class BodySizeLimit:
    """Answer 413 for a body over `max_bytes`, so one oversized request cannot make the server buffer it.

    A declared Content-Length is checked before the app runs; a chunked body (no Content-Length) is counted
    as the app reads it and cut off with HTTPException(413), which FastAPI re-raises from its body reader
    and turns into the 413 response, still before any JSON is parsed.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: frozenset[str] = UNLIMITED_PATHS) -> None:
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    def _too_large(self, what: str) -> str:
        return f"{what}; at most max_body_bytes={self.max_bytes}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            too_large = JSONResponse({"detail": self._too_large(f"request body is {declared} bytes")}, 413)
            return await too_large(scope, receive, send)
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._too_large(f"request body passed {seen} bytes"))
            return message

        await self.app(scope, counting_receive, send)


class ConcurrencyLimit:
    """Answer 429 + Retry-After once `max_requests` are in flight, so overload sheds load instead of queueing.

    uvicorn's own `limit_concurrency` would also refuse /health (with 503, which clients treat as an error);
    this counts only limited paths. The counter lives on the event loop thread, so no lock is needed.
    """

    def __init__(self, app: ASGIApp, max_requests: int, retry_after_s: int,
                 exempt: frozenset[str] = UNLIMITED_PATHS) -> None:
        self.app, self.max_requests, self.retry_after_s, self.exempt = app, max_requests, retry_after_s, exempt
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.max_requests:
            detail = (f"server busy: {self.in_flight} requests in flight, max_concurrent_requests="
                      f"{self.max_requests}; retry after {self.retry_after_s} s")
            busy = JSONResponse({"detail": detail}, 429, headers={"Retry-After": str(self.retry_after_s)})
            return await busy(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class RetrieveRequest(BaseModel):
    """Either `queries` (Search-R1) or `query` (SkyRL); unknown fields are rejected so typos surface."""

    model_config = ConfigDict(extra="forbid")
    queries: list[str] | None = None
    query: str | None = None
    topk: int | None = None
    return_scores: bool = False


def _check(req: RetrieveRequest, limits: ServerLimits) -> tuple[list[str], int]:
    """Normalize both request shapes to (queries, k), raising 422s that name the offending field."""
    if (req.queries is None) == (req.query is None):
        raise HTTPException(422, "send exactly one of 'queries' (a list of strings) or 'query' (a string)")
    field, queries = ("queries", req.queries) if req.queries is not None else ("query", [req.query])
    if not queries:
        raise HTTPException(422, "'queries' must hold at least one query")
    if len(queries) > limits.max_queries:
        raise HTTPException(422, f"'queries' holds {len(queries)} queries; at most {limits.max_queries} per request")
    for i, q in enumerate(queries):
        if len(q) > limits.max_query_chars:
            where = f"queries[{i}]" if field == "queries" else "query"
            raise HTTPException(422, f"'{where}' is {len(q)} characters; at most {limits.max_query_chars}")
    k = limits.default_topk if req.topk is None else req.topk
    if not 1 <= k <= limits.max_topk:
        raise HTTPException(422, f"'topk' must be between 1 and {limits.max_topk}, got {k}")
    return queries, k


def create_app(retriever: Retriever, limits: ServerLimits | None = None) -> FastAPI:
    """Build the app around an already-loaded retriever, so tests and benchmarks can serve any index."""
    limits = limits or ServerLimits()
    app = FastAPI(title="skyrl_stepwise retriever")
    # The last added middleware runs first: a request over the concurrency limit is refused before its body
    # is read, and an admitted one holds its slot while the body streams in, so memory stays bounded too.
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(ConcurrencyLimit, max_requests=limits.max_concurrent_requests,
                       retry_after_s=limits.retry_after_s)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "retriever": retriever.kind, "num_docs": len(retriever.docs),
                "max_queries": limits.max_queries, "max_topk": limits.max_topk,
                "max_body_bytes": limits.max_body_bytes, "max_concurrent_requests": limits.max_concurrent_requests}

    @app.post("/retrieve")
    def retrieve(req: RetrieveRequest) -> dict:
        # A sync endpoint: FastAPI runs it in its thread pool, so a slow search never blocks /health.
        queries, k = _check(req, limits)
        hits = retriever.search(queries, k)
        if req.return_scores:
            return {"result": [[{"document": h.document, "score": h.score} for h in row] for row in hits]}
        return {"result": [[h.document for h in row] for row in hits]}

    return app


class BackgroundServer:
    """uvicorn in a daemon thread on 127.0.0.1, for tests and notebooks that need a live endpoint in-process."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="retrieval-server", daemon=True)
        self.host = host

    @property
    def port(self) -> int:
        """The bound port, so callers can ask for port 0 and never race for a free one."""
        return self.server.servers[0].sockets[0].getsockname()[1]  # the real one when port=0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        """Return only once uvicorn accepts connections, so the first request never races the startup."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host} within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Graceful shutdown; afterwards connections are refused, as with a killed retriever."""
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def default_index_dir() -> Path:
    """Indexes live in the shared cache so every run over the same corpus reuses them."""
    from skyrl_stepwise.models.prepare import cache_root

    return cache_root() / "indexes"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """CLI flags; a default topk outside the allowed range is a usage error, not a runtime 422 on every call."""
    p = argparse.ArgumentParser(prog="skyrl-stepwise retriever serve", description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=None,
                   help="corpus JSONL {id, contents} (required here; `skyrl-stepwise retriever serve` serves the "
                        "embedded Wikipedia corpus when none is given)")
    p.add_argument("--index-dir", type=Path, default=None, help="where indexes are saved and reused "
                   "(default: $SKYRL_STEPWISE_CACHE/indexes)")
    p.add_argument("--retriever", choices=RETRIEVERS, default="bm25")
    p.add_argument("--bm25-backend", choices=("auto", "numpy", "numba"), default="auto",
                   help="bm25s scoring backend; auto = numba if installed (JIT at start, much faster queries)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; 127.0.0.1 keeps it local")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--topk", type=int, default=3, help="results per query when the request has no topk")
    p.add_argument("--max-topk", type=int, default=ServerLimits.max_topk)
    p.add_argument("--max-queries", type=int, default=ServerLimits.max_queries, help="queries per request")
    p.add_argument("--max-query-chars", type=int, default=ServerLimits.max_query_chars)
    p.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes,
                   help="larger request bodies get 413 before they are parsed")
    p.add_argument("--max-concurrent-requests", type=int, default=ServerLimits.max_concurrent_requests,
                   help="requests in flight; more get 429 with Retry-After at once (/health is never limited)")
    p.add_argument("--retry-after-s", type=int, default=ServerLimits.retry_after_s,
                   help="the Retry-After a 429 carries")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if not 1 <= args.topk <= args.max_topk:
        p.error(f"--topk must be between 1 and --max-topk ({args.max_topk}), got {args.topk}")
    for flag, value, least in (("--max-body-bytes", args.max_body_bytes, 1),
                               ("--max-concurrent-requests", args.max_concurrent_requests, 1),
                               ("--retry-after-s", args.retry_after_s, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise retriever serve [--corpus F] [--retriever bm25|dense] [--port N]`: blocks serving."""
    import uvicorn

    args = parse_args(argv)
    if args.corpus is None:  # the embedded corpus is data's business (cli/retriever.py builds it): no import up
        raise SystemExit("retrieval server: --corpus is required (`skyrl-stepwise retriever serve` serves the "
                         "embedded Wikipedia corpus when none is given)")
    corpus = args.corpus
    retriever = load_or_build(corpus, args.index_dir or default_index_dir(), args.retriever,
                              backend=args.bm25_backend)
    limits = ServerLimits(default_topk=args.topk, max_topk=args.max_topk, max_queries=args.max_queries,
                          max_query_chars=args.max_query_chars, max_body_bytes=args.max_body_bytes,
                          max_concurrent_requests=args.max_concurrent_requests, retry_after_s=args.retry_after_s)
    print(f"serving {retriever.kind} over {len(retriever.docs)} docs from {corpus} at "
          f"http://{args.host}:{args.port}/retrieve (pid {os.getpid()})", flush=True)
    uvicorn.run(create_app(retriever, limits), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
