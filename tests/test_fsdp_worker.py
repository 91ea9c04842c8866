"""Trainer config, merged-vs-step-wise loss/gradient equality on SmolLM2, FSDP2 on 2 gloo ranks, and the
worker's snapshots, weight checksums and skipped steps (on a tiny random Llama, one rank)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from test_advantages import Traj, stepwise_output

from skyrl_stepwise.generator.merge import merge_stepwise_output
from skyrl_stepwise.generator.output import GeneratorOutput, TrajectoryID
from skyrl_stepwise.algorithms.advantages import loss_weights
from skyrl_stepwise.algorithms.credit import compute_advantages
from skyrl_stepwise.policy.batching import TrainBatch, pack_indices, pack_micro_batch
from skyrl_stepwise.policy.config import AlgorithmConfig, TrainerConfig
from skyrl_stepwise.policy.fsdp_worker import micro_batch_loss


# ----------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("key, value, message", [
    ("algorithm.advantage_estimator", "gae",
     "trainer.algorithm.advantage_estimator: 'gae' cannot be broadcast step-wise; use grpo or rloo"),
    ("algorithm.loss_reduction", "seq_mean_token_sum", "trainer.algorithm.loss_reduction"),
    ("algorithm.step_advantage", "gae", "trainer.algorithm.step_advantage: 'gae' is not one of"),
    ("algorithm.gamma", 1.1, "trainer.algorithm.gamma"),
    ("algorithm.kl_loss_type", "kl3", "trainer.algorithm.kl_loss_type"),
    ("algorithm.dual_clip_c", 0.5, "trainer.algorithm.dual_clip_c"),
    ("optim.scheduler", "cosine", "trainer.optim.num_training_steps"),
    ("optim.betas", [0.9], "trainer.optim.betas"),
    ("fsdp.backend", "mpi", "trainer.fsdp.backend"),
    ("micro_batch_tokens", 0, "trainer.micro_batch_tokens"),
    ("max_ckpts_to_keep", 0, "trainer.max_ckpts_to_keep"),
    ("fsdp.num_threads_per_rank", 0, "trainer.fsdp.num_threads_per_rank"),
    ("fsdp.collective_timeout_s", 0, "trainer.fsdp.collective_timeout_s"),
])
def test_config_errors_name_the_key_path(key, value, message):
    cfg = TrainerConfig()
    *parents, leaf = key.split(".")
    target = cfg
    for p in parents:
        target = getattr(target, p)
    setattr(target, leaf, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        cfg.validate()


def test_ranks_share_the_node_cores_unless_told():
    from skyrl_stepwise.policy.config import FSDPConfig

    assert FSDPConfig(world_size=2).threads_per_rank(cores=16) == 8
    assert FSDPConfig(world_size=4).threads_per_rank(cores=2) == 1
    assert FSDPConfig(world_size=2, num_threads_per_rank=3).threads_per_rank(cores=16) == 3


def _stalled_peer_rank(rank: int, port: int, out: str) -> None:
    """Rank 0 waits in an all_reduce that rank 1 (stopped, not dead) never joins."""
    from skyrl_stepwise.policy.config import FSDPConfig
    from skyrl_stepwise.policy.fsdp_worker import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    init_distributed(FSDPConfig(world_size=2, backend="gloo", collective_timeout_s=2))
    if rank == 1:
        time.sleep(4)
        os._exit(0)  # no process-group teardown: its peer left mid-collective
    start = time.time()
    try:
        torch.distributed.all_reduce(torch.ones(1))
        result = {"raised": None}
    except Exception as e:  # noqa: BLE001 - what the timeout raises is the point
        result = {"raised": type(e).__name__}
    result["waited"] = time.time() - start
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # gloo aborts when a group with a timed-out pair is torn down at exit


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_collective_a_stalled_rank_never_joins_raises_after_the_configured_timeout(tmp_path):
    """trainer.fsdp.collective_timeout_s bounds how long a live rank waits on one that is stopped but not dead,
    instead of torch's 30 minutes (gloo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_stalled_peer_rank, args=(port, str(tmp_path / "r.json")), nprocs=2, join=True)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["raised"] is not None and 1.5 < result["waited"] < 3.9, result


