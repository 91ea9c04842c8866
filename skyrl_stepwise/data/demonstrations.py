"""SFT demonstrations for the embedded Search-R1 task, and a validating reader for a user's own chat SFT data.

Why: SmolLM2-135M almost never writes `<search>` or `<answer>` on its own, so RL on the embedded task gets no
reward signal. A short SFT warm start on well-formed episodes fixes the format first.

Each demonstration is one TRAIN-split question (validation questions are never used) played through the real
`SearchEnv` against the same BM25 index the retrieval server serves:

    prompt (system + user, the row's own `prompt`)
    assistant  `<think> ... </think>\\n<search> DESCRIPTION </search>`
    user       the env's observation for that query, byte for byte (`\\n\\n<information>Doc 1(...) ...`)
    [assistant `<think> ... </think>\\n<search> TWO LONGEST WORDS </search>` + its observation,
               only when the evidence article was not in the first top-k]
    assistant  `<think> ... </think>\\n<answer> TITLE </answer>`

The answer is the evidence article's title when that article was retrieved (`answer_found`), else an honest
best guess: the title of the last search's top document. Assistant turns carry no EOS: the chat template adds
the end-of-turn token, exactly as in conversation mode (`generator.use_conversation_multi_turn=true`).
The file is built deterministically, written atomically and cached under the shared cache, keyed by every
input (train file, corpus, templates, topk, max_rows, bm25s version), so a change rebuilds it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from skyrl_stepwise.data.dataset import _read_table, load_prompt_dataset, write_parquet
from skyrl_stepwise.data.embedded import EmbeddedDataset, build_embedded_search_r1
from skyrl_stepwise.envs.search import SearchEnv, SearchEnvConfig, format_documents, parse_action
from skyrl_stepwise.retrieval.index import Document, Retriever, corpus_digest, load_or_build, split_contents

BUILD_VERSION = 1
MAX_SEARCHES = 2
MAX_ACTIONS = MAX_SEARCHES + 1  # fits generator.max_turns >= 3 (the tiny recipe uses exactly 3)
ROLES = ("system", "user", "assistant", "tool")
_DESCRIBED = re.compile(r'described as "(.+)"\?\s*$', re.DOTALL)
_PAREN = re.compile(r"\s*\([^)]*\)")
_WORD = re.compile(r"(?u)\b\w\w+\b")  # bm25s' own token pattern: only these words can match anything
# bm25s' English stopwords (the index drops them, so they would be wasted keywords).
_STOPWORDS = frozenset("a an and are as at be but by for if in into is it no not of on or such that the their "
                       "then there these they this to was will with".split())

THINK_SEARCH = "<think> I need to find the article that matches the question, so I will search for it. </think>"
THINK_RETRY = "<think> None of these results matches, so I will search again with fewer keywords. </think>"
THINK_FOUND = '<think> Doc {index}, "{title}", matches the question. </think>'
THINK_GUESS = '<think> No result clearly matches; my best guess is the top result, "{title}". </think>'


# ---------------------------------------------------------------------------------------------- queries

def primary_query(question: str) -> str:
    """The quoted description of a generated question (what the article's lead paraphrases), else the question
    without its trailing '?': the framing words ("Which Wikipedia article ...") only add BM25 noise."""
    m = _DESCRIBED.search(question)
    text = " ".join((m.group(1) if m else question.strip().rstrip("?")).split())
    if not text:
        raise ValueError(f"cannot derive a search query from question {question!r}")
    return text


def keyword_query(query: str, n: int) -> str:
    """The `n` longest non-stopword words of `query` (parentheticals dropped), in their original order.

    Why: a retry with fewer, more specific words lets a rare term dominate the BM25 score when the full
    description was drowned by common words; longest-first is a cheap, corpus-independent proxy for rarity.
    """
    text = _PAREN.sub(" ", query).strip() or query
    words = [w for w in _WORD.findall(text) if w.lower() not in _STOPWORDS]
    keep = set(sorted(dict.fromkeys(words), key=lambda w: (-len(w), w))[:n])
    return " ".join(w for w in dict.fromkeys(words) if w in keep)


def retry_query(question: str, tried: list[str]) -> str | None:
    """A deterministic second query that differs from the ones already tried, or None if there is none."""
    seen = {q.casefold() for q in tried}
    for n in (2, 1):
        q = keyword_query(primary_query(question), n)
        if q and q.casefold() not in seen:
            return q
    return None


# -------------------------------------------------------------------------------------------- retrieval

class InProcessRetrievalClient:
    """`RetrievalClient.search`'s contract served straight from a loaded index: same documents as the HTTP
    server (which returns `retriever.search` hits as JSON), without a server process or sockets."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    async def search(self, queries: list[str], topk: int) -> list[list[Document]]:
        return [[dict(h.document) for h in row] for row in self.retriever.search(list(queries), topk)]


def index_dir() -> Path:
    """The server's default index folder, so both use (and build at most once) the same saved index."""
    from skyrl_stepwise.retrieval.server import default_index_dir

    return default_index_dir()


def load_retriever(corpus: str | Path) -> Retriever:
    """The BM25 index exactly as `skyrl-stepwise retriever serve` loads it (same dir, kind and backend);
    cached per corpus content because loading + numba's JIT costs ~10 s and tests build several times."""
    return _load_retriever(str(corpus), corpus_digest(corpus))


@functools.lru_cache(maxsize=2)
def _load_retriever(corpus: str, digest: str) -> Retriever:
    """`digest` is only part of the cache key: a corpus rebuilt in place gets a fresh index, not a stale one."""
    return load_or_build(corpus, index_dir(), "bm25", show_progress=False, backend="auto")


def doc_title(doc: Document) -> str:
    """The bare title of a passage: its first line without Search-R1's surrounding quotes."""
    title, _ = split_contents(doc["contents"])
    return title[1:-1] if len(title) >= 2 and title[0] == title[-1] == '"' else title


def observation_text(docs: list[Document], cfg: SearchEnvConfig) -> str:
    """What `SearchEnv.step` returns for a successful search, from the same templates and formatter."""
    documents = format_documents(docs, cfg.doc_template, cfg.max_doc_words).strip()
    return cfg.observation_template.format(results=documents)


# ------------------------------------------------------------------------------------------- episodes

def _action(think: str, tag: str, body: str) -> str:
    """An assistant turn; checked with the env's own parser so a query or title can never break the format."""
    text = f"{think}\n<{tag}> {body} </{tag}>"
    if parse_action(text) != (tag, body):
        raise ValueError(f"demonstration action does not parse as {tag} {body!r}: {text!r}")
    return text


def _evidence_index(docs: list[Document], evidence_title: str) -> int | None:
    """1-based position of the evidence article among the retrieved docs (as `Doc i` shows it), or None."""
    return next((i for i, d in enumerate(docs, 1) if doc_title(d) == evidence_title), None)


async def _play(row, client: InProcessRetrievalClient, cfg: SearchEnvConfig) -> dict[str, Any]:
    """One demonstration, stepped through the real SearchEnv so observations and reward are the env's own."""
    question, evidence = row.extra_info.get("question"), row.extra_info.get("evidence_title")
    if not isinstance(question, str) or not isinstance(evidence, str):
        raise KeyError(f"train row {row.instance_id!r}: extra_info needs 'question' and 'evidence_title' strings, "
                       f"got keys {sorted(row.extra_info)}")
    env = SearchEnv(cfg, client)
    messages = await env.reset(row.prompt, {**row.env_extras(), "max_turns": MAX_ACTIONS})
    queries: list[str] = []
    query: str | None = primary_query(question)
    found, docs = None, []
    while query is not None and len(queries) < MAX_SEARCHES:
        action = _action(THINK_RETRY if queries else THINK_SEARCH, "search", query)
        queries.append(query)
        docs = (await client.search([query], cfg.topk))[0]
        step = await env.step(action)
        expected = observation_text(docs, cfg)
        if step.done or [o["content"] for o in step.observations] != [expected]:
            raise RuntimeError(f"train row {row.instance_id!r}: SearchEnv's observation for {query!r} differs from "
                               "the retrieved documents (retriever or env templates changed mid-build?)")
        messages += [{"role": "assistant", "content": action}, *step.observations]
        found = _evidence_index(docs, evidence)
        if found is not None:
            break
        query = retry_query(question, queries)
    if found is not None:
        answer, think = evidence, THINK_FOUND.format(index=found, title=evidence)
    else:
        answer = doc_title(docs[0]) if docs else "unknown"
        think = THINK_GUESS.format(title=answer)
    action = _action(think, "answer", answer)
    step = await env.step(action)
    if not step.done:
        raise RuntimeError(f"train row {row.instance_id!r}: SearchEnv did not end the episode on the answer")
    messages.append({"role": "assistant", "content": action})
    return {"messages": messages, "instance_id": row.instance_id, "answer_found": found is not None,
            "num_searches": len(queries), "reward": float(step.reward)}


async def _play_all(rows, retriever: Retriever, cfg: SearchEnvConfig) -> list[dict[str, Any]]:
    """Sequential on purpose: the order of rows (and of retriever calls) is then fixed, and BM25 is ~0.2 ms."""
    client = InProcessRetrievalClient(retriever)
    return [await _play(row, client, cfg) for row in rows]


# ---------------------------------------------------------------------------------------------- build

def train_rows(ds: EmbeddedDataset, max_rows: int | None):
    """The first `max_rows` TRAIN rows (the file is already shuffled); refuses any row seen in validation."""
    rows = load_prompt_dataset(ds.train)
    held_out = load_prompt_dataset(ds.validation)
    val_ids = {r.instance_id for r in held_out}
    val_questions = {r.extra_info.get("question") for r in held_out}
    for r in rows:
        if r.extra_info.get("split") != "train" or r.instance_id in val_ids or \
                r.extra_info.get("question") in val_questions:
            raise ValueError(f"{ds.train}: row {r.instance_id!r} is not a train-only question "
                             f"(split={r.extra_info.get('split')!r}); demonstrations must never see validation")
    return rows if max_rows is None else rows[:max_rows]


def cache_key(ds: EmbeddedDataset, max_rows: int | None, cfg: SearchEnvConfig) -> str:
    """Hash of everything that changes the output: inputs' content, retrieval settings and this builder."""
    inputs = {"build_version": BUILD_VERSION, "max_rows": max_rows, "topk": cfg.topk,
              "observation_template": cfg.observation_template, "doc_template": cfg.doc_template,
              "train_sha256": hashlib.sha256(ds.train.read_bytes()).hexdigest(),
              "validation_sha256": hashlib.sha256(ds.validation.read_bytes()).hexdigest(),
              "corpus": corpus_digest(ds.corpus), "retriever": "bm25",
              "bm25s": importlib.metadata.version("bm25s"), "pyarrow": importlib.metadata.version("pyarrow")}
    if cfg.max_doc_words:  # only when set: whole passages keep the key (and the cached files) they had before it
        inputs["max_doc_words"] = cfg.max_doc_words
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def default_dir() -> Path:
    """Next to the embedded build in the shared cache ($SKYRL_STEPWISE_CACHE), not inside it: the embedded
    build swaps its whole folder on rebuild."""
    from skyrl_stepwise.models.prepare import cache_root

    return cache_root() / "data" / "search_r1_demonstrations"


def build_search_r1_demonstrations(max_rows: int | None = None, topk: int = 3, cache: bool = True, *,
                                   env_cfg: SearchEnvConfig | None = None, out_dir: str | Path | None = None,
                                   dataset: EmbeddedDataset | None = None) -> Path:
    """Build (or reuse) the demonstrations parquet and return its path.

    `env_cfg` supplies the observation templates the RL run will use (its topk is replaced by `topk`);
    `dataset` defaults to the embedded build `make run` trains on. With `cache=False` the file is rebuilt
    (same bytes, same path). Columns: messages, instance_id, answer_found, num_searches, reward (the env's EM).
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    cfg = dataclasses.replace(env_cfg or SearchEnvConfig(), topk=topk)
    ds = dataset or build_embedded_search_r1()
    root = Path(out_dir).expanduser() if out_dir is not None else default_dir()
    path = root / f"demos-{cache_key(ds, max_rows, cfg)}.parquet"
    if cache and path.is_file():
        return path
    rows = train_rows(ds, max_rows)
    demos = asyncio.run(_play_all(rows, load_retriever(ds.corpus), cfg))
    write_parquet(demos, path)
    return path


# ----------------------------------------------------------------------------------------- reading

def _check_message(m: Any, where: str) -> dict[str, str]:
    """One chat message: a dict with a known role and string content; other non-null keys are kept."""
    if not isinstance(m, dict):
        raise ValueError(f"{where}: must be a {{'role', 'content'}} dict, got {type(m).__name__} {str(m)[:80]!r}")
    if m.get("role") not in ROLES:
        raise ValueError(f"{where}: 'role' must be one of {list(ROLES)}, got {m.get('role')!r}")
    if not isinstance(m.get("content"), str):
        raise ValueError(f"{where}: 'content' must be a string, got {type(m.get('content')).__name__} "
                         f"{str(m.get('content'))[:80]!r}")
    return {k: v for k, v in m.items() if v is not None}


def load_conversations(path: str | Path) -> list[list[dict]]:
    """Every row's `messages` from a parquet file (ours or a user's own SFT data), validated up front so a bad
    row fails here, naming the file, row and problem, instead of deep inside tokenization."""
    table = _read_table(path)
    if "messages" not in table.column_names:
        raise ValueError(f"{path}: missing column 'messages' (a list of {{'role', 'content'}} chat messages); "
                         f"the file has {table.column_names}")
    out = []
    for i, messages in enumerate(table.column("messages").to_pylist()):
        where = f"{path}: row {i}"
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of chat messages, "
                             f"got {str(messages)[:80]!r}")
        conv = [_check_message(m, f"{where}: 'messages'[{j}]") for j, m in enumerate(messages)]
        if not any(m["role"] == "assistant" for m in conv):
            raise ValueError(f"{where}: 'messages' has no assistant message, so there is nothing to train on")
        out.append(conv)
    return out


def load_conversation_tools(path: str | Path) -> list[list[dict] | None]:
    """Each row's own tool schemas (the optional `tools` column: JSON text of an OpenAI `tools` list, or null), as
    an agent sent them to the endpoint (loop/agent_demos.py writes it); None per row where the file has none."""
    table = _read_table(path)
    if "tools" not in table.column_names:
        return [None] * table.num_rows
    out: list[list[dict] | None] = []
    for i, value in enumerate(table.column("tools").to_pylist()):
        if value is None:
            out.append(None)
            continue
        try:
            tools = json.loads(value) if isinstance(value, str) else value
        except ValueError as e:
            raise ValueError(f"{path}: row {i}: 'tools' is not JSON ({e})") from None
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
                for t in tools):
            raise ValueError(f"{path}: row {i}: 'tools' must be a list of OpenAI function tools "
                             f"({{'type': 'function', 'function': {{'name', ...}}}}), got {str(tools)[:120]!r}")
        out.append(tools)
    return out


# ---------------------------------------------------------------------------------------------- CLI

def summary(path: str | Path) -> dict[str, float]:
    """Rows, fraction with the evidence retrieved, mean searches and mean reward of a demonstrations file."""
    t = pq.read_table(path, columns=["answer_found", "num_searches", "reward"]).to_pydict()
    n = len(t["answer_found"])
    return {"rows": n, "answer_found": sum(t["answer_found"]) / max(n, 1),
            "mean_searches": sum(t["num_searches"]) / max(n, 1), "mean_reward": sum(t["reward"]) / max(n, 1)}


def token_counts(path: str | Path) -> list[int]:
    """Chat-template token counts with the embedded SmolLM2 tokenizer: what an SFT step actually sees."""
    from transformers import AutoTokenizer

    from skyrl_stepwise.models.prepare import prepare_model

    tok = AutoTokenizer.from_pretrained(prepare_model())
    texts = [tok.apply_chat_template(m, tokenize=False) for m in load_conversations(path)]
    return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def main(argv: list[str] | None = None) -> int:
    """`python -m skyrl_stepwise.data.demonstrations [--max-rows N] [--topk K] [--no-cache] [--tokens]`."""
    p = argparse.ArgumentParser(prog="skyrl-stepwise data demonstrations", description=__doc__.splitlines()[0])
    p.add_argument("--max-rows", type=int, default=None, help="only the first N train questions")
    p.add_argument("--topk", type=int, default=3, help="documents per search (match environment.search.topk)")
    p.add_argument("--no-cache", action="store_true", help="rebuild even if a matching file exists")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default: $SKYRL_STEPWISE_CACHE/data/search_r1_demonstrations")
    p.add_argument("--tokens", action="store_true", help="also count SmolLM2 chat-template tokens per demo")
    args = p.parse_args(argv)
    path = build_search_r1_demonstrations(args.max_rows, args.topk, cache=not args.no_cache, out_dir=args.out_dir)
    s = summary(path)
    print(f"{path}\n  rows           {s['rows']}\n  answer_found   {s['answer_found']:.3f}\n"
          f"  mean searches  {s['mean_searches']:.3f}\n  mean reward    {s['mean_reward']:.3f}")
    if args.tokens:
        counts = sorted(token_counts(path))
        print(f"  tokens/demo    mean {sum(counts) / len(counts):.0f}, median {counts[len(counts) // 2]}, "
              f"max {counts[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
