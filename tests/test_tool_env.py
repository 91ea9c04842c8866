"""The tool environment end to end with a scripted engine: calls parsed from the sampled ids, executed
concurrently, every malformed kind answered, results as `tool` messages, the calling turn trained as sampled."""

from __future__ import annotations

from test_generator import canonical

from skyrl_stepwise.envs.base import EnvRegistry
from skyrl_stepwise.envs.tool import ToolEnvConfig, register_tool_env
from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator, TrajectoryID
from skyrl_stepwise.inference.scripted import ScriptedEngine

CALLS = ('Let me check. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>\n'
         '<tool_call>{"name": "weather", "arguments": {}}</tool_call>\n'
         '<tool_call>{"name": "calculator", "arguments": {"expression": 42}}</tool_call>\n'
         '<tool_call>{nope}</tool_call>')
PROMPT = [{"role": "system", "content": "Row system prompt."},
          {"role": "user", "content": "Use <search> tags to find: what is six times seven?"}]


async def test_tool_calls_are_parsed_executed_answered_and_trained_exactly(tokenizer):
    eos = tokenizer.eos_token_id
    turns = [canonical(tokenizer, CALLS) + [eos], canonical(tokenizer, "<answer> 42 </answer>") + [eos]]
    engine = ScriptedEngine(lambda p, s, i: turns[i], tokenizer)
    registry = EnvRegistry()
    register_tool_env(registry, ToolEnvConfig(question_only=True, system_prompt="You have tools."))
    cfg = GeneratorConfig(max_turns=4, max_input_length=4096, show_progress=False, merge_stepwise_output=True,
                          sampling=GeneratorSamplingConfig(max_generate_length=256))
    gen = StepwiseGenerator(tokenizer, engine, registry, cfg)
    extras = {"reward_spec": {"ground_truth": {"target": ["42"]}},
              "extra_info": {"question": "What is six times seven?"}}
    out = await gen.generate([PROMPT], ["tool"], [extras], [TrajectoryID("q", 0)])
    m = out.rollout_metrics

    assert len(out) == 1 and m["generate/bridge_fallbacks"] == 0 and m["generate/failed_trajectories"] == 0
    assert out.trajectory_rewards() == [1.0]
    trained = [t for t, k in zip(out.response_ids[0], out.loss_masks[0]) if k]
    assert trained == turns[0] + turns[1]  # the calling turn is never re-rendered
    first_prompt = tokenizer.decode(out.prompt_token_ids[0])
    assert "You have tools." in first_prompt and "<search>" not in first_prompt  # the env's prompt, the question
    assert '"name": "calculator"' in first_prompt  # schemas reach the model (SmolLM2's template ignores tools=)
    observation = tokenizer.decode([t for t, k in zip(out.response_ids[0], out.loss_masks[0]) if not k])
    assert "<|im_start|>tool\n42<|im_end|>" in observation  # the good call's result
    assert "unknown_tool" in observation or "weather" in observation
    assert "'expression'" in observation and "invalid" in observation.lower()
    assert "not valid JSON" in observation and '<tool_call>{"name": <tool name>' in observation  # its format
    assert m["environment/tool/calculator/ok"] == 1 and m["environment/tool/unknown_tool"] == 1
    assert m["environment/tool/calculator/invalid_arguments"] == 1 and m["environment/tool/invalid_json"] == 1
    assert m["environment/em"] == 1.0