def test_config_is_a_hydra_structured_config():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(TrainerConfig)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(["algorithm.tis_ratio_clip_high=null",
                                                           "optim.lr=2e-6", "fsdp.world_size=2"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, TrainerConfig) and cfg.optim.lr == 2e-6 and cfg.fsdp.world_size == 2
    assert not cfg.algorithm.use_tis
    cfg.validate()
    with pytest.raises(Exception, match="advantage_estimatr"):  # typos fail at merge time
        OmegaConf.merge(base, OmegaConf.from_dotlist(["algorithm.advantage_estimatr=rloo"]))


# ------------------------------------------------------- acceptance: merged == step-wise, loss and grads

def _chat_trajs(tokenizer) -> list[Traj]:
    """Search-style 1-3 turn chains with the real tokenizer and chat template; per-step rewards."""
    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def prompt(q):
        return enc(tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": q}],
                                                 add_generation_prompt=True, tokenize=False))

    def obs(info):
        return enc(f"\n<|im_start|>user\n<info>{info}</info><|im_end|>\n<|im_start|>assistant\n")

    p = prompt("2+3?")
    return [
        Traj(TrajectoryID("q1", 0), p, [enc("<search>2+3</search><|im_end|>"), enc("<search>sum</search><|im_end|>"),
                                        enc("<answer>5</answer><|im_end|>")], [obs("5"), obs("adds")],
             [0.0, 0.3, 1.0]),  # a per-step reward at turn 1 (e.g. the gold answer was retrieved)
        Traj(TrajectoryID("q1", 1), p, [enc("<search>two</search><|im_end|>"), enc("<answer>6</answer>")],
             [obs("2")], [0.0, 0.0]),
        Traj(TrajectoryID("q1", 2), p, [enc("<answer>4</answer><|im_end|>")], [], [0.2]),
    ]


def _by_chain_position(src, src_values, dst) -> list[list[float]]:
    """Carry per-token values to another cut of the same chains: a token is (trajectory, position in chain)."""
    table = {(tid, len(p) + j): v for tid, p, vals in zip(src.trajectory_ids, src.prompt_token_ids, src_values)
             for j, v in enumerate(vals)}
    return [[table.get((tid, len(p) + j), 0.0) for j in range(len(r))]
            for tid, p, r in zip(dst.trajectory_ids, dst.prompt_token_ids, dst.response_ids)]


def _loss_and_grads(model, batch: TrainBatch, cfg: AlgorithmConfig, budget: int):
    model.zero_grad(set_to_none=True)
    n = batch.loss_denominator()
    total, metrics = 0.0, {}
    micro = pack_indices(batch.seq_lens(), budget)
    for idx in micro:
        loss, m = micro_batch_loss(model, pack_micro_batch(batch, idx), cfg, n)
        loss.backward()
        total += loss.item()
        metrics = {k: metrics.get(k, 0.0) + v for k, v in m.items()}
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}, metrics, len(micro)


