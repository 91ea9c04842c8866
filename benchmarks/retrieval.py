"""Retrieval benchmark: BM25 index build time on the embedded corpus and server queries/s over HTTP.

    python benchmarks/retrieval.py [--seconds 5] [--dense-docs 0] [--json out.json]

Builds the embedded dataset and a fresh BM25 index in a temp dir (cold build), then starts the real
server (`skyrl-stepwise retriever serve`, a separate process on 127.0.0.1) once per bm25s backend
(numba: JIT at start, fast queries; numpy: instant start) and measures queries/s at
1 and 32 queries per request (one client, sequential), and at 1 query per request from 16 concurrent
clients (what a batch of search envs looks like). Every loop is bounded by --seconds and --max-requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from skyrl_stepwise.data.dataset import load_prompt_dataset
from skyrl_stepwise.data.embedded import build_embedded_search_r1
from skyrl_stepwise.retrieval.client import RetrievalClient, RetrievalClientConfig
from skyrl_stepwise.retrieval.index import load_or_build, read_corpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sequential(url: str, queries: list[str], batch: int, seconds: float, max_requests: int) -> dict:
    """One client, one request in flight: latency and throughput at a given number of queries per request."""
    latencies, sent, i = [], 0, 0
    with httpx.Client(timeout=30) as client:
        client.post(url, json={"queries": queries[:batch], "topk": 3, "return_scores": True}).raise_for_status()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds and len(latencies) < max_requests:
            chunk = [queries[(i + j) % len(queries)] for j in range(batch)]
            i += batch
            t0 = time.perf_counter()
            client.post(url, json={"queries": chunk, "topk": 3, "return_scores": True}).raise_for_status()
            latencies.append(time.perf_counter() - t0)
            sent += batch
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {"batch": batch, "concurrency": 1, "requests": len(latencies), "queries_per_s": sent / elapsed,
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}


async def concurrent(url: str, queries: list[str], workers: int, seconds: float, max_requests: int) -> dict:
    """Many envs searching at once through our RetrievalClient (pooled connections)."""
    client = RetrievalClient(RetrievalClientConfig(url=url, timeout_s=30, max_retries=0))
    latencies: list[float] = []
    start = time.perf_counter()

    async def worker(w: int) -> None:
        i = w
        while time.perf_counter() - start < seconds and len(latencies) < max_requests:
            t0 = time.perf_counter()
            await client.search([queries[i % len(queries)]], 3)
            latencies.append(time.perf_counter() - t0)
            i += workers

    await asyncio.gather(*(worker(w) for w in range(workers)))
    elapsed = time.perf_counter() - start
    await client.aclose()
    latencies.sort()
    return {"batch": 1, "concurrency": workers, "requests": len(latencies), "queries_per_s": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}


def serve_and_measure(corpus: Path, index_dir: Path, backend: str, queries: list[str], args) -> dict:
    """Start `retriever serve` in its own process on the saved index and measure it over HTTP."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/retrieve"
    cmd = [sys.executable, "-m", "skyrl_stepwise.cli", "retriever", "serve", "--corpus", str(corpus),
           "--index-dir", str(index_dir), "--port", str(port), "--bm25-backend", backend]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited: {server.stderr.read()}")
            try:
                if httpx.get(url.replace("/retrieve", "/health"), timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
            if time.perf_counter() - t0 > 120:
                raise RuntimeError("server did not start in 120 s")
        out = {"start_s": time.perf_counter() - t0}
        out["throughput"] = [sequential(url, queries, b, args.seconds, args.max_requests) for b in (1, 32)]
        out["throughput"].append(asyncio.run(concurrent(url, queries, 16, args.seconds, args.max_requests)))
        return out
    finally:
        server.terminate()
        server.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="time bound per throughput measurement")
    p.add_argument("--max-requests", type=int, default=2000, help="request bound per throughput measurement")
    p.add_argument("--dense-docs", type=int, default=0, help="also time a dense (MiniLM) build on this many docs")
    p.add_argument("--backends", nargs="+", default=["numba", "numpy"], choices=["numba", "numpy"],
                   help="bm25s scoring backends to serve with (one server start each)")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"}

    with tempfile.TemporaryDirectory(prefix="retrieval-bench-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        data = build_embedded_search_r1(tmp / "data")
        results["dataset_build_s"] = time.perf_counter() - t0
        docs = read_corpus(data.corpus, show_progress=False)
        t0 = time.perf_counter()
        load_or_build(data.corpus, tmp / "indexes", "bm25", show_progress=False, backend="numpy")
        results["bm25_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_or_build(data.corpus, tmp / "indexes", "bm25", show_progress=False, backend="numpy")
        results["bm25_load_s"] = time.perf_counter() - t0
        results["corpus_docs"] = len(docs)

        if args.dense_docs:
            import torch

            torch.set_num_threads(min(2, os.cpu_count() or 1))
            sub = tmp / "dense_corpus.jsonl"
            sub.write_text("".join(json.dumps(d) + "\n" for d in docs[:args.dense_docs]))
            t0 = time.perf_counter()
            load_or_build(sub, tmp / "indexes", "dense", show_progress=False)
            results["dense_build_s"] = time.perf_counter() - t0
            results["dense_docs"] = args.dense_docs

        rows = load_prompt_dataset(data.validation) + load_prompt_dataset(data.train)
        queries = [r.extra_info["question"] for r in rows]
        results["servers"] = {b: serve_and_measure(data.corpus, tmp / "indexes", b, queries, args)
                              for b in args.backends}

    print(f"machine: {results['machine']}")
    print(f"embedded dataset build: {results['dataset_build_s']:.2f} s   corpus: {results['corpus_docs']} docs")
    print(f"BM25 index build (cold): {results['bm25_build_s']:.2f} s   load (warm): {results['bm25_load_s']:.2f} s")
    if "dense_build_s" in results:
        print(f"dense (MiniLM + faiss) build: {results['dense_build_s']:.2f} s for {results['dense_docs']} docs")
    print(f"{'backend':>8} {'start s':>8} {'queries/request':>16} {'clients':>8} {'requests':>9} {'queries/s':>10} "
          f"{'p50 ms':>8} {'p99 ms':>8}")
    for backend, server in results["servers"].items():
        for r in server["throughput"]:
            print(f"{backend:>8} {server['start_s']:>8.2f} {r['batch']:>16} {r['concurrency']:>8} {r['requests']:>9} "
                  f"{r['queries_per_s']:>10.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
