"""The embedded offline dataset (real Wikipedia + FanOutQA) and the Search-R1 parquet converter."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skyrl_stepwise.data.dataset import (SYSTEM_PROMPT, USER_PREFIX, convert_search_r1_file, load_prompt_dataset,
                                         write_parquet)
from skyrl_stepwise.data.embedded import DESCRIPTION_SOURCE, FANOUT_SOURCE, build_embedded_search_r1
from skyrl_stepwise.envs.rewards import normalize_answer

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "search_r1" / "prepare_data.py"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_embedded_search_r1(tmp_path_factory.mktemp("embedded") / "sr1", seed=0)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_embedded_build_is_deterministic_and_reused(built, tmp_path):
    again = build_embedded_search_r1(tmp_path / "sr1", seed=0)
    for split in ("train", "validation"):
        assert load_prompt_dataset(getattr(built, split)) == load_prompt_dataset(getattr(again, split))
    assert built.corpus.read_bytes() == again.corpus.read_bytes()

    stamp = again.train.stat().st_mtime_ns
    assert build_embedded_search_r1(tmp_path / "sr1", seed=0).train.stat().st_mtime_ns == stamp  # cached
    other = build_embedded_search_r1(tmp_path / "sr1", seed=1)  # different seed: rebuilt in place
    assert other.manifest["seed"] == 1 and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    ids0 = {r.instance_id for r in load_prompt_dataset(built.validation)}
    ids1 = {r.instance_id for r in load_prompt_dataset(other.validation)}
    assert ids0 != ids1 and len(ids0) == len(ids1)


def test_embedded_rows_are_valid_search_prompts(built):
    train, val = load_prompt_dataset(built.train), load_prompt_dataset(built.validation)
    counts = built.manifest["counts"]
    assert (len(train), len(val)) == (counts["train"], counts["validation"])
    assert len(train) > 5000 and counts["validation_by_source"][FANOUT_SOURCE] >= 50
    assert {r.data_source for r in train} == {DESCRIPTION_SOURCE}
    assert not {r.extra_info["question"] for r in train} & {r.extra_info["question"] for r in val}
    for row in train[:50] + val:
        assert row.env_class == "search" and row.prompt[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert row.prompt[1]["role"] == "user" and row.prompt[1]["content"].startswith(USER_PREFIX)
        assert row.prompt[1]["content"].endswith("?")
    card = built.card.read_text()
    assert "CC BY-SA 4.0" in card and f"{counts['train']} rows" in card


def test_every_answer_is_in_its_evidence_passage(built):
    """What makes the set gradeable offline: the golden answer occurs in the passage search should find."""
    by_title = {}
    with built.corpus.open() as f:
        for line in f:
            contents = json.loads(line)["contents"]
            by_title[contents.split("\n", 1)[0].strip('"')] = normalize_answer(contents)
    assert len(by_title) == built.manifest["counts"]["corpus_docs"] == 10033
    for row in load_prompt_dataset(built.validation) + load_prompt_dataset(built.train)[:500]:
        passage = by_title[row.extra_info["evidence_title"]]
        targets = [normalize_answer(t) for t in row.reward_spec["ground_truth"]["target"]]
        assert any(re.search(rf"\b{re.escape(t)}\b", passage) for t in targets), row.instance_id


def search_r1_rows(n: int = 3) -> list[dict]:
    """Rows laid out like Search-R1's qa_search_train_merge.py output (FlashRAG columns kept)."""
    prefix = "Answer the given question. ... For example, <answer> Beijing </answer>. Question: "
    return [{"id": f"train_{i}", "question": f"who wrote book {i}", "golden_answers": [f"Author {i}", f"A{i}"],
             "data_source": "nq", "prompt": [{"role": "user", "content": f"{prefix}who wrote book {i}?\n"}],
             "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"Author {i}", f"A{i}"]}},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_convert_search_r1_parquet(tmp_path):
    src = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(search_r1_rows()), src)
    assert convert_search_r1_file(src, tmp_path / "out" / "train.parquet") == 3
    rows = load_prompt_dataset(tmp_path / "out" / "train.parquet")
    assert [r.instance_id for r in rows] == ["train-0", "train-1", "train-2"]
    r = rows[1]
    assert r.env_class == "search" and r.data_source == "nq"
    assert r.prompt == [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": USER_PREFIX + "who wrote book 1?"}]
    assert r.reward_spec["ground_truth"]["target"] == ["Author 1", "A1"]
    assert r.extra_info == {"split": "train", "index": 1, "question": "who wrote book 1"}
    kept = pq.read_table(tmp_path / "out" / "train.parquet").column_names
    assert {"id", "question", "golden_answers", "ability", "reward_model"} <= set(kept)


def test_convert_without_question_column_reads_the_prompt(tmp_path):
    rows = [{k: v for k, v in row.items() if k != "question"} for row in search_r1_rows(1)]
    src = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    convert_search_r1_file(src, tmp_path / "validation.parquet")
    (row,) = load_prompt_dataset(tmp_path / "validation.parquet")
    assert row.prompt[1]["content"] == USER_PREFIX + "who wrote book 0?"


def test_prepare_data_script_and_clear_errors(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    src = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(search_r1_rows()), src)
    assert main(["--train", str(src), "--out-dir", str(tmp_path / "out")]) == 0
    assert "(3 rows)" in capsys.readouterr().out
    assert len(load_prompt_dataset(tmp_path / "out" / "train.parquet")) == 3

    broken = tmp_path / "broken.parquet"
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "reward_model"}
                                         for r in search_r1_rows()]), broken)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['reward_model'\]"):
        main(["--train", str(broken), "--out-dir", str(tmp_path / "out2")])
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        main(["--validation", str(tmp_path / "nope.parquet"), "--out-dir", str(tmp_path / "out3")])


