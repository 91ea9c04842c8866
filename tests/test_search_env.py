"""Search env against a real retrieval server (uvicorn on 127.0.0.1), plus EM normalization and failure paths."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.rewards import em_check, last_answer, normalize_answer, subem_check
from skyrl_stepwise.envs.search import (INVALID_ACTION, SearchEnv, SearchEnvConfig, intermediate_retrieval_reward,
                                        parse_action, register_search_env)
from skyrl_stepwise.retrieval.index import load_or_build, truncate_words
from skyrl_stepwise.retrieval.server import BackgroundServer, create_app
from test_retrieval_server import small_corpus

EXTRAS = {"reward_spec": {"ground_truth": {"target": ["Asia"]}}}
PROMPT = [{"role": "user",
           "content": "Answer ... For example, <answer> Beijing </answer>. Question: largest continent?"}]


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    root = tmp_path_factory.mktemp("search_env")
    return load_or_build(small_corpus(root / "corpus.jsonl"), root / "idx", show_progress=False, backend="numpy")


@pytest.fixture(scope="module")
def server(retriever):
    with BackgroundServer(create_app(retriever)) as srv:
        yield srv


def fast_cfg(url: str, **kw) -> SearchEnvConfig:
    return SearchEnvConfig(search_url=f"{url}/retrieve", timeout_s=kw.pop("timeout_s", 5.0),
                           max_retries=kw.pop("max_retries", 1), backoff_s=0.01, **kw)


@pytest.mark.parametrize("pred, gold, em", [
    ("The Beatles", "beatles", True),
    ("  Paris!! ", "paris", True),
    ("U.S.A.", "usa", True),
    ("an apple", "Apple", True),
    ("Cupertino, California", "cupertino california", True),
    ("Theatre", "atre", False),  # articles only as whole words
    ("Paris, France", "Paris", False),
    ("1631", "1631.", True),
    ("Queen", ["Queen (band)", "Queen"], True),
])
def test_em_normalization(pred, gold, em):
    assert em_check(pred, gold) is em


def test_normalize_and_subem():
    assert normalize_answer("The  Eiffel\tTower, in PARIS.") == "eiffel tower in paris"
    assert subem_check("it is Paris, France", ["paris"]) and not em_check("it is Paris, France", ["paris"])
    assert last_answer("<answer> a </answer> then <answer>\nB\n</answer>") == "B"
    assert last_answer("no tags") is None


def test_parse_action_takes_first_tag_like_search_r1():
    assert parse_action("<think>x</think><search> q1 </search><answer>a</answer>") == ("search", "q1")
    assert parse_action("<answer>\n Asia </answer><search>q</search>") == ("answer", "Asia")
    assert parse_action("<search>unclosed") is None
    assert parse_action("<search>a</answer>") is None  # mismatched pair


@pytest.mark.integration
async def test_search_then_answer(server):
    env = SearchEnv(fast_cfg(server.url))
    assert await env.reset(PROMPT, {**EXTRAS, "max_turns": 4}) == PROMPT
    step = await env.step("<think>I should look it up.</think>\n<search> largest continent by land area </search>")
    assert not step.done and step.reward == 0.0
    (obs,) = step.observations
    assert obs["role"] == "user"
    text = obs["content"]
    assert text.startswith('\n\n<information>Doc 1(Title: "Asia") Asia is the largest continent')
    assert text.endswith("</information>\n\n") and text.count("\nDoc ") == 2  # topk=3, SR1 layout
    assert step.metrics["search_calls"] == 1 and step.metrics["search_failures"] == 0
    assert step.metrics["retrieval_seconds"] > 0

    final = await env.step("<think>Doc 1 says so.</think><answer> Asia </answer>")
    assert final.done and final.reward == 1.0 and final.observations == []
    assert final.metrics["em"] == 1.0 and final.metrics["answered"] == 1.0


@pytest.mark.integration
async def test_prompt_example_is_not_the_models_answer(server):
    """The prompt's `<answer> Beijing </answer>` must not count: the env only ever sees actions."""
    env = SearchEnv(fast_cfg(server.url))
    await env.reset(PROMPT, {"reward_spec": {"ground_truth": {"target": ["Beijing"]}}, "max_turns": 2})
    step = await env.step("<answer>Paris</answer>")
    assert step.done and step.reward == 0.0
    await env.reset(PROMPT, {"reward_spec": {"ground_truth": {"target": ["Beijing"]}}, "max_turns": 1})
    step = await env.step("I think the answer is Beijing but I won't tag it.")
    assert step.done and step.reward == 0.0 and step.metrics["answered"] == 0.0


