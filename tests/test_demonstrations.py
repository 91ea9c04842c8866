"""SFT demonstrations for the embedded Search-R1 task: deterministic, train-only, well-formed, and replayable
through the real SearchEnv + retrieval server with the same observations and reward; plus the SFT reader."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet
from skyrl_stepwise.data.demonstrations import (build_search_r1_demonstrations, keyword_query, load_conversations,
                                                load_retriever, primary_query, retry_query, summary)
from skyrl_stepwise.data.embedded import build_embedded_search_r1
from skyrl_stepwise.envs.search import SearchEnv, SearchEnvConfig, parse_action
from skyrl_stepwise.retrieval.server import BackgroundServer, create_app

N_ROWS = 30  # the first 30 train questions hold all three shapes: found at once, found on retry, best guess


@pytest.fixture(scope="module")
def embedded():
    return build_embedded_search_r1()  # the shared cached build `make run` uses


@pytest.fixture(scope="module")
def demo_path(embedded, tmp_path_factory):
    return build_search_r1_demonstrations(N_ROWS, out_dir=tmp_path_factory.mktemp("demos"))


@pytest.fixture(scope="module")
def demos(demo_path):
    return pq.read_table(demo_path).to_pylist()


@pytest.fixture(scope="module")
def train_rows(embedded):
    return {r.instance_id: r for r in load_prompt_dataset(embedded.train)}


def test_queries_are_derived_deterministically():
    q = 'Which Wikipedia article is described as "American inventor and businessman (1847–1931)"?'
    assert primary_query(q) == "American inventor and businessman (1847–1931)"
    # the two longest words (ties: alphabetical), in question order; parenthetical and stopwords dropped
    assert keyword_query(primary_query(q), 2) == "American businessman"
    assert retry_query(q, [primary_query(q)]) == "American businessman"
    assert retry_query('Which Wikipedia article is described as "Genus  of fishes"?', ["Genus of fishes"]) \
        == "Genus fishes"
    assert retry_query("x", ["x"]) is None  # no different query left: the demo guesses instead
    assert primary_query("who wrote Hamlet?") == "who wrote Hamlet"


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_build_is_deterministic_cached_and_keyed(demo_path, tmp_path):
    again = build_search_r1_demonstrations(N_ROWS, out_dir=demo_path.parent, cache=False)
    assert again == demo_path
    first = build_search_r1_demonstrations(N_ROWS, out_dir=tmp_path, cache=False)
    assert first.read_bytes() == demo_path.read_bytes()  # same bytes from a fresh build elsewhere
    stamp = first.stat().st_mtime_ns
    assert build_search_r1_demonstrations(N_ROWS, out_dir=tmp_path).stat().st_mtime_ns == stamp  # reused
    assert build_search_r1_demonstrations(N_ROWS, topk=2, out_dir=tmp_path) != first  # other input, other key
    assert build_search_r1_demonstrations(5, out_dir=tmp_path) != first
    with pytest.raises(ValueError, match="max_rows"):
        build_search_r1_demonstrations(0, out_dir=tmp_path)


def test_only_train_questions(demos, embedded, train_rows):
    validation = load_prompt_dataset(embedded.validation)
    val_ids = {r.instance_id for r in validation}
    val_questions = {r.extra_info["question"] for r in validation}
    ids = [d["instance_id"] for d in demos]
    assert ids == list(train_rows)[:N_ROWS]  # train order, one row per question
    assert not set(ids) & val_ids
    for d in demos:
        assert train_rows[d["instance_id"]].extra_info["split"] == "train"
        assert not any(q in d["messages"][1]["content"] for q in val_questions)


def test_actions_parse_in_order(demos, train_rows):
    shapes = set()
    for d in demos:
        row, messages = train_rows[d["instance_id"]], d["messages"]
        assert messages[:2] == row.prompt  # the row's own system + user prompt
        turns = messages[2:]
        assert [m["role"] for m in turns] == ["assistant", "user"] * d["num_searches"] + ["assistant"]
        actions = [parse_action(m["content"]) for m in turns if m["role"] == "assistant"]
        assert [a[0] for a in actions] == ["search"] * d["num_searches"] + ["answer"], actions
        assert all(m["content"].startswith("\n\n<information>Doc 1(Title: ") for m in turns if m["role"] == "user")
        assert all("<|im_end|>" not in m["content"] and not m["content"].endswith("\n") for m in turns[::2])
        if d["answer_found"]:
            assert actions[-1][1] == row.extra_info["evidence_title"]
            assert f'(Title: "{actions[-1][1]}")' in turns[-2]["content"]  # read off the last observation
        shapes.add((d["answer_found"], d["num_searches"]))
    assert shapes == {(True, 1), (True, 2), (False, 2)}, shapes


@pytest.mark.integration
async def test_replay_through_real_env_and_server(demos, embedded, train_rows):
    """The env's client goes over HTTP to a real server on the same index: byte-identical observations."""
    with BackgroundServer(create_app(load_retriever(str(embedded.corpus)))) as server:
        cfg = SearchEnvConfig(search_url=f"{server.url}/retrieve", timeout_s=10.0, max_retries=1)
        for d in demos:
            row, messages = train_rows[d["instance_id"]], d["messages"]
            env = SearchEnv(cfg)
            await env.reset(row.prompt, {**row.env_extras(), "max_turns": 3})  # the tiny recipe's max_turns
            for i in range(2, len(messages), 2):
                step = await env.step(messages[i]["content"])
                if i == len(messages) - 1:
                    assert step.done and step.reward == (1.0 if d["answer_found"] else 0.0) == d["reward"]
                else:
                    assert not step.done and step.metrics["search_failures"] == 0.0
                    assert step.observations == [messages[i + 1]], d["instance_id"]
            await env.client.aclose()


