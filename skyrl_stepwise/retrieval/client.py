"""Async client for a Search-R1-style `/retrieve` endpoint, with a timeout and bounded retries.

Search-R1's own client (`requests.post`, no timeout, no retry) hangs a whole rollout batch when the
retriever stalls; here transient failures (connection errors, timeouts, 5xx, and 429 from a busy server)
are retried with exponential backoff -- after a 429, for as long as its `Retry-After` asks, within a cap --
and anything else fails fast with a `RetrievalError` the caller can report.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import time
from dataclasses import dataclass

import httpx

from skyrl_stepwise.retrieval.index import Document


class RetrievalError(RuntimeError):
    """The retriever could not answer (down, too slow, 4xx/5xx, or a malformed response)."""


class RetrievalUnavailable(RetrievalError):
    """The retriever stayed unreachable (refused, reset, timed out, 5xx, 429) through every retry: the server is
    down, which says nothing about the query. Callers fail the trajectory (retriever_down=fail) rather than let the
    model be trained on an observation no working system would have shown it."""

    def __init__(self, message: str, tries: int) -> None:
        super().__init__(message)
        self.tries = tries


@dataclass
class RetrievalClientConfig:
    """Where the retriever is and how long to wait for it; retries only cover transient failures."""

    url: str = "http://127.0.0.1:8000/retrieve"
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5  # sleep backoff_s * 2**attempt between tries
    max_retry_after_s: float = 10.0  # a 429's Retry-After is honoured up to this many seconds
    max_connections: int = 32  # = the server's default max_concurrent_requests: one client alone never gets 429


@dataclass
class RetrieverEndpointConfig:
    """The retriever keys the Search-R1 env and the search tool share: both inherit them, so a config spells
    them the same for tag-based and function-calling runs, and one place turns them into a client config."""

    # the retrieval server's endpoint (filled in with the run's own server when environment.retriever.start_local)
    search_url: str = "http://127.0.0.1:8000/retrieve"
    topk: int = 3  # documents returned per search
    timeout_s: float = 30.0  # seconds one retrieval request may take
    max_retries: int = 3  # retries after a failed request (so max_retries + 1 tries)
    backoff_s: float = 0.5  # wait before retry k: backoff_s * 2**(k-1) s (a 429's Retry-After instead, when given)
    # When the retriever stays down through every retry: fail (the trajectory fails: dropped and counted, never
    # trained on) or observe (the model reads "Search failed: ..." and the episode goes on, as before).
    retriever_down: str = "fail"

    def __post_init__(self) -> None:
        """Name the key of a misspelt mode when the config loads."""
        if self.retriever_down not in ("fail", "observe"):
            raise ValueError(f"retriever_down must be 'fail' or 'observe', got {self.retriever_down!r}")

    def client_config(self) -> RetrievalClientConfig:
        """The timeout/retry part of this config, in the retrieval client's terms."""
        return RetrievalClientConfig(url=self.search_url, timeout_s=self.timeout_s, max_retries=self.max_retries,
                                     backoff_s=self.backoff_s)


def retry_after_s(response: httpx.Response) -> float | None:
    """Seconds a 429's `Retry-After` asks for (delta-seconds or HTTP-date), or None when absent or unreadable.

    None means "no advice": the caller falls back to its own backoff rather than hammering the server.
    """
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000": RFC 9110 dates are GMT anyway
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - time.time())


def parse_response(payload: object, n_queries: int) -> list[list[Document]]:
    """Accept `{"result": [[{"document": d, "score": s} | d, ...], ...]}` and return documents per query."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise RetrievalError(f"retriever response has no 'result' list: {str(payload)[:200]!r}")
    result = payload["result"]
    if len(result) != n_queries:
        raise RetrievalError(f"retriever returned {len(result)} result lists for {n_queries} queries")
    docs: list[list[Document]] = []
    for row in result:
        if not isinstance(row, list):
            raise RetrievalError(f"retriever result entry is not a list: {str(row)[:200]!r}")
        out = []
        for item in row:
            doc = item.get("document", item) if isinstance(item, dict) else None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise RetrievalError(f"retrieved item has no 'contents' string: {str(item)[:200]!r}")
            out.append(doc)
        docs.append(out)
    return docs


class RetrievalClient:
    """One pooled httpx client per event loop, shared by every env that holds this object."""

    def __init__(self, cfg: RetrievalClientConfig | None = None) -> None:
        self.cfg = cfg or RetrievalClientConfig()
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        # An httpx client is bound to the loop it first ran on; a trainer that calls asyncio.run per
        # batch gets a fresh one instead of "Event loop is closed".
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            limits = httpx.Limits(max_connections=self.cfg.max_connections,
                                  max_keepalive_connections=self.cfg.max_connections)
            self._client = httpx.AsyncClient(timeout=self.cfg.timeout_s, limits=limits)
            self._loop = loop
        return self._client

    def _delay(self, attempt: int, advised_s: float | None) -> float:
        """Wait before try `attempt` (1-based retry): the server's Retry-After when given, capped so a
        misconfigured server cannot park a rollout for minutes; otherwise exponential backoff."""
        if advised_s is not None:
            return min(advised_s, self.cfg.max_retry_after_s)
        return self.cfg.backoff_s * 2 ** (attempt - 1)

    async def search(self, queries: list[str], topk: int) -> list[list[Document]]:
        """Top-k documents for each query; raises RetrievalError once retries are spent."""
        payload = {"queries": list(queries), "topk": topk, "return_scores": True}
        last_error = "no attempt made"
        advised_s: float | None = None  # Retry-After of the last 429, if any
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._delay(attempt, advised_s))
            advised_s = None
            try:
                response = await self._http().post(self.cfg.url, json=payload)
            except httpx.TransportError as e:  # refused, reset, timed out: worth another try
                last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if response.status_code == 429:  # the server shed load; it will answer once a slot frees up
                advised_s = retry_after_s(response)
                last_error = f"HTTP 429: {response.text[:200]}"
                continue
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code != 200:  # any other 4xx will not get better by asking again
                raise RetrievalError(f"HTTP {response.status_code} from {self.cfg.url}: {response.text[:300]}")
            try:
                body = response.json()
            except ValueError:
                raise RetrievalError(f"retriever returned non-JSON: {response.text[:200]!r}") from None
            return parse_response(body, len(queries))
        raise RetrievalUnavailable(f"retriever at {self.cfg.url} failed after {self.cfg.max_retries + 1} tries: "
                                   f"{last_error}", self.cfg.max_retries + 1)

    async def aclose(self) -> None:
        """Close the pooled connections (only meaningful on the loop that opened them)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