@pytest.mark.integration
@pytest.mark.parametrize("reduction, step_advantage", [
    *[(r, m) for r in ("token_mean", "trajectory_mean") for m in ("outcome", "discounted", "gigpo")],
    ("sequence_mean", "outcome"),  # the per-sample mean of SkyRL/verl: shown NOT to be merge-invariant
])
def test_merged_and_stepwise_give_the_same_loss_and_gradients(tiny_smollm2, tokenizer, reduction, step_advantage):
    """Merge-invariance of the loss and gradients is arithmetic on the rows, whatever the weights: SmolLM2's tiny
    twin (same tokenizer and template, so the same chat rows) keeps every check, without 8 loads of 135M."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_smollm2, dtype=torch.float32)
    trajs = _chat_trajs(tokenizer)
    stepwise = stepwise_output(trajs)
    with torch.no_grad():  # realistic logprobs: the model's own, perturbed per token into rollout/old/ref
        whole = merge_stepwise_output(stepwise)
        base = [torch.tensor(x) for x in _by_chain_position(whole, _logprobs(model, TrainBatch.from_output(whole)),
                                                            stepwise)]
    g = torch.Generator().manual_seed(0)

    def noisy(scale: float) -> list[list[float]]:
        return [(b + scale * (torch.rand(b.shape, generator=g) * 2 - 1)).tolist() for b in base]

    for t, lp in zip(trajs, _per_traj(stepwise, noisy(1.0))):
        t.logprobs = lp  # rollout logprobs: |old - rollout| up to 1 so some TIS weights hit the 2.0 clip
    stepwise = stepwise_output(trajs)
    old, ref = noisy(0.3), noisy(0.3)
    merged = merge_stepwise_output(stepwise)
    assert len(merged) == 3 < len(stepwise) == 6

    cfg = AlgorithmConfig(advantage_estimator="grpo", tis_ratio_clip_high=2.0, use_kl_loss=True, kl_loss_coef=0.1,
                          loss_reduction=reduction, step_advantage=step_advantage, gamma=0.8)
    results, advantages = [], []
    for out, budget in ((stepwise, 120), (merged, 100_000)):
        o = old if out is stepwise else _by_chain_position(stepwise, old, out)
        r = ref if out is stepwise else _by_chain_position(stepwise, ref, out)
        advantages.append(compute_advantages(out, cfg))
        batch = TrainBatch.from_output(out, advantages[-1], o, r, loss_weights=loss_weights(out, cfg))
        if reduction == "trajectory_mean":  # each of the 3 trajectories weighs 1 in either cut
            assert batch.loss_denominator() == pytest.approx(3)
        results.append(_loss_and_grads(model, batch, cfg, budget))
    # the same per-token advantages in either cut, and (per-step modes) not just the outcome broadcast
    def flat(rows):
        return [x for row in rows for x in row]

    assert flat(_by_chain_position(stepwise, advantages[0], merged)) == pytest.approx(flat(advantages[1]))
    if step_advantage != "outcome":
        outcome = compute_advantages(stepwise, replace(cfg, step_advantage="outcome"))
        assert flat(advantages[0]) != pytest.approx(flat(outcome))
    (loss_s, grads_s, m_s, n_s), (loss_m, grads_m, m_m, n_m) = results
    assert n_s > 1 and n_m == 1  # step-wise spread over several micro-batches, merged in one row
    assert m_s["policy/clip_frac"] > 0 and m_s["policy/tis_clip_frac"] > 0 and abs(loss_s) > 1e-3
    if reduction == "sequence_mean":  # 6 step samples vs 3 merged ones: each sample weighs 1, so the loss moves
        assert abs(loss_m - loss_s) > 0.05 * abs(loss_s)
        assert max((grads_m[k] - grads_s[k]).abs().max().item() for k in grads_s) > 1e-4
        return
    assert loss_m == pytest.approx(loss_s, rel=1e-4, abs=1e-6)  # fp32 noise only
    for k in ("policy/pg_loss", "policy/kl_loss", "policy/clip_frac", "policy/tis_weight", "policy/entropy"):
        assert m_m[k] == pytest.approx(m_s[k], rel=1e-4, abs=1e-7), k
    assert grads_s.keys() == grads_m.keys()
    for k in grads_s:
        # per-step advantages make a token's summed gradient cancel more (one embedding row gets terms of both signs),
        # so the fp32 summation-order noise is judged against the tensor's own scale there; outcome keeps 1e-6
        atol = 1e-6 if step_advantage == "outcome" else 1e-4 * grads_s[k].abs().max().item()
        torch.testing.assert_close(grads_m[k], grads_s[k], rtol=1e-3, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    assert sum(g.abs().sum() for g in grads_s.values()) > 0


def _logprobs(model, batch: TrainBatch) -> list[list[float]]:
    from skyrl_stepwise.policy.batching import forward_logprobs

    out: list[list[float]] = [[] for _ in range(len(batch))]
    for idx in pack_indices(batch.seq_lens(), 4096):
        mb = pack_micro_batch(batch, idx)
        for i, lp in zip(idx, mb.split(forward_logprobs(model, mb)[0])):
            out[i] = lp
    return out


def _per_traj(output, values) -> list[list[list[float]]]:
    grouped: dict = {}
    for tid, v in zip(output.trajectory_ids, values):
        grouped.setdefault(tid, []).append(v)
    return list(grouped.values())


# ------------------------------------------------------------------------------------ FSDP2, 2 gloo ranks

def _fsdp_cfg(world: int, model_path, ckpt_dir) -> TrainerConfig:
    cfg = TrainerConfig(model_path=str(model_path), micro_batch_tokens=40, ckpt_dir=str(ckpt_dir))
    cfg.fsdp.world_size = world
    cfg.fsdp.mixed_precision = False  # fp32: the step is compared with a single-process reference
    cfg.algorithm.tis_ratio_clip_high = None
    cfg.algorithm.kl_loss_coef = 0.1
    cfg.optim.lr = 1e-5
    cfg.optim.scheduler, cfg.optim.num_training_steps = "linear", 10
    return cfg


def _fsdp_batch(vocab: int) -> TrainBatch:
    """Lengths 60, 20, 20, 20 with a 40-token budget: rank 0 gets 1 micro-batch, rank 1 gets 2."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    sizes = [(40, 20), (12, 8), (12, 8), (12, 8)]
    adv = [1.0, -1.0, 0.5, -0.5]
    return TrainBatch(prompt_ids=[ids(p) for p, _ in sizes], response_ids=[ids(r) for _, r in sizes],
                      loss_masks=[[1] * r for _, r in sizes], instance_ids=["a", "a", "b", "b"],
                      advantages=[[a] * r for a, (_, r) in zip(adv, sizes)])


