"""The real retrieval server (the `retriever serve` CLI in a subprocess) over a slice of the real corpus."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from skyrl_stepwise.data.embedded import corpus_rows, load_articles
from skyrl_stepwise.retrieval.client import RetrievalClient, RetrievalClientConfig, RetrievalError
from skyrl_stepwise.retrieval.index import BM25Retriever, Hit, load_or_build
from skyrl_stepwise.retrieval.server import BackgroundServer, ServerLimits, create_app

pytestmark = pytest.mark.integration
N_DOCS = 300


def small_corpus(path: Path, n: int = N_DOCS) -> Path:
    """Every 30th vital article plus the two the tests ask about: real passages on varied topics."""
    keep = ("Asia", "Liverpool")
    articles = load_articles()
    picked = [a for i, a in enumerate(articles) if i % 30 == 0 and a["title"] not in keep][:n - len(keep)]
    picked += [a for a in articles if a["title"] in keep]
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus_rows(picked)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="module")
def server(corpus, tmp_path_factory):
    """`python -m skyrl_stepwise.cli retriever serve` with small limits, so the limit paths are cheap to hit.

    Default backend (numba when installed): its JIT is paid once here, in the server process.
    """
    port = free_port()
    index_dir = tmp_path_factory.mktemp("indexes")
    cmd = [sys.executable, "-m", "skyrl_stepwise.cli", "retriever", "serve", "--corpus", str(corpus),
           "--index-dir", str(index_dir), "--port", str(port), "--topk", "3", "--max-queries", "8",
           "--max-query-chars", "200", "--max-topk", "10", "--max-body-bytes", "4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"retriever exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("retriever did not become healthy in 120 s")
        time.sleep(0.2)
    yield url, index_dir
    proc.terminate()
    proc.wait(timeout=10)


def post(url: str, body) -> httpx.Response:
    if isinstance(body, str):  # raw (possibly malformed) JSON text
        return httpx.post(f"{url}/retrieve", content=body, headers={"content-type": "application/json"}, timeout=10)
    return httpx.post(f"{url}/retrieve", json=body, timeout=10)


def test_health_reports_index(server):
    url, index_dir = server
    body = httpx.get(f"{url}/health").json()
    assert body["status"] == "ok" and body["retriever"] == "bm25" and body["num_docs"] == N_DOCS
    assert [p.name.split("-")[0] for p in index_dir.iterdir()] == ["bm25"]  # saved for the next start


def test_search_r1_shape_with_scores(server):
    url, _ = server
    r = post(url, {"queries": ["largest continent by land area and population", "Liverpool port city"],
                   "topk": 2, "return_scores": True})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(len(row) == 2 for row in result)
    top = result[0][0]
    assert top["document"]["contents"].startswith('"Asia"\n') and set(top["document"]) == {"id", "contents"}
    assert result[0][0]["score"] >= result[0][1]["score"] > 0
    assert result[1][0]["document"]["contents"].startswith('"Liverpool"\n')


def test_return_scores_false_gives_bare_documents(server):
    url, _ = server
    r = post(url, {"queries": ["largest continent"], "topk": 1})  # SR1's default; its own server crashes here
    assert r.status_code == 200
    assert r.json()["result"] == [[post(url, {"queries": ["largest continent"], "topk": 1,
                                              "return_scores": True}).json()["result"][0][0]["document"]]]


def test_skyrl_single_query_shape(server):
    url, _ = server
    r = post(url, {"query": "Liverpool", "return_scores": True})
    result = r.json()["result"]
    assert len(result) == 1 and len(result[0]) == 3  # server default topk
    assert result[0][0]["document"]["contents"].startswith('"Liverpool"\n')


@pytest.mark.parametrize("body, status, needle", [
    ({"queries": ["q"] * 9}, 422, "'queries' holds 9 queries; at most 8"),
    ({"queries": ["ok", "x" * 201]}, 422, "'queries[1]' is 201 characters"),
    ({"query": "x" * 201}, 422, "'query' is 201 characters"),
    ({"queries": ["q"], "topk": 0}, 422, "'topk' must be between 1 and 10"),
    ({"queries": ["q"], "topk": 11}, 422, "'topk' must be between 1 and 10"),
    ({"queries": []}, 422, "at least one query"),
    ({"queries": ["a"], "query": "b"}, 422, "exactly one of 'queries'"),
    ({"topk": 3}, 422, "exactly one of 'queries'"),
    ({"queries": "not a list"}, 422, "queries"),
    ({"queries": ["q"], "top_k": 3}, 422, "top_k"),
    ('{"queries": ["unterminated"', 422, "json"),
    ({"queries": ["q" * 150] * 30}, 413, "bytes; at most max_body_bytes=4096"),  # checked before the 422s
])
def test_bad_requests_get_clear_4xx(server, body, status, needle):
    url, _ = server
    r = post(url, body)
    assert r.status_code == status
    assert needle.lower() in r.text.lower()


def test_chunked_body_over_limit_is_413(server):
    """No Content-Length to check up front: the bytes are counted as they arrive."""
    url, _ = server
    body = json.dumps({"queries": ["q" * 150] * 30}).encode()
    r = httpx.post(f"{url}/retrieve", content=iter([body[:2000], body[2000:]]),
                   headers={"content-type": "application/json"}, timeout=10)
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413 and "at most max_body_bytes=4096" in r.json()["detail"]


def test_body_just_under_limit_is_served(server):
    url, _ = server
    body = '{"queries": ["Liverpool"], "topk": 1}'
    r = post(url, body[:-1] + " " * (4096 - len(body)) + "}")  # exactly 4096 bytes
    assert len(r.request.content) == 4096 and r.status_code == 200
    assert r.json()["result"][0][0]["contents"].startswith('"Liverpool"\n')


class BlockingRetriever:
    """Holds every search until `release` is set, so a test controls exactly how many requests are in flight."""

    kind = "blocking"
    docs = [{"id": "0", "contents": '"T"\nx'}]

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        self.entered.set()
        assert self.release.wait(10), "test never released the search"
        return [[Hit(self.docs[0], 1.0)] for _ in queries]


def test_concurrency_limit_answers_429_and_spares_health():
    retriever = BlockingRetriever()
    limits = ServerLimits(max_concurrent_requests=1, retry_after_s=3)
    with BackgroundServer(create_app(retriever, limits)) as srv:
        held: dict = {}
        first = threading.Thread(target=lambda: held.update(r=post(srv.url, {"query": "a"})))
        first.start()
        try:
            assert retriever.entered.wait(5)  # the one slot is now taken
            busy = post(srv.url, {"query": "b"})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "3"
            assert "max_concurrent_requests=1" in busy.json()["detail"]
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200  # never limited
        finally:
            retriever.release.set()
            first.join(10)
        assert held["r"].status_code == 200
        assert post(srv.url, {"query": "bad", "topk": 0}).status_code == 422  # the slot was given back ...
        assert post(srv.url, {"query": "c"}).status_code == 200  # ... also by a request that failed


OK_BODY = {"result": [[{"document": {"id": "1", "contents": '"Asia"\ntext'}, "score": 1.0}]]}


@pytest.fixture
def scripted_server():
    """Answers each POST /retrieve with the next scripted (status, headers), then 200; records every call."""
    script: list[tuple[int, dict]] = []
    calls: list[float] = []
    app = FastAPI()

    @app.post("/retrieve")
    def retrieve():
        calls.append(time.monotonic())
        status, headers = script.pop(0) if script else (200, {})
        if status == 200:
            return JSONResponse(OK_BODY)
        return JSONResponse({"detail": f"scripted {status}"}, status, headers=headers)

    with BackgroundServer(app) as srv:
        yield f"{srv.url}/retrieve", script, calls


async def test_client_retries_429_honouring_retry_after(scripted_server):
    """Retry-After 0 overrides a 5 s backoff; a 429 with no header falls back to the backoff."""
    url, script, calls = scripted_server
    script += [(429, {"Retry-After": "0"}), (429, {"Retry-After": "0"})]
    client = RetrievalClient(RetrievalClientConfig(url=url, timeout_s=5, max_retries=2, backoff_s=5.0))
    start = time.monotonic()
    assert (await client.search(["largest continent"], 1))[0][0]["contents"].startswith('"Asia"')
    assert len(calls) == 3 and time.monotonic() - start < 2  # no 5 s + 10 s backoff was slept
    script += [(429, {})]
    client.cfg.backoff_s = 0.3
    await client.search(["q"], 1)
    assert len(calls) == 5 and calls[4] - calls[3] >= 0.3
    await client.aclose()


async def test_client_caps_retry_after_and_gives_up(scripted_server):
    url, script, calls = scripted_server
    script += [(429, {"Retry-After": "3600"})] * 3
    client = RetrievalClient(RetrievalClientConfig(url=url, timeout_s=5, max_retries=2, backoff_s=5.0,
                                                   max_retry_after_s=0.1))
    start = time.monotonic()
    with pytest.raises(RetrievalError, match=r"failed after 3 tries: HTTP 429: .*scripted 429"):
        await client.search(["q"], 1)
    assert len(calls) == 3 and 0.2 <= time.monotonic() - start < 2  # two capped waits, not an hour
    await client.aclose()


@pytest.mark.parametrize("status", [400, 404, 413])
async def test_client_other_4xx_fail_fast(scripted_server, status):
    url, script, calls = scripted_server
    script.append((status, {"Retry-After": "0"}))
    client = RetrievalClient(RetrievalClientConfig(url=url, timeout_s=5, max_retries=3, backoff_s=0.01))
    with pytest.raises(RetrievalError, match=f"HTTP {status} from "):
        await client.search(["q"], 1)
    assert len(calls) == 1  # not retried
    await client.aclose()


def test_server_backend_agrees_with_numpy_scoring(server, corpus, tmp_path):
    """The server's (numba) top-k equals bm25s' numpy scoring on the same saved index."""
    url, index_dir = server
    local = load_or_build(corpus, index_dir, "bm25", show_progress=False, backend="numpy")
    queries = ["river delta agriculture", "painting by an Italian artist", "largest continent", "war of independence"]
    served = post(url, {"queries": queries, "topk": 5, "return_scores": True}).json()["result"]
    for q, row, hits in zip(queries, served, local.search(queries, 5)):
        assert [h["document"]["id"] for h in row] == [h.document["id"] for h in hits], q
        assert [h["score"] for h in row] == pytest.approx([h.score for h in hits], rel=1e-5)


def test_index_is_reused_not_rebuilt(corpus, tmp_path):
    first = load_or_build(corpus, tmp_path, "bm25", show_progress=False, backend="numpy")
    (saved,) = tmp_path.iterdir()
    stamp = (saved / "index.json").stat().st_mtime_ns
    second = load_or_build(corpus, tmp_path, "bm25", show_progress=False, backend="numpy")
    assert (saved / "index.json").stat().st_mtime_ns == stamp
    q = ["capital city on a river"]
    assert [h.document["id"] for h in first.search(q, 5)[0]] == [h.document["id"] for h in second.search(q, 5)[0]]
    assert isinstance(second, BM25Retriever)


def test_topk_above_corpus_size_is_clamped(tmp_path):
    corpus = small_corpus(tmp_path / "tiny.jsonl", n=4)
    hits = load_or_build(corpus, tmp_path / "idx", show_progress=False, backend="numpy").search(["the of and"], 10)
    assert len(hits[0]) == 4  # all-stopword query still answers, k clamped to the corpus


def test_bad_corpus_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "\\"T\\"\\nx"}\n{"id": "1", "text": "no contents"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: corpus rows need a 'contents' field"):
        load_or_build(bad, tmp_path / "idx", show_progress=False, backend="numpy")


def test_dense_retriever_finds_paraphrase(tmp_path):
    """MiniLM + faiss over 12 real passages: a paraphrase sharing no keyword with the passage still finds it."""
    pytest.importorskip("faiss")
    import torch

    torch.set_num_threads(2)
    corpus = small_corpus(tmp_path / "dense.jsonl", n=12)  # MiniLM embeds ~10 passages/s on 2 busy cores
    retriever = load_or_build(corpus, tmp_path / "idx", "dense", show_progress=False)
    hits = retriever.search(["biggest landmass on Earth with the most people"], 3)[0]
    assert hits[0].document["contents"].startswith('"Asia"\n')
    assert all(0 < h.score <= 1.0001 for h in hits)


@pytest.mark.parametrize("backend", ["numpy", "auto"])
def test_query_with_no_tokens_first_in_batch(tmp_path, backend):
    """A model's query can be all stopwords; as the first of a batch it once made bm25s (numba) raise."""
    corpus = small_corpus(tmp_path / "tiny.jsonl", n=6)
    retriever = load_or_build(corpus, tmp_path / "idx", show_progress=False, backend=backend)
    hits = retriever.search(["the a of", "capital city on a river"], 3)
    assert [len(h) for h in hits] == [3, 3]
    assert all(h.score == 0.0 for h in hits[0]) and hits[1][0].score > 0


def test_the_numba_backend_turns_on_numbas_disk_cache_for_bm25s_kernels():
    """bm25s compiles its kernels without numba's cache: every server start paid the JIT again (10-90 s on 2 cores).
    Resolving the numba backend turns the cache on for each kernel, before anything compiles."""
    pytest.importorskip("numba")
    import bm25s.numba.retrieve_utils
    import bm25s.numba.selection
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher

    from skyrl_stepwise.retrieval.index import resolve_bm25_backend

    assert resolve_bm25_backend("auto") == "numba"
    kernels = [k for m in (bm25s.numba.retrieve_utils, bm25s.numba.selection) for k in vars(m).values()
               if isinstance(k, CPUDispatcher)]
    assert len(kernels) >= 3, kernels  # the retrieval kernels and the top-k selection ones
    assert not any(isinstance(k._cache, NullCache) for k in kernels), [k for k in kernels if isinstance(k._cache, NullCache)]