def test_load_prompt_dataset_names_bad_columns_and_rows(tmp_path):
    good = {"prompt": [{"role": "user", "content": "q"}], "env_class": "search", "data_source": "x",
            "reward_spec": {"ground_truth": {"target": ["a"]}}, "extra_info": {"k": 1}, "instance_id": "a"}
    write_parquet([{k: v for k, v in good.items() if k != "instance_id"}], tmp_path / "no_id.parquet")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['instance_id'\]"):
        load_prompt_dataset(tmp_path / "no_id.parquet")
    write_parquet([good, {**good, "instance_id": "b", "reward_spec": {"ground_truth": {"other": ["a"]}}}],
                  tmp_path / "bad_target.parquet")
    with pytest.raises(ValueError, match=r"row 1 \(instance_id='b'\): 'reward_spec' needs ground_truth.target"):
        load_prompt_dataset(tmp_path / "bad_target.parquet")
    # your own env grades with whatever its rows carry: no golden answers needed, and a null reward_spec is {}
    own = {**good, "env_class": "guess", "reward_spec": {"secret": 7}}
    write_parquet([own, {**own, "instance_id": "b", "reward_spec": None}], tmp_path / "own.parquet")
    assert [r.reward_spec for r in load_prompt_dataset(tmp_path / "own.parquet")] == [{"secret": 7}, {}]
    write_parquet([{**good, "env_class": "tool", "reward_spec": {"ground_truth": {"target": []}}}],
                  tmp_path / "empty_target.parquet")
    with pytest.raises(ValueError, match=r"needs ground_truth.target \(the golden answers\) for env_class 'tool'"):
        load_prompt_dataset(tmp_path / "empty_target.parquet")
    write_parquet([good, good], tmp_path / "dup.parquet")
    with pytest.raises(ValueError, match="'instance_id' 'a' repeats"):
        load_prompt_dataset(tmp_path / "dup.parquet")
    (tmp_path / "not.parquet").write_text("hello")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_prompt_dataset(tmp_path / "not.parquet")