def _optimizer_shards(worker) -> list[torch.Tensor]:
    """This rank's shards of every AdamW state tensor, in parameter order."""
    out = []
    for p in worker.model.parameters():
        for v in worker.optimizer.state[p].values():
            out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def _rank_main(rank: int, world: int, port: int, model_path: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = _fsdp_cfg(world, model_path, os.path.join(tmp, "ckpt"))
    worker = PolicyWorker(cfg)
    batch = _fsdp_batch(worker.model.config.vocab_size)
    initial = worker.weights_checksum()
    worker.snapshot()
    before = worker.compute_logprobs(batch)
    batch.ref_logprobs = before
    metrics = worker.train_step(batch)
    after = worker.compute_logprobs(batch)
    full = worker.full_state_dict()
    changed = total = 0
    if rank == 0:
        original = load_file(os.path.join(model_path, "model.safetensors"))
        for k, v in original.items():
            total += 1
            changed += int(not torch.equal(full[k], v.float()))
    path = worker.save_checkpoint(1, {"consumed_prompts": 2})

    fresh = PolicyWorker(cfg)  # a restarted job: original weights, empty optimizer, new scheduler
    state = fresh.load_checkpoint(path)
    restored = fresh.compute_logprobs(batch)
    saved_opt, loaded_opt = _optimizer_shards(worker), _optimizer_shards(fresh)
    optimizer_equal = len(saved_opt) == len(loaded_opt) > 0 and all(
        torch.equal(a, b) for a, b in zip(saved_opt, loaded_opt))
    lrs = [worker.scheduler.get_last_lr()[0], fresh.scheduler.get_last_lr()[0]]
    trained = worker.weights_checksum()
    worker.restore_snapshot()  # back to the start: sharded weights, empty optimizer, schedule at step 0
    rewound = worker.compute_logprobs(batch)
    with open(os.path.join(tmp, f"checksums_rank{rank}.json"), "w") as f:
        json.dump({"initial": initial, "trained": trained, "rewound": worker.weights_checksum(),
                   "rewound_optimizer_empty": not worker.optimizer.state,
                   "rewound_lr": worker.scheduler.get_last_lr()[0]}, f)
    if rank == 0:
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump({"before": before, "after": after, "restored": restored, "metrics": metrics, "state": state,
                       "changed": changed, "total": total, "optimizer_equal": optimizer_equal, "lrs": lrs,
                       "rewound": rewound}, f)
    elif not optimizer_equal:
        raise AssertionError(f"rank {rank}: AdamW state shards differ after load_checkpoint")
    worker.shutdown()


def _accumulation_rank_main(rank: int, world: int, port: int, model_path: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    out = {}
    for accumulate in (False, True):
        cfg = _fsdp_cfg(world, model_path, os.path.join(tmp, "ckpt"))
        cfg.fsdp.accumulate_unsharded, cfg.algorithm.use_kl_loss, cfg.optim.lr = accumulate, False, 1e-2
        worker = PolicyWorker(cfg)
        metrics = worker.train_step(_fsdp_batch(worker.model.config.vocab_size))
        full = worker.full_state_dict()
        out[str(accumulate)] = {"metrics": metrics, "weights": {k: v.flatten()[:64].tolist() for k, v in full.items()}}
    # the same step, asked for the logprobs its forward computed for samples 0 (rank 0's) and 3 (rank 1's)
    batch = _fsdp_batch(worker.model.config.vocab_size)
    scorer = PolicyWorker(cfg)
    before = scorer.compute_logprobs(batch)
    metrics, scores = scorer.train_step_scored(batch, [0, 3])
    out["scored"] = {"metrics": metrics, "scores": {str(k): v for k, v in scores.items()}, "before": before,
                     "weights": {k: v.flatten()[:64].tolist() for k, v in scorer.full_state_dict().items()}}
    if rank == 0:
        with open(os.path.join(tmp, "accumulation.json"), "w") as f:
            json.dump(out, f)
    worker.shutdown()


@pytest.mark.integration
def test_accumulating_unsharded_on_two_ranks_with_uneven_micro_batches_gives_the_same_step(tiny_smollm2, tmp_path):
    """Rank 0 has one micro-batch and an empty filler, rank 1 two: with accumulate_unsharded each rank gathers once
    and reduces at its last micro-batch, so the collectives still pair up, and the step is the per-micro-batch one
    (sums over ranks and micro-batches in another order: equal to fp32 rounding)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_accumulation_rank_main, args=(2, port, str(tiny_smollm2), str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "accumulation.json").read_text())
    plain, held = r["False"], r["True"]
    assert plain["metrics"]["train/num_micro_batches"] == held["metrics"]["train/num_micro_batches"] == 4
    assert held["metrics"]["policy/loss"] == pytest.approx(plain["metrics"]["policy/loss"], rel=1e-6)
    assert held["metrics"]["train/grad_norm"] == pytest.approx(plain["metrics"]["train/grad_norm"], rel=1e-5)
    assert held["weights"].keys() == plain["weights"].keys()
    for name, values in plain["weights"].items():
        assert held["weights"][name] == pytest.approx(values, abs=1e-6), name
    # train_step_scored is that step, and returns what a scoring pass before it gives, gathered from both ranks
    scored = r["scored"]
    assert {k: v for k, v in scored["metrics"].items() if k != "train/step_time_s"} == \
        {k: v for k, v in held["metrics"].items() if k != "train/step_time_s"}
    assert scored["weights"] == held["weights"]
    assert sorted(scored["scores"]) == ["0", "3"]
    for row in ("0", "3"):
        assert scored["scores"][row] == pytest.approx(scored["before"][int(row)], abs=1e-5), row


@pytest.mark.integration
def test_fsdp2_two_gloo_ranks_train_step_and_checkpoint(tiny_smollm2, tmp_path):
    """Sharding, the 2-rank step against a 1-process reference, checkpoint and snapshot mechanics: on SmolLM2's tiny
    twin (the real model's weights add nothing to any check but minutes)."""
    from transformers import AutoModelForCausalLM

    model_path = tiny_smollm2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, str(model_path), str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "result.json").read_text())

    m1 = r["metrics"]
    assert m1["train/num_micro_batches"] == 4  # 2 per rank, one of rank 0's is the empty filler
    assert all(math.isfinite(v) for v in m1.values())
    assert r["changed"] / r["total"] > 0.9  # one AdamW step moves (nearly) every tensor
    assert r["after"] != r["before"]
    # the single-process fp32 reference: same loss and gradient norm as the 2-rank sharded step
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = _fsdp_batch(model.config.vocab_size)
    batch.ref_logprobs = r["before"]
    cfg = _fsdp_cfg(1, model_path, tmp_path)
    loss, grads, _, _ = _loss_and_grads(model, batch, cfg.algorithm, 100_000)
    grad_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    assert m1["policy/loss"] == pytest.approx(loss, rel=1e-4)
    assert m1["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-3)
    # resume in a fresh worker: exact weights, AdamW moments and LR schedule
    assert r["state"]["step"] == 1 and r["state"]["consumed_prompts"] == 2
    # every rank's files carry a content hash in the manifest (rank 1 hashed its own shard), and they verify
    from skyrl_stepwise.checkpoint.store import read_manifest, step_dir
    from skyrl_stepwise.checkpoint.verify import verify_checkpoint

    files, hashed = read_manifest(step_dir(tmp_path / "ckpt", 1))
    assert hashed and {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng_rank1.pt"} <= set(files)
    assert all(digest and len(digest) == 64 for _, digest in files.values())
    assert verify_checkpoint(step_dir(tmp_path / "ckpt", 1))["step"] == 1
    assert r["restored"] == r["after"]
    assert r["optimizer_equal"]
    assert r["lrs"][0] == r["lrs"][1] == pytest.approx(0.9 * cfg.optim.lr)
    # snapshot/restore on sharded weights: both ranks agree on the full-weight checksums, which match the plain
    # model's, and the restore is exact (same logprobs as before the step, fresh optimizer and schedule)
    from skyrl_stepwise.policy.fsdp_worker import weights_checksum

    sums = [json.loads((tmp_path / f"checksums_rank{k}.json").read_text()) for k in range(2)]
    assert sums[0] == sums[1]
    assert sums[0]["initial"] == sums[0]["rewound"] == weights_checksum(model.named_parameters()) != sums[0]["trained"]
    assert sums[0]["rewound_optimizer_empty"] and sums[0]["rewound_lr"] == cfg.optim.lr
    assert r["rewound"] == r["before"]


# ------------------------------------------------------------ snapshots and skipped steps, tiny model, 1 rank

def _tiny_worker(path, **optim):
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    cfg = _fsdp_cfg(1, path, path / "ckpt")
    cfg.optim.lr = 1e-2  # big enough that one step visibly moves a random tiny model
    cfg.algorithm.use_kl_loss = False
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return PolicyWorker(cfg)


def _optimizer_state(worker) -> dict:
    return {i: {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in s.items()}
            for i, s in enumerate(worker.optimizer.state[p] for p in worker.model.parameters())}


def test_weights_checksum_of_a_sharded_worker_equals_the_plain_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from skyrl_stepwise.policy.fsdp_worker import weights_checksum

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    worker = _tiny_worker(tiny_model_dir)
    digest = worker.weights_checksum()
    assert len(digest) == 16 and digest == weights_checksum(plain.named_parameters())
    worker.train_step(_fsdp_batch(128))
    assert worker.weights_checksum() != digest


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_restore_snapshot_taken_before_any_step_gives_a_fresh_worker(tiny_model_dir):
    worker = _tiny_worker(tiny_model_dir)
    batch = _fsdp_batch(128)
    initial = worker.weights_checksum()
    worker.snapshot()
    first = worker.train_step(batch)
    assert worker.optimizer.state and worker.scheduler.last_epoch == 1
    worker.restore_snapshot()
    # Optimizer.load_state_dict replaced the state: no AdamW moments left, the schedule is back at step 0
    assert not worker.optimizer.state and worker.scheduler.last_epoch == 0
    assert worker.scheduler.get_last_lr() == [worker.cfg.optim.lr]
    assert worker.weights_checksum() == initial
    again = worker.train_step(batch)  # the same update from the same start: same loss, gradient, weights
    after = worker.weights_checksum()
    assert after != initial
    for key in ("policy/loss", "train/grad_norm", "train/lr"):
        assert again[key] == first[key], key
    worker.restore_snapshot()  # the snapshot survived the restore and the step after it
    assert worker.weights_checksum() == initial and not worker.optimizer.state
    worker.train_step(batch)
    assert worker.weights_checksum() == after


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_restore_snapshot_brings_back_optimizer_scheduler_and_rng(tiny_model_dir):
    worker = _tiny_worker(tiny_model_dir, scheduler="linear", num_training_steps=10)
    batch = _fsdp_batch(128)
    worker.train_step(batch)
    worker.snapshot()
    weights, moments, lr = worker.weights_checksum(), _optimizer_state(worker), worker.scheduler.get_last_lr()
    draws = torch.rand(3)
    worker.train_step(batch)
    worker.train_step(batch)
    assert worker.weights_checksum() != weights and worker.scheduler.get_last_lr() != lr
    worker.restore_snapshot()
    assert worker.weights_checksum() == weights and worker.scheduler.get_last_lr() == lr
    restored = _optimizer_state(worker)
    assert restored.keys() == moments.keys() and all(
        restored[i].keys() == moments[i].keys() and all(torch.equal(restored[i][k], moments[i][k]) for k in moments[i])
        for i in moments)
    assert torch.equal(torch.rand(3), draws)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_reference_in_the_policy_ranks_keeps_the_starting_weights(tiny_model_dir):
    """The KL loss's reference is a frozen shard inside each policy rank (no second group of actors): it scores
    like the policy before any step, keeps scoring like the starting weights after, and takes no RNG draws."""
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker
    from skyrl_stepwise.policy.worker_group import ReferenceOnPolicyRanks

    cfg = _tiny_worker(tiny_model_dir).cfg  # a worker seeds torch with cfg.seed when it starts
    plain_draws = torch.rand(3)
    worker = PolicyWorker(cfg, with_reference=True)
    assert torch.equal(torch.rand(3), plain_draws)
    assert not any(p.requires_grad for p in worker.reference.parameters())
    batch = _fsdp_batch(128)
    start = worker.compute_logprobs(batch)
    assert worker.compute_ref_logprobs(batch) == start
    worker.train_step(batch)
    assert worker.compute_logprobs(batch) != start
    assert worker.compute_ref_logprobs(batch) == start

    class Group:  # PolicyGroup's interface over the one in-process rank
        def call(self, method, *args):
            return getattr(worker, method)(*args)

    assert ReferenceOnPolicyRanks(Group()).call("compute_logprobs", batch) == start
    with pytest.raises(AttributeError, match="only scores"):
        ReferenceOnPolicyRanks(Group()).call("train_step", batch)
    with pytest.raises(RuntimeError, match="with_reference=True"):
        _tiny_worker(tiny_model_dir).compute_ref_logprobs(batch)


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_restore_snapshot_without_snapshot_says_so(tiny_model_dir):
    with pytest.raises(RuntimeError, match="call snapshot"):
        _tiny_worker(tiny_model_dir).restore_snapshot()


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_skipped_step_does_not_advance_the_lr_schedule(tiny_model_dir):
    worker = _tiny_worker(tiny_model_dir, scheduler="constant_with_warmup", num_warmup_steps=4)
    good = _fsdp_batch(128)
    bad = _fsdp_batch(128)
    bad.advantages = [[float("nan")] * len(a) for a in bad.advantages]  # nan loss -> nan gradient norm
    weights = worker.weights_checksum()
    m = worker.train_step(bad)
    assert m["train/skipped_step"] == 1.0 and not math.isfinite(m["train/grad_norm"])
    assert worker.scheduler.last_epoch == 0 and worker.scheduler.get_last_lr() == [0.0]  # still warming up from 0
    assert worker.weights_checksum() == weights
    lrs = [worker.train_step(b)["train/lr"] for b in (good, bad, good)]
    # the skipped middle step reports the LR it would have used, and the next good step uses that same LR
    assert lrs == pytest.approx([0.0, 0.25 * worker.cfg.optim.lr, 0.25 * worker.cfg.optim.lr])
    assert worker.scheduler.last_epoch == 2


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_gradient_checkpointing_is_honoured_on_cpu_and_changes_no_number(tiny_model_dir):
    """trainer.fsdp.gradient_checkpointing trades compute for activation memory (benchmarks/policy_memory.py:
    SmolLM2 rank peak 4.4 -> 3.4 GiB): every decoder layer runs again in backward, the step is the same."""
    from skyrl_stepwise.policy.fsdp_worker import PolicyWorker

    results = []
    for checkpointing in (False, True):
        cfg = _fsdp_cfg(1, tiny_model_dir, tiny_model_dir / "ckpt")
        cfg.algorithm.use_kl_loss, cfg.fsdp.gradient_checkpointing = False, checkpointing
        worker = PolicyWorker(cfg)
        calls = []
        # a pre-hook: the recompute stops as soon as the last saved tensor is back (early stop), before post-hooks
        worker.model.model.layers[0].self_attn.register_forward_pre_hook(lambda *args: calls.append(1))
        metrics = worker.train_step(_fsdp_batch(128))
        results.append((len(calls), metrics["policy/loss"], metrics["train/grad_norm"], worker.weights_checksum()))
    (plain_calls, *plain), (ckpt_calls, *ckpt) = results
    assert ckpt_calls == 2 * plain_calls > 0
    assert ckpt[:2] == pytest.approx(plain[:2], rel=1e-5) and ckpt[2] == plain[2]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed-precision"])
def test_accumulating_unsharded_gathers_once_a_step_and_changes_no_bit(tiny_model_dir, monkeypatch, bf16):
    """trainer.fsdp.accumulate_unsharded keeps the layers gathered and the gradients whole through a step's micro-
    batches: one gather and one reduction per step, and the same weights to the bit after two steps, in fp32 and in
    bf16 mixed precision (forced where the CPU lacks native bf16: emulated, the same arithmetic)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from skyrl_stepwise.policy import fsdp_worker

    monkeypatch.setattr(fsdp_worker, "bf16_supported", lambda device: bf16)
    gathers = []
    unshard = FSDPParamGroup.unshard
    monkeypatch.setattr(FSDPParamGroup, "unshard",
                        lambda group, *a, **k: (gathers.append(group.is_sharded), unshard(group, *a, **k))[1])
    results = []
    for accumulate in (False, True):
        cfg = _fsdp_cfg(1, tiny_model_dir, tiny_model_dir / "ckpt")
        cfg.fsdp.mixed_precision, cfg.fsdp.accumulate_unsharded = True, accumulate
        cfg.algorithm.use_kl_loss, cfg.optim.lr = False, 1e-2
        worker = fsdp_worker.PolicyWorker(cfg)
        gathers.clear()
        steps = [worker.train_step(_fsdp_batch(128)) for _ in range(2)]
        results.append((sum(gathers), [m["policy/loss"] for m in steps], [m["train/grad_norm"] for m in steps],
                        worker.weights_checksum()))
        micro_batches = steps[0]["train/num_micro_batches"]
        worker.shutdown()
    (gathered, *plain), (gathered_once, *held) = results
    assert held == plain  # losses, gradient norms and the weights' checksum, exactly
    layer_groups = 3  # 2 decoder layers and the root (embeddings, final norm)
    assert micro_batches >= 2
    assert gathered >= 2 * micro_batches * layer_groups  # every micro-batch's forward, every step (and backward)
    assert gathered_once == 2 * layer_groups  # one gather per group per step


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_worker_divides_by_trajectories_under_trajectory_mean(tiny_model_dir):
    """On-policy (ratio 1) the policy-gradient loss is minus the weighted mean advantage: token_mean weighs
    trajectory A (1 loss token, advantage 1) against B (3 tokens over two samples, advantage -0.5) by tokens,
    trajectory_mean weighs each trajectory once. The worker must divide by the matching denominator."""
    from skyrl_stepwise.algorithms.advantages import loss_weights as weights_for

    output = GeneratorOutput(prompt_token_ids=[[1, 2], [1, 2], [1, 2, 5, 6, 7]], response_ids=[[3], [5, 6], [8, 9]],
                             rewards=[0.0, 0.0, 0.0], loss_masks=[[1], [1, 0], [1, 1]],
                             trajectory_ids=[TrajectoryID("q", 0), TrajectoryID("q", 1), TrajectoryID("q", 1)])
    advantages = [[1.0], [-0.5, -0.5], [-0.5, -0.5]]
    worker = _tiny_worker(tiny_model_dir)
    worker.cfg.algorithm.tis_ratio_clip_high = None
    worker.snapshot()
    for reduction, expected in (("token_mean", -(1 - 1.5) / 4), ("trajectory_mean", -(1 - 0.5) / 2)):
        worker.restore_snapshot()
        worker.cfg.algorithm.loss_reduction = reduction
        batch = TrainBatch.from_output(output, advantages,
                                       loss_weights=weights_for(output, worker.cfg.algorithm))
        metrics = worker.train_step(batch)
        assert metrics["policy/pg_loss"] == pytest.approx(expected, abs=1e-6), reduction
        assert metrics["train/loss_tokens"] == 4
