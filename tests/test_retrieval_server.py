"""The real retrieval server (the `retriever serve` CLI in a subprocess) over a slice of the real corpus."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from skyrl_stepwise.data.embedded import corpus_rows, load_articles
from skyrl_stepwise.retrieval.index import BM25Retriever, load_or_build

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
           "--max-query-chars", "200", "--max-topk", "10"]
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
])
def test_bad_requests_get_clear_4xx(server, body, status, needle):
    url, _ = server
    r = post(url, body)
    assert r.status_code == status
    assert needle.lower() in r.text.lower()


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