@pytest.mark.integration
async def test_invalid_action_gets_search_r1_message(server):
    env = SearchEnv(fast_cfg(server.url))
    await env.reset(PROMPT, {**EXTRAS, "max_turns": 3})
    step = await env.step("Let me think about continents.")
    assert not step.done and step.observations == [{"role": "user", "content": INVALID_ACTION}]
    assert step.metrics["invalid_actions"] == 1 and step.metrics["search_calls"] == 0


@pytest.mark.integration
async def test_max_turns_counts_llm_turns_and_skips_the_last_search(server):
    """SkyRL semantics: max_turns=2 -> one executed search, done at the second action without an answer."""
    env = SearchEnv(fast_cfg(server.url))
    await env.reset(PROMPT, {**EXTRAS, "max_turns": 2})
    first = await env.step("<search>continent</search>")
    assert not first.done and first.metrics["search_calls"] == 1
    last = await env.step("<search>largest continent</search>")
    assert last.done and last.reward == 0.0 and last.observations == [] and last.metrics["search_calls"] == 0


@pytest.mark.integration
async def test_answer_in_last_turn_after_search_tag_is_graded(server):
    env = SearchEnv(fast_cfg(server.url))
    await env.reset(PROMPT, {**EXTRAS, "max_turns": 1})
    step = await env.step("<search>continent</search> ... <answer>asia</answer>")
    assert step.done and step.reward == 1.0


async def test_missing_ground_truth_names_the_key():
    with pytest.raises(KeyError, match=r"reward_spec'\]\['ground_truth'\]\['target'\]"):
        await SearchEnv().reset(PROMPT, {"reward_spec": {"style": "rule"}})


def test_bad_template_is_rejected_at_config_time():
    with pytest.raises(ValueError, match="doc_template"):
        SearchEnvConfig(doc_template="Doc {idx}: {text}")
    with pytest.raises(ValueError, match="max_doc_words must be >= 0"):
        SearchEnvConfig(max_doc_words=-1)


def test_truncate_words_marks_the_cut_and_leaves_short_texts_alone():
    assert truncate_words("one two  three", 0) == "one two  three"  # 0 = whole passage, spacing kept
    assert truncate_words("one two  three", 3) == "one two  three"  # not longer than the cap: untouched
    assert truncate_words("one two\nthree four", 2) == "one two ..."


async def test_max_doc_words_cuts_each_passage_in_the_observation(retriever):
    """Same search, whole vs cut passages: titles and Doc numbering kept, each text its first N words + " ..."."""
    from skyrl_stepwise.data.demonstrations import InProcessRetrievalClient

    client = InProcessRetrievalClient(retriever)
    texts = {}
    for words in (0, 4):
        env = SearchEnv(SearchEnvConfig(max_doc_words=words), client)
        await env.reset(PROMPT, {**EXTRAS, "max_turns": 3})
        (obs,) = (await env.step("<search> largest continent by land area </search>")).observations
        texts[words] = obs["content"]
    whole = [line for line in texts[0].strip().removeprefix("<information>").splitlines() if line.startswith("Doc ")]
    cut = [line for line in texts[4].strip().removeprefix("<information>").splitlines() if line.startswith("Doc ")]
    assert len(whole) == len(cut) == 3
    for full_line, cut_line in zip(whole, cut):
        head, _, body = full_line.partition(") ")
        assert cut_line.startswith(head + ") ")  # "Doc i(Title: ...)" unchanged
        words = body.removesuffix("</information>").split()
        expected = " ".join(words[:4]) + (" ..." if len(words) > 4 else "")
        assert cut_line.removeprefix(head + ") ").removesuffix("</information>") == expected
    assert len(texts[4]) < len(texts[0])


@pytest.mark.integration
async def test_retriever_killed_mid_episode(retriever):
    srv = BackgroundServer(create_app(retriever)).start()
    env = SearchEnv(fast_cfg(srv.url, timeout_s=2.0, retriever_down="observe"))
    await env.reset(PROMPT, {**EXTRAS, "max_turns": 4})
    ok = await env.step("<search>Asia</search>")
    assert ok.metrics["search_failures"] == 0
    await asyncio.to_thread(srv.stop)
    failed = await env.step("<search>Asia again</search>")
    assert not failed.done and failed.metrics["search_failures"] == 1 and failed.metrics["search_calls"] == 1
    assert failed.observations[0]["content"].startswith("\n\n<information>Search failed: ")
    assert "failed after 2 tries" in failed.observations[0]["content"]
    final = await env.step("<answer>Asia</answer>")  # the episode carries on and is still graded
    assert final.done and final.reward == 1.0


