"""Our prompt dataset format (parquet) and the converter from Search-R1's parquet files.

One row = one prompt. Columns:
  prompt       list of {"role", "content"} chat messages (content: a string, or OpenAI text parts, joined at load)
  env_class    name registered in the EnvRegistry (e.g. "search")
  reward_spec  what the row's env grades with (a dict, may be empty); the built-in search and tool envs need
               {"ground_truth": {"target": [answers, ...]}, ...}, checked at load; your own env reads what it wants
  data_source  where the row came from, for per-source metrics
  extra_info   free-form dict (split, index, question, ...)
  instance_id  unique string id, so trajectories can be traced back to their prompt
Other columns are allowed and ignored (a converted Search-R1 file keeps all of its own).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from skyrl_stepwise.chat.base import text_content

Message = dict[str, str]
REQUIRED_COLUMNS = ("prompt", "env_class", "reward_spec", "data_source", "extra_info", "instance_id")
SEARCH_R1_COLUMNS = ("data_source", "prompt", "reward_model", "extra_info")
# built-in env classes that grade an answer against reward_spec.ground_truth.target (envs/search.py, envs/tool.py)
ENVS_GRADED_BY_TARGET = ("search", "tool")

# SkyRL's wording of Search-R1's instruction (SR1's "as your want" typo fixed), system message included.
SYSTEM_PROMPT = "You are a helpful and harmless assistant."
USER_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> "
    "first every time you get new information. After reasoning, if you find you lack "
    "some knowledge, you can call a search engine by <search> query </search> "
    "and it will return the top searched results between <information> and "
    "</information>. You can search as many times as you want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: "
)


@dataclass
class PromptRow:
    """One validated dataset row, as the trainer hands it to the generator."""

    prompt: list[Message]
    env_class: str
    reward_spec: dict[str, Any]
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    instance_id: str = ""

    def env_extras(self) -> dict[str, Any]:
        """What `Env.reset` receives: everything but the prompt."""
        return {"reward_spec": self.reward_spec, "extra_info": self.extra_info,
                "data_source": self.data_source, "instance_id": self.instance_id}


def search_r1_prompt(question: str) -> list[Message]:
    """System + user messages as SkyRL builds them; like SR1, a '?' is appended when missing."""
    question = question.strip()
    if question and not question.endswith("?"):
        question += "?"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_PREFIX + question}]


def _read_table(path: str | Path) -> pa.Table:
    """A parquet file, or JSON lines (`.jsonl`: small hand-written or committed example sets, one row a line), as
    one Arrow table; both go through the same row checks."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        from pyarrow import json as pa_json

        try:
            return pa_json.read_json(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not readable JSON lines ({e})") from None
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None


def _require_columns(table: pa.Table, required: tuple[str, ...], path: str | Path, what: str) -> None:
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} required for {what}; "
                         f"the file has {table.column_names}")


# free-form dict columns: stored as Arrow structs, whose fields are the union of every row's keys
FREE_FORM_COLUMNS = ("reward_spec", "extra_info")


