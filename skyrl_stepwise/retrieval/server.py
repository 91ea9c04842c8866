"""The retrieval HTTP server: `POST /retrieve` speaking both Search-R1's and SkyRL's request shapes.

Search-R1 sends `{"queries": [...], "topk": 3, "return_scores": true}`, SkyRL sends `{"query": "..."}`;
both get `{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}` (one list per query).
With `return_scores: false` each list holds bare documents (Search-R1's server crashes on that path).
Limits on queries per request, query length and topk answer 422 with a message naming the field.
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

from skyrl_stepwise.retrieval.index import RETRIEVERS, Retriever, load_or_build

logger = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    """Request bounds: a runaway client gets a clear 422 instead of stalling the retriever for everyone."""

    default_topk: int = 3
    max_topk: int = 50
    max_queries: int = 512
    max_query_chars: int = 2048


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

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "retriever": retriever.kind, "num_docs": len(retriever.docs),
                "max_queries": limits.max_queries, "max_topk": limits.max_topk}

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


def default_corpus() -> Path:
    """The embedded Wikipedia corpus, built on first use, so `retriever serve` works with no arguments."""
    from skyrl_stepwise.data.embedded import build_embedded_search_r1

    return build_embedded_search_r1().corpus


def default_index_dir() -> Path:
    """Indexes live in the shared cache so every run over the same corpus reuses them."""
    from skyrl_stepwise.models.prepare import cache_root

    return cache_root() / "indexes"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """CLI flags; a default topk outside the allowed range is a usage error, not a runtime 422 on every call."""
    p = argparse.ArgumentParser(prog="skyrl-stepwise retriever serve", description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=None,
                   help="corpus JSONL {id, contents}; default: the embedded Wikipedia corpus")
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
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if not 1 <= args.topk <= args.max_topk:
        p.error(f"--topk must be between 1 and --max-topk ({args.max_topk}), got {args.topk}")
    return args


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise retriever serve [--corpus F] [--retriever bm25|dense] [--port N]`: blocks serving."""
    import uvicorn

    args = parse_args(argv)
    corpus = args.corpus or default_corpus()
    retriever = load_or_build(corpus, args.index_dir or default_index_dir(), args.retriever,
                              backend=args.bm25_backend)
    limits = ServerLimits(args.topk, args.max_topk, args.max_queries, args.max_query_chars)
    print(f"serving {retriever.kind} over {len(retriever.docs)} docs from {corpus} at "
          f"http://{args.host}:{args.port}/retrieve (pid {os.getpid()})", flush=True)
    uvicorn.run(create_app(retriever, limits), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