@pytest.fixture(scope="module")
def broken_server():
    """A real HTTP server that misbehaves in the ways a retriever can: garbage, 5xx, wrong JSON, too slow."""
    app, hits = FastAPI(), {"error": 0}

    @app.post("/garbage")
    def garbage():
        return PlainTextResponse("<html>oops</html>")

    @app.post("/error")
    def error():
        hits["error"] += 1
        return PlainTextResponse("internal error", status_code=500)

    @app.post("/wrong-shape")
    def wrong_shape():
        return JSONResponse({"result": [["just a string"]]})

    @app.post("/slow")
    def slow():
        time.sleep(1.0)
        return JSONResponse({"result": [[]]})

    with BackgroundServer(app) as srv:
        yield srv, hits


@pytest.mark.parametrize("route, needle", [
    ("garbage", "non-JSON"),
    ("error", "HTTP 500"),
    ("wrong-shape", "no 'contents'"),
    ("slow", "Timeout"),
])
@pytest.mark.integration
async def test_misbehaving_retriever_is_a_counted_failure(broken_server, route, needle):
    srv, hits = broken_server
    before = hits["error"]
    env = SearchEnv(SearchEnvConfig(search_url=f"{srv.url}/{route}", timeout_s=0.2, max_retries=2, backoff_s=0.01,
                                    retriever_down="observe"))
    await env.reset(PROMPT, {**EXTRAS, "max_turns": 3})
    step = await env.step("<search>anything</search>")
    assert not step.done and step.metrics["search_failures"] == 1
    assert needle in step.observations[0]["content"]
    if route == "error":
        assert hits["error"] - before == 3  # 5xx is retried: 1 try + max_retries


@pytest.mark.integration
@pytest.mark.parametrize("conversation", [False, True])
async def test_generator_rollout_with_search_env(server, tokenizer, conversation):
    """Scripted actions through the real generator + tokenizer: the observation lands exactly as SR1 writes it."""
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
    from skyrl_stepwise.inference.scripted import ScriptedEngine

    actions = ["<think>look it up</think><search> largest continent </search>", "<answer> Asia </answer>"]
    def script(prompt, session, i):
        return tokenizer.encode(actions[i], add_special_tokens=False) + [tokenizer.eos_token_id]
    registry = EnvRegistry()
    register_search_env(registry, fast_cfg(server.url))
    cfg = GeneratorConfig(max_turns=4, max_input_length=8192, use_conversation_multi_turn=conversation,
                          sampling=GeneratorSamplingConfig(max_generate_length=64, stop=["</search>", "</answer>"]),
                          show_progress=False)
    engine = ScriptedEngine(script, tokenizer)
    out = await StepwiseGenerator(tokenizer, engine, registry, cfg).generate(
        [PROMPT], ["search"], [EXTRAS], [TrajectoryID("q0", 0)])
    second_prompt = tokenizer.decode(engine.calls[1][1])
    sr1_text = '</search>\n\n<information>Doc 1(Title: "Asia") Asia is the largest continent'
    if conversation:
        assert "<information>Doc 1(Title: \"Asia\")" in second_prompt and sr1_text not in second_prompt
    else:
        assert sr1_text in second_prompt  # single-message mode: appended raw, right after the action
    assert out.rollout_metrics["environment/em"] == 1.0
    assert out.rollout_metrics["environment/search_calls"] == 1.0
    assert sum(r[-1] for r in out.rewards if r) == 1.0


def test_intermediate_retrieval_reward_is_paid_once_per_episode():
    class Episode:
        rewarded_retrieval = False

    episode, metrics = Episode(), {}
    docs = 'Doc 1(Title: "Asia") Asia is the largest continent.'
    assert intermediate_retrieval_reward("Doc 1(Title: Europe) ...", ["Asia"], 0.5, episode, metrics) == 0.0
    assert metrics == {"answer_retrieved": 0.0, "intermediate_reward": 0.0}
    assert intermediate_retrieval_reward(docs, ["asia"], 0.5, episode, metrics) == 0.5
    assert metrics == {"answer_retrieved": 1.0, "intermediate_reward": 0.5}
    assert intermediate_retrieval_reward(docs, ["asia"], 0.5, episode, metrics) == 0.0  # no farming by repeating
    assert metrics["answer_retrieved"] == 1.0 and metrics["intermediate_reward"] == 0.0
    off = Episode()
    assert intermediate_retrieval_reward(docs, ["asia"], 0.0, off, metrics) == 0.0 and not off.rewarded_retrieval
    with pytest.raises(ValueError, match="SearchEnvConfig.intermediate_reward must be >= 0"):
        SearchEnvConfig(intermediate_reward=-1.0)