def own_keys(value: Any) -> Any:
    """A struct value as its row wrote it: parquet stores a column of dicts as one struct with the union of every
    row's keys, so a row reads back with the other rows' keys set to None. Those are dropped (nested dicts too),
    so an env's reset sees exactly its row's keys; a key a row set to None itself cannot be told apart and is
    dropped as well."""
    if isinstance(value, dict):
        return {k: own_keys(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [own_keys(v) for v in value]
    return value


def _validate_row(row: dict[str, Any], i: int, path: str | Path) -> PromptRow:
    where = f"{path}: row {i} (instance_id={row.get('instance_id')!r})"
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {str(prompt)[:80]!r}")
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: 'prompt'[{j}] must be {{'role': str, 'content': str}}, got {str(m)[:80]!r}")
        # OpenAI-style content parts are joined (text only): such datasets load as they are written
        messages.append({"role": m["role"], "content": text_content(m.get("content"),
                                                                     f"{where}: 'prompt'[{j}]['content']")})
    if not isinstance(row["env_class"], str) or not row["env_class"]:
        raise ValueError(f"{where}: 'env_class' must be a non-empty string, got {row['env_class']!r}")
    if not isinstance(row["instance_id"], str) or not row["instance_id"]:
        raise ValueError(f"{where}: 'instance_id' must be a non-empty string, got {row['instance_id']!r}")
    spec = {} if row["reward_spec"] is None else row["reward_spec"]
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: 'reward_spec' must be a dict (or null), got {str(spec)[:120]!r}")
    extra = row["extra_info"] if isinstance(row["extra_info"], dict) else {}
    out = PromptRow(messages, row["env_class"], spec,
                    str(row["data_source"]), extra, row["instance_id"])
    check_reward_spec(out, where)
    return out


def check_reward_spec(row: PromptRow, where: str) -> None:
    """A row for a built-in env that grades against golden answers must carry them, or every rollout of it would
    fail at the env's reset; rows of other env classes (your own) may carry anything, or nothing."""
    if row.env_class not in ENVS_GRADED_BY_TARGET:
        return
    target = (row.reward_spec.get("ground_truth") or {}).get("target") \
        if isinstance(row.reward_spec.get("ground_truth"), dict) else None
    if target is None or (isinstance(target, (str, list, tuple)) and len(target) == 0):
        raise ValueError(f"{where}: 'reward_spec' needs ground_truth.target (the golden answers) for env_class "
                         f"{row.env_class!r}, got {str(row.reward_spec)[:120]!r}")


def load_prompt_dataset(path: str | Path) -> list[PromptRow]:
    """Read and validate a dataset file; every problem names the file, row, and column."""
    table = _read_table(path)
    _require_columns(table, REQUIRED_COLUMNS, path, "a prompt dataset")
    rows = table.select(list(REQUIRED_COLUMNS)).to_pylist()
    structs = [c for c in FREE_FORM_COLUMNS if pa.types.is_struct(table.schema.field(c).type)]
    for row in rows:
        row.update({c: own_keys(row[c]) for c in structs})
    out = [_validate_row(row, i, path) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, r in enumerate(out):
        if r.instance_id in seen:
            raise ValueError(f"{path}: 'instance_id' {r.instance_id!r} repeats (rows {seen[r.instance_id]} and {i})")
        seen[r.instance_id] = i
    return out


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows as an Arrow table; a column of only empty dicts (e.g. `extra_info: {}` everywhere) is an Arrow
    struct with no fields, which parquet cannot store, so it is written as nulls (read back as `{}`)."""
    table = pa.Table.from_pylist(rows)
    for i, column in enumerate(table.schema):
        if pa.types.is_struct(column.type) and column.type.num_fields == 0:
            table = table.set_column(i, pa.field(column.name, pa.null()), pa.nulls(len(table)))
    return table


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Write rows atomically (temp file + rename) so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(_table(rows), tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def question_from_search_r1_row(row: dict[str, Any]) -> str:
    """The bare question: FlashRAG's `question` column if kept, else the text after SR1's 'Question: '."""
    if isinstance(row.get("question"), str) and row["question"].strip():
        return row["question"]
    users = [m.get("content", "") for m in row["prompt"] or [] if isinstance(m, dict) and m.get("role") == "user"]
    text = users[-1] if users else ""
    if "Question:" not in text:
        raise ValueError("row has no 'question' column and its user prompt has no 'Question: ' marker")
    return text.rsplit("Question:", 1)[1]


def convert_search_r1_rows(table: pa.Table, path: str | Path, id_prefix: str) -> list[dict[str, Any]]:
    """Search-R1 rows -> our rows: new prompt, env_class="search", reward_spec; other columns kept."""
    _require_columns(table, SEARCH_R1_COLUMNS, path, "Search-R1 conversion")
    out = []
    for i, row in enumerate(table.to_pylist()):
        where = f"{path}: row {i}"
        reward_model = row["reward_model"]
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        target = truth.get("target") if isinstance(truth, dict) else None
        if target is None:
            raise ValueError(f"{where}: 'reward_model' needs ground_truth.target, got {str(reward_model)[:120]!r}")
        try:
            question = question_from_search_r1_row(row)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        extra = dict(row["extra_info"] or {})
        extra.setdefault("question", question.strip())
        targets = [target] if isinstance(target, str) else [str(t) for t in target]
        out.append({**row, "prompt": search_r1_prompt(question), "env_class": "search",
                    "reward_spec": {**reward_model, "ground_truth": {**truth, "target": targets}},
                    "extra_info": extra, "instance_id": f"{id_prefix}-{i}"})
    return out


def convert_search_r1_file(src: str | Path, dst: str | Path) -> int:
    """Convert one Search-R1 parquet file into our format at `dst`, re-validated on the way out."""
    rows = convert_search_r1_rows(_read_table(src), src, Path(src).stem)
    write_parquet(rows, dst)
    load_prompt_dataset(dst)
    return len(rows)
