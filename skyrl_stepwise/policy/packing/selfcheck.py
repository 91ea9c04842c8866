"""The start-up packing self-check: pack probe samples on the run's own model, compare with separate forwards.

The conformance suite (tests/test_packing_conformance.py) proves the packing on every architecture we list; this
check covers the ones nobody listed. Before the first step the worker packs a few probe samples the way the run
will (a shared prompt longer than the model's sliding window, a step-wise chain, a broken chain, another prompt) into
one micro-batch with the run's packing and attention implementation (plus, where the config declares a RoPE
`original_max_position_embeddings` a row of this run could pass, one probe past it), and scores them against each
sample forwarded alone. A model whose forward ignores our masks or position ids, or keeps a state we did not know
about, fails here and the run is refused, naming the architecture, `trainer.packing` and
`trainer.attn_implementation`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_stepwise.policy.packing.layout import AttentionLayout

# Largest |packed - alone| logprob accepted. fp32 differs by summation order only (SmolLM2-135M: 1e-5); bf16 compute
# (FSDP mixed precision) rounds every layer and takes other kernels for masked rows: 0.15 on SmolLM2 loaded in bf16,
# 0.21 under FSDP2 mixed precision in `make run`. What the check must catch is far larger on a trained model: on
# SmolLM2 a row whose samples see each other scores 2.7-5.2 nats away, a window the model does not have 10.6, in
# fp32 and bf16 alike. 1.0 sits ~5x above that noise and ~3x below the smallest leak measured. On a small or fresh
# model a leak can stay under 1.0, so under bf16 the check also runs on an fp32 proxy (packing/proxy.py) at 1e-3.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 1.0
# The longest probe the check adds to cross a declared RoPE switch length (models/rope.py): longer would cost more
# than the check is worth at start-up (a dense eager mask is T x T).
MAX_SWITCH_PROBE = 8192


@dataclass(frozen=True)
class PackingCheck:
    """What the self-check saw: the packing it checked, the worst logprob error, the bar, the probe's size."""

    packing: str
    max_abs_error: float
    tolerance: float
    num_samples: int
    row_tokens: int
    longest_sample: int
    # packing=auto: the tree's failed check, when rows were checked and used instead
    fallback_from: PackingCheck | None = None
    # bf16 compute: the same check on an fp32 copy of the architecture (packing/proxy.py), or why there is none
    proxy: PackingCheck | None = None
    proxy_note: str | None = None

    @property
    def passed(self) -> bool:
        """True when every packed logprob is within the tolerance of its separate forward, on the run's model and,
        under bf16 compute, on its fp32 proxy."""
        return self.max_abs_error <= self.tolerance and (self.proxy is None or self.proxy.passed)

    @property
    def worst(self) -> PackingCheck:
        """The check that failed (the proxy's when only it did), else this one."""
        return self.proxy if self.proxy is not None and not self.proxy.passed else self

    def describe(self) -> str:
        """One log line."""
        proxy = ""
        if self.proxy is not None:
            proxy = (f"; fp32 proxy ({self.proxy_note}): max {self.proxy.max_abs_error:.2e} (tolerance "
                     f"{self.proxy.tolerance:g})")
        elif self.proxy_note:
            proxy = f"; no fp32 proxy ({self.proxy_note}): only the bf16 bar applies"
        return (f"packing self-check ({self.packing}): {self.num_samples} probe samples (longest "
                f"{self.longest_sample} tokens) in one {self.row_tokens}-token row, max |packed - alone| logprob "
                f"{self.max_abs_error:.2e} (tolerance {self.tolerance:g})" + proxy
                + (f"; trainer.packing=auto fell back to rows: the tree failed its check on this model (max "
                   f"{self.fallback_from.worst.max_abs_error:.3g})" if self.fallback_from is not None else ""))