@pytest.mark.integration
async def test_search_step_earns_the_intermediate_reward_on_its_own_step(server):
    for bonus in (0.0, 0.25):
        env = SearchEnv(fast_cfg(server.url, intermediate_reward=bonus))
        await env.reset(PROMPT, {**EXTRAS, "max_turns": 4})
        first = await env.step("<search> largest continent by land area </search>")
        again = await env.step("<search> largest continent by land area </search>")
        final = await env.step("<answer> Asia </answer>")
        assert first.reward == bonus and again.reward == 0.0 and final.reward == 1.0
        assert first.metrics["answer_retrieved"] == again.metrics["answer_retrieved"] == 1.0
        assert first.metrics["intermediate_reward"] == bonus


async def test_a_dead_retriever_fails_only_the_trajectories_that_searched(tokenizer):
    """Nothing listens on the retriever's port: the sample that searches is retried (1 + max_retries tries) then
    fails, dropped and counted as an env failure; its sibling that answered directly is trained as usual. No
    'Search failed' observation reaches a trained sample."""
    import socket

    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
    from skyrl_stepwise.inference.scripted import ScriptedEngine

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def script(prompt, session, i):
        action = "<search> x </search>" if session.endswith("_0") else "<answer> Asia </answer>"
        return tokenizer.encode(action, add_special_tokens=False) + [tokenizer.eos_token_id]

    registry = EnvRegistry()
    register_search_env(registry, SearchEnvConfig(search_url=f"http://127.0.0.1:{port}/retrieve", max_retries=2,
                                                  backoff_s=0.01))
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096, n_samples_per_prompt=2, show_progress=False,
                          sampling=GeneratorSamplingConfig(max_generate_length=16, stop=["</search>", "</answer>"]))
    out = await StepwiseGenerator(tokenizer, ScriptedEngine(script, tokenizer), registry, cfg).generate(
        [PROMPT] * 2, ["search"] * 2, [EXTRAS] * 2, [TrajectoryID("q0", 0), TrajectoryID("q0", 1)])
    assert out.failed_trajectory_ids == [TrajectoryID("q0", 0)]
    assert set(out.trajectory_ids) == {TrajectoryID("q0", 1)}
    assert out.rollout_metrics["generate/failed_trajectories/env_step"] == 1
    assert not any("Search failed" in tokenizer.decode(p) for p in out.prompt_token_ids)


async def test_the_retrieval_bonus_needs_the_answer_in_the_passages_as_whole_words():
    """A plain substring of the formatted observation paid the bonus for retrieving nothing relevant: gold "2" was
    in "Doc 2", "US" in "business", "Ana" in "banana". The answer must be whole words of the passages themselves."""
    from skyrl_stepwise.envs.rewards import words_contain

    class Banana:
        async def search(self, queries, topk):
            return [[{"contents": '"Banana"\nA banana business grows bananas.'},
                     {"contents": '"Plantain"\nPlantains are cooked.'}] for _ in queries]

    for gold, paid in (("2", 0.0), ("US", 0.0), ("Ana", 0.0), ("banana", 0.2), ("plantains are", 0.2)):
        env = SearchEnv(SearchEnvConfig(intermediate_reward=0.2, topk=2), Banana())
        await env.reset(PROMPT, {"reward_spec": {"ground_truth": {"target": [gold]}}, "max_turns": 3})
        result = await env.step("<search>banana</search>")
        assert result.reward == paid and result.metrics["answer_retrieved"] == float(paid > 0), gold
    assert words_contain("The U.S. economy", ["us"]) and not words_contain("a", ["The"])  # "The" normalises to ""


def test_a_golden_answer_that_normalizes_to_nothing_is_matched_by_nothing():
    """Search-R1's normalisation drops articles and punctuation: a golden "The The" became "", which an empty answer,
    "a" or "..." equalled (EM 1.0), and which is inside every prediction (subEM 1.0)."""
    from skyrl_stepwise.envs.rewards import em_check, subem_check

    for prediction in ("", "a", "...", "the"):
        assert not em_check(prediction, ["The The"]) and not subem_check(prediction, ["..."])
    assert em_check("The Who", ["Who", "The The"]) and subem_check("it was the who", ["The The", "who"])