def test_rows_whose_extra_info_is_always_empty_round_trip(tmp_path):
    """Parquet cannot store a struct with no fields: a toy dataset with `extra_info: {}` must still be writable."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "env_class": "keyword", "data_source": "toy",
             "reward_spec": {"ground_truth": {"target": ["blue"]}}, "extra_info": {}, "instance_id": f"c{i}"}
            for i in range(2)]
    write_parquet(rows, tmp_path / "toy.parquet")
    loaded = load_prompt_dataset(tmp_path / "toy.parquet")
    assert [(r.instance_id, r.extra_info, r.reward_spec) for r in loaded] == \
        [("c0", {}, {"ground_truth": {"target": ["blue"]}}), ("c1", {}, {"ground_truth": {"target": ["blue"]}})]


def test_each_row_gets_back_exactly_its_own_extra_info_keys(tmp_path):
    """Parquet stores a column of dicts as one struct over every row's keys: rows came back with the others' keys set
    to None, and a user's env reset saw keys its row never had (e.g. `"tools" in extra_info` with value None)."""
    base = {"prompt": [{"role": "user", "content": "q"}], "env_class": "mine", "data_source": "x"}
    extras = [{"level": 1}, {"tools": ["search"], "meta": {"seed": 3}},
              {"meta": {"name": "n", "tags": [{"k": 1}, {"v": 2}]}}]
    specs = [{"answer": 4}, {"rubric": "strict"}, {}]
    pq.write_table(pa.Table.from_pylist([{**base, "instance_id": f"r{i}", "extra_info": e, "reward_spec": s}
                                         for i, (e, s) in enumerate(zip(extras, specs))]), tmp_path / "mixed.parquet")
    loaded = load_prompt_dataset(tmp_path / "mixed.parquet")
    assert [r.extra_info for r in loaded] == extras
    assert [r.reward_spec for r in loaded] == specs
    assert loaded[0].env_extras()["extra_info"] == {"level": 1}


def test_json_lines_datasets_load_like_parquet(tmp_path):
    """A `.jsonl` dataset (one row a line: the committed example sets) reads as the same rows as its parquet, and a
    broken line names the file."""
    import json

    from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "env_class": "keyword",
             "reward_spec": {"ground_truth": str(i)}, "data_source": "t", "extra_info": {"k": i},
             "instance_id": f"r{i}"} for i in range(3)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_parquet(rows, tmp_path / "d.parquet")
    assert load_prompt_dataset(tmp_path / "d.jsonl") == load_prompt_dataset(tmp_path / "d.parquet")
    (tmp_path / "bad.jsonl").write_text('{"prompt": [\n')
    with pytest.raises(ValueError, match="bad.jsonl: not readable JSON lines"):
        load_prompt_dataset(tmp_path / "bad.jsonl")


def test_openai_content_parts_in_a_dataset_are_joined_and_images_refused_naming_the_part(tmp_path):
    """Datasets written for OpenAI's API carry `content` as parts: text parts load as one string (as the agent
    endpoint joins them); an image part stops the load naming the file, row, message and part."""
    import json

    from skyrl_stepwise.data.dataset import load_prompt_dataset

    def row(content):
        return {"prompt": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                           {"role": "user", "content": content}], "env_class": "keyword",
                "reward_spec": {"ground_truth": "4"}, "data_source": "t", "extra_info": {}, "instance_id": "r0"}

    (tmp_path / "parts.jsonl").write_text(json.dumps(row([{"type": "text", "text": "2+2"},
                                                          {"type": "text", "text": "?"}])) + "\n")
    (loaded,) = load_prompt_dataset(tmp_path / "parts.jsonl")
    assert loaded.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    (tmp_path / "image.jsonl").write_text(json.dumps(row([{"type": "text", "text": "what is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])) + "\n")
    with pytest.raises(ValueError, match=r"image.jsonl: row 0 .*'prompt'\[1\]\['content'\]\[1\]: only text parts"):
        load_prompt_dataset(tmp_path / "image.jsonl")