async def test_mistral_tool_calls_run_through_the_tool_env_with_the_ids_its_template_demands():
    """Mistral's template refuses any call id but 9 alphanumeric characters, on the call and on its answer; the
    malformed calls are answered too (their ids are made up the same way), and the calling turn stays as sampled."""
    from family_tokenizers import FAMILIES, family_tokenizer

    tok = family_tokenizer("mistral-small-3.2")
    calls = ('Let me check.[TOOL_CALLS]calculator[ARGS]{"expression": "6*7"}[TOOL_CALLS]weather[ARGS]{}'
             '[TOOL_CALLS]calculator[ARGS]{"expression": 42}[TOOL_CALLS]calculator[ARGS]{nope}')
    turns = [canonical(tok, calls) + [tok.eos_token_id], canonical(tok, "<answer> 42 </answer>") + [tok.eos_token_id]]
    engine = ScriptedEngine(lambda p, s, i: turns[i], tok)
    registry = EnvRegistry()
    register_tool_env(registry, ToolEnvConfig(question_only=True, system_prompt="You have tools."))
    cfg = GeneratorConfig(max_turns=4, max_input_length=8192, show_progress=False, merge_stepwise_output=True,
                          thinking_retention="all", chat_template_kwargs=dict(FAMILIES["mistral-small-3.2"].render_kwargs),
                          sampling=GeneratorSamplingConfig(max_generate_length=256))
    gen = StepwiseGenerator(tok, engine, registry, cfg)
    extras = {"reward_spec": {"ground_truth": {"target": ["42"]}},
              "extra_info": {"question": "What is six times seven?"}}
    out = await gen.generate([PROMPT], ["tool"], [extras], [TrajectoryID("q", 0)])
    m = out.rollout_metrics

    assert len(out) == 1 and m["generate/bridge_fallbacks"] == 0 and m["generate/failed_trajectories"] == 0, m
    assert out.trajectory_rewards() == [1.0]
    trained = [t for t, k in zip(out.response_ids[0], out.loss_masks[0]) if k]
    assert trained == turns[0] + turns[1]
    observation = tok.decode([t for t, k in zip(out.response_ids[0], out.loss_masks[0]) if not k])
    assert "[TOOL_RESULTS]call00000[TOOL_CONTENT]42[/TOOL_RESULTS]" in observation  # the good call's result
    assert observation.count("[TOOL_RESULTS]call0000") == 4  # every call answered, each by its own id
    # the malformed call is told how a call looks in this model's format, not hermes JSON
    assert "not valid JSON" in observation and "[TOOL_CALLS]<tool name>[ARGS]" in observation
    assert '"arguments"' not in observation
    assert m["environment/tool/calculator/ok"] == 1 and m["environment/tool/unknown_tool"] == 1
    assert m["environment/tool/calculator/invalid_arguments"] == 1 and m["environment/tool/calculator/invalid_json"] == 1


def test_a_malformed_call_is_answered_in_the_form_each_template_accepts():
    """Where a template renders `tool` messages freely (Qwen) the malformed turn keeps its sampled text as content
    (never an empty assistant turn) and the error stays a `tool` message; where it answers only calls it rendered
    (Mistral, gpt-oss, Gemma 4) the malformed call joins the assistant message under the error's id; where it renders
    no `tool` message (Phi-3.5, Gemma 2) the errors become one user turn, counted."""
    from skyrl_stepwise.chat import RoleSupport, ToolCallRequest, conversation_turn
    from skyrl_stepwise.chat.base import ParsedTurn
    from skyrl_stepwise.tools import to_messages
    from skyrl_stepwise.tools.executor import ToolResult, call_ids

    calls = [ToolCallRequest(None, None, "{nope}", "invalid_json"), ToolCallRequest("weather", {}, "{}")]
    turn = ParsedTurn("Let me check.", tool_calls=calls[:1], calls_text="<tool_call>{nope}</tool_call>")
    errors = to_messages([ToolResult(i, "", "Error: not JSON", False, "invalid_json") for i in call_ids(calls[:1])])

    free = conversation_turn(turn, errors, RoleSupport())
    assert free.assistant == {"role": "assistant", "content": "Let me check.<tool_call>{nope}</tool_call>"}
    assert free.observations == errors and free.role_fallbacks == 0

    tied = conversation_turn(turn, errors, RoleSupport(tool_without_call=False))
    assert tied.assistant["tool_calls"] == [{"type": "function", "id": "invalid_call_0",
                                             "function": {"name": "invalid_tool_call", "arguments": {}}}]
    assert tied.observations == errors and tied.observations[0]["tool_call_id"] == "invalid_call_0"

    mixed = ParsedTurn("", tool_calls=[calls[1], calls[0]])
    results = to_messages([ToolResult(i, "", f"Error {i}", False) for i in call_ids(mixed.tool_calls)])
    none = conversation_turn(mixed, results, RoleSupport(system=False, tool_after_call=False, tool_without_call=False))
    assert none.observations == [{"role": "user", "content": "Error call_0\n\nError invalid_call_1"}]
    assert none.role_fallbacks == 2 and [c["id"] for c in none.assistant["tool_calls"]] == ["call_0"]