def probe_samples(layout: AttentionLayout, vocab_size: int, seed: int = 0, cross_length: int | None = None):
    """Probe samples that exercise what packing must keep apart: a prompt shared by a group, a step-wise chain that
    re-reads a sample's history, a broken chain (a prefix cut short), and an unrelated prompt; every sample longer
    than the longest sliding window, so a window the mask lost changes some logprob. With `cross_length`, one more
    sample of cross_length + 1 tokens takes the row past a RoPE switch length the short samples stay under."""
    from skyrl_stepwise.policy.batching import TrainBatch

    g = torch.Generator().manual_seed(seed)
    span = min(vocab_size, 32000)

    def ids(n: int) -> list[int]:
        return torch.randint(0, span, (n,), generator=g).tolist()

    n = max(24, (layout.max_window or 0) + 8)
    prompt, other = ids(n), ids(n)
    first = ids(6)
    prompts = [prompt, prompt, prompt + first + ids(4), prompt[: n // 2], other]
    responses = [first, ids(7), ids(5), ids(6), ids(6)]
    if cross_length:
        prompts.append(ids(cross_length + 1 - 6))
        responses.append(ids(6))
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      instance_ids=["probe"] * len(prompts))


@torch.no_grad()
def check_packing(model: torch.nn.Module, layout: AttentionLayout, packing: str, device: torch.device,
                  compute_dtype: torch.dtype = torch.float32, seed: int = 0) -> PackingCheck:
    """Score the probe samples packed in one row (the run's packing) and each alone; return the worst difference.

    With state-carrying layers the run gives every sample a row of its own, which is exact by construction: the
    check then compares one-sample rows with plain forwards (the same computation), which still catches a model
    that fails on the inputs we build.
    """
    from skyrl_stepwise.policy.batching import forward_logprobs, pack_micro_batch
    from skyrl_stepwise.models.rope import declared_switch_length

    config = model.config.get_text_config()
    switch = declared_switch_length(config)  # a row past it may change every row-mate's RoPE: make the probe pass it
    crosses = (switch is not None and switch <= MAX_SWITCH_PROBE and not layout.one_sample_per_row
               and (layout.row_tokens is None or layout.row_tokens > switch))
    batch = probe_samples(layout, config.vocab_size, seed, cross_length=switch if crosses else None)
    everything = list(range(len(batch)))
    was_training = model.training
    model.eval()
    try:
        rows = [[i] for i in everything] if layout.one_sample_per_row else [everything]
        packed = []
        row_tokens = 0
        for idx in rows:
            mb = pack_micro_batch(batch, idx, packing).to(device)
            row_tokens = max(row_tokens, mb.num_tokens)
            packed.append(forward_logprobs(model, mb, layout=layout)[0].float())
        alone = []
        for i in everything:  # the reference: the sample on its own, the model building its own masks
            p, r = batch.prompt_ids[i], batch.response_ids[i]
            out = model(input_ids=torch.tensor([p + r], device=device), use_cache=False)
            logp = torch.log_softmax(out.logits[0, len(p) - 1:-1].float(), -1)
            alone.append(logp.gather(-1, torch.tensor(r, device=device)[:, None])[:, 0])
        error = (torch.cat(packed) - torch.cat(alone)).abs().max().item()
    finally:
        model.train(was_training)
    return PackingCheck(packing=packing, max_abs_error=error,
                        tolerance=TOLERANCE.get(compute_dtype, HALF_TOLERANCE), num_samples=len(batch),
                        row_tokens=row_tokens, longest_sample=max(batch.seq_lens()))


def check_packing_precisely(model: torch.nn.Module, layout: AttentionLayout, packing: str, device: torch.device,
                            compute_dtype: torch.dtype = torch.float32, seed: int = 0) -> PackingCheck:
    """`check_packing` on the run's model and, when it computes in half precision, also on its fp32 proxy.

    A proxy that cannot be built (a config we cannot cut down) leaves the bf16 bar alone, said in the log line;
    a proxy that cannot run our packed inputs fails like the model would.
    """
    from dataclasses import replace

    from skyrl_stepwise.policy.packing.proxy import build_fp32_proxy

    check = check_packing(model, layout, packing, device, compute_dtype, seed)
    if compute_dtype in TOLERANCE:
        return check
    try:
        proxy = build_fp32_proxy(model, device, seed)
    except Exception as e:  # noqa: BLE001 - the coarse check still stands; the log line says why it is alone
        return replace(check, proxy_note=f"could not build one: {type(e).__name__}: {e}")
    config = proxy.config.get_text_config()
    note = f"{config.num_hidden_layers} of {model.config.get_text_config().num_hidden_layers} layers, random weights"
    try:
        return replace(check, proxy=check_packing(proxy, layout, packing, device, torch.float32, seed),
                       proxy_note=note)
    finally:
        del proxy


def refusal(check: PackingCheck, layout: AttentionLayout) -> str:
    """The start-up error for a failed self-check: what was wrong, on which model, and which keys to change."""
    worst = check.worst
    where = f" (on an fp32 copy of the architecture: {check.proxy_note})" if worst is not check else ""
    return (f"trainer.packing={check.packing} is not exact on this model: {layout.describe()}. Packed probe samples "
            f"scored up to {worst.max_abs_error:.3g} nats away from the same samples forwarded alone{where} (tolerance "
            f"{worst.tolerance:g}), so training would score samples in another context. The model probably ignores "
            f"the attention mask or position ids, or carries a state along the row. Try trainer.packing=rows or a "
            f"different trainer.attn_implementation (now {layout.attn_implementation}); if no packing passes, "
            f"report the architecture.")