def test_summary_and_load_conversations(demo_path, demos):
    s = summary(demo_path)
    assert s["rows"] == N_ROWS and s["answer_found"] == sum(d["answer_found"] for d in demos) / N_ROWS
    assert load_conversations(demo_path) == [d["messages"] for d in demos]


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "user", "content": "hi"}], "row 1: 'messages' has no assistant message"),
    ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "row 1: 'messages'[0]: 'role'"),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "x"}],
     "row 1: 'messages'[0]: 'content' must be a string"),
    ([], "row 1: 'messages' must be a non-empty list"),
])
def test_load_conversations_errors_name_the_row(tmp_path, messages, problem):
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path = tmp_path / "sft.parquet"
    write_parquet([{"messages": good}, {"messages": messages}], path)
    with pytest.raises(ValueError) as e:
        load_conversations(path)
    assert str(path) in str(e.value) and problem in str(e.value)


def test_load_conversations_needs_the_column(tmp_path):
    path = tmp_path / "prompts.parquet"
    write_parquet([{"prompt": [{"role": "user", "content": "q"}]}], path)
    with pytest.raises(ValueError, match=r"prompts\.parquet: missing column 'messages'.*\['prompt'\]"):
        load_conversations(path)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_conversations(tmp_path / "nope.parquet")


def test_cut_passages_get_their_own_cache_key(embedded):
    """Demonstrations show the env's observations byte for byte, so a cut changes the file; whole passages keep
    the key they had before the knob existed (their cached demonstrations and warm starts stay valid)."""
    from skyrl_stepwise.data.demonstrations import cache_key

    whole = cache_key(embedded, 48, SearchEnvConfig())
    assert cache_key(embedded, 48, SearchEnvConfig(max_doc_words=0)) == whole
    assert len({whole, cache_key(embedded, 48, SearchEnvConfig(max_doc_words=40)),
                cache_key(embedded, 48, SearchEnvConfig(max_doc_words=30))}) == 3