class _Retriever:
    """A retrieval client stand-in: passages for a query, or the retriever's error quoting the query back."""

    async def search(self, queries, topk):
        from skyrl_stepwise.retrieval.client import RetrievalError

        if queries[0].startswith("broken"):
            raise RetrievalError(f"HTTP 422 from http://r: invalid query {queries[0]!r}")
        return [[{"contents": "Multiplication\nsix times seven is 42"}]]


def _tool_env(bonus: float):
    from skyrl_stepwise.envs.tool import ToolEnv
    from skyrl_stepwise.tools.builtin import CalculatorTool, SearchTool

    return ToolEnv({"search": SearchTool(client=_Retriever()), "calculator": CalculatorTool()},
                   ToolEnvConfig(intermediate_reward=bonus))


async def test_a_tool_result_with_the_golden_answer_earns_the_intermediate_reward_once():
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest

    call = ParsedTurn("", tool_calls=[ToolCallRequest("search", {"query": "six times seven"}, id="c1")])
    extras = {"reward_spec": {"ground_truth": {"target": ["42"]}}, "max_turns": 4}
    for bonus in (0.0, 0.3):
        env = _tool_env(bonus)
        await env.reset([{"role": "user", "content": "six times seven?"}], extras)
        first, again = await env.step_turn(call), await env.step_turn(call)
        assert "42" in first.observations[0]["content"] and not first.done
        assert first.reward == bonus and again.reward == 0.0  # once per episode
        assert first.metrics["answer_retrieved"] == again.metrics["answer_retrieved"] == 1.0
        final = await env.step_turn(ParsedTurn("<answer>42</answer>"))
        assert final.done and final.reward == 1.0


async def test_only_successful_retrieval_results_earn_the_intermediate_reward():
    """Error messages quote the model's own text and a calculator computes what it was given: neither retrieved the
    answer, so neither pays (each was once worth the bonus by writing the answer into a call)."""
    from skyrl_stepwise.chat.base import ParsedTurn, ToolCallRequest

    extras = {"reward_spec": {"ground_truth": {"target": ["42"]}}, "max_turns": 8}
    farmed = {
        "malformed call quoting the answer": ToolCallRequest(None, None, raw='{"name": "search", 42',
                                                             error="invalid_json"),
        "a tool named after the answer": ToolCallRequest("42", {}),
        "a failing calculator call on it": ToolCallRequest("calculator", {"expression": "'42'"}),
        "a calculator computing it": ToolCallRequest("calculator", {"expression": "6*7"}),
        "arguments the schema refuses": ToolCallRequest("search", {"query": 42}),
        "a failed search quoting its query": ToolCallRequest("search", {"query": "broken 42"}),
    }
    for what, request in farmed.items():
        env = _tool_env(0.5)
        await env.reset([{"role": "user", "content": "six times seven?"}], extras)
        step = await env.step_turn(ParsedTurn("", tool_calls=[request]))
        assert "42" in step.observations[0]["content"], what  # the answer is in what the model reads back
        assert step.reward == 0.0 and step.metrics["answer_retrieved"] == 0.0, what
        assert not env.rewarded_retrieval, what
