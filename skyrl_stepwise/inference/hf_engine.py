"""Token-in/token-out generation with plain transformers: the backend that needs no vLLM.

Concurrent `generate` calls are collected from an asyncio queue and decoded together (left padding,
one KV cache per batch), each with its own sampling params, stop strings and seed. A batch runs to
completion before the next starts: simple and exact, not continuous batching.
Logprobs are those of the distribution each token was drawn from: log-softmax of the logits after
temperature, top-k and top-p, i.e. vLLM's `logprobs_mode="processed_logprobs"` (which VLLMEngine sets).
That is what the trainer scores (logits / temperature), so TIS weights and the weight-sync probe are
exact at any T. Greedy requests (temperature 0) get the plain log-softmax, as in vLLM, which treats
their temperature as 1 and ignores their top-k/top-p.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from skyrl_stepwise.inference.adapter_files import ADAPTER_CONFIG, AdapterFiles, AdapterFolders, as_adapter_files
from skyrl_stepwise.inference.base import GenerationResult, SamplingParams, validate_prompt
from skyrl_stepwise.inference.config import EngineConfig
from skyrl_stepwise.inference.truncation import truncate_logits
from skyrl_stepwise.models.prepare import resolve_model_path


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    adapter_version: int | None = None  # the policy version (LoRA adapter) it samples with; None: the base


def by_adapter(batch: list[_Request]) -> list[list[_Request]]:
    """The batch's requests grouped by the adapter version they sample with, in order of first arrival."""
    groups: dict[int | None, list[_Request]] = {}
    for request in batch:
        groups.setdefault(request.adapter_version, []).append(request)
    return list(groups.values())


def process_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The logits a token is drawn from, in vLLM's order: temperature, then top-k, then top-p (dropped
    tokens get -inf; inference/truncation.py, which the trainer scores with too). Greedy (temperature 0)
    leaves them as they are, like vLLM's processed logprobs."""
    if sampling.temperature == 0:
        return logits
    return truncate_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Draw one id from a row of float32 logits the way vLLM does; return it with its logprob under the
    distribution it was drawn from (what the trainer scores at the same temperature)."""
    processed = process_logits(logits, sampling)
    if sampling.temperature == 0:
        token = int(logits.argmax())
    else:
        token = int(torch.multinomial(processed.softmax(-1), 1, generator=generator))
    return token, float(processed.log_softmax(-1)[token])


class HFEngine:
    """InferenceEngine over a transformers causal LM with dynamic batching of concurrent requests."""

    def __init__(self, cfg: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from skyrl_stepwise.models.rope import pin_longrope

        self.cfg = cfg
        path = resolve_model_path(cfg.model_path)
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype))
        # longrope: the factors vLLM uses at this context for every token, as the trainer does (models/rope.py);
        # transformers' per-forward choice would switch mid-generation, with the KV cache holding the other ones
        pin_longrope(self.model, cfg.max_model_len, key="engine.max_model_len")
        self.model.to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self._rng = torch.Generator().manual_seed(cfg.seed)
        self.adapters: list[int] = []  # policy versions loaded as peft adapters f"v{version}", oldest first
        self.active_adapter: int | None = None  # what a new request samples with (None: the base model)
        self.adapter_folders = AdapterFolders()  # the loaded versions' folders, written from the bytes received
        self._loop: asyncio.AbstractEventLoop | None = None  # queue/lock/worker belong to one event loop

    def _ensure_worker(self) -> None:
        """(Re)start the batching task on the running loop; tests and apps may switch loops."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and not self._worker.done():
            return
        self._loop, self._queue, self._lock = loop, asyncio.Queue(), asyncio.Lock()
        self._worker = loop.create_task(self._serve())

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       session_id: str | None = None) -> GenerationResult:
        """Queue one request; it is decoded together with whatever else is waiting."""
        prompt_ids = [int(t) for t in prompt_ids]
        validate_prompt(prompt_ids, self.vocab_size, self.cfg.max_model_len)
        self._ensure_worker()
        future = self._loop.create_future()
        await self._queue.put(_Request(prompt_ids, sampling, future, self.active_adapter))
        return await future

    async def _serve(self) -> None:
        """Forever: take the waiting requests (up to max_batch_size), decode them, resolve their futures."""
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(self.cfg.batch_wait_s)
            while len(batch) < self.cfg.max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            results, groups = [], by_adapter(batch)
            for group in groups:  # one forward serves one adapter: versions are decoded apart
                async with self._lock:
                    try:
                        self._use_adapter(group[0].adapter_version)
                        results += await asyncio.to_thread(self._run_batch, group)
                    except Exception as e:  # the whole group failed: every caller gets the error
                        results += [e] * len(group)
            batch = [request for group in groups for request in group]
            for request, result in zip(batch, results):
                if request.future.done():  # caller cancelled
                    continue
                if isinstance(result, Exception):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Request]) -> list[GenerationResult]:
        """Left-pad the prompts, then decode step by step with a shared KV cache until every row ends."""
        n, width = len(batch), max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        generators = [torch.Generator().manual_seed(self._seed(r.sampling)) for r in batch]
        budgets = [min(r.sampling.max_tokens, self.cfg.max_model_len - len(r.prompt_ids)) for r in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        finish: list[str | None] = [None] * n
        stop_strings: list[str | None] = [None] * n
        past = None
        step_ids = input_ids
        while any(f is None for f in finish):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            out = self.model(input_ids=step_ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1].float().cpu()
            next_ids = [self.pad_id] * n
            for i, r in enumerate(batch):
                if finish[i] is not None:
                    continue
                token, logprob = sample_token(logits[i], r.sampling, generators[i])
                next_ids[i] = token
                tokens[i].append(token)
                logprobs[i].append(logprob)
                finish[i], stop_strings[i] = self._check_stop(tokens[i], r.sampling, budgets[i])
            step_ids = torch.tensor(next_ids).unsqueeze(1)
            alive = torch.tensor([[int(f is None)] for f in finish])
            mask = torch.cat([mask, alive], dim=1)
        return [
            GenerationResult(tokens[i], logprobs[i] if r.sampling.logprobs else None, finish[i], stop_strings[i])
            for i, r in enumerate(batch)
        ]

    def _seed(self, sampling: SamplingParams) -> int:
        """Per-request seed when given (reproducible), else the next draw from the engine's seeded stream."""
        if sampling.seed is not None:
            return sampling.seed
        return int(torch.randint(0, 2**62, (1,), generator=self._rng))

    def _check_stop(self, tokens: list[int], sampling: SamplingParams, budget: int) -> tuple[str | None, str | None]:
        """vLLM's rules: EOS ends with "stop"; a stop string in the decoded text ends with "stop" (kept in
        the output); running out of budget ends with "length".

        This runs after every token, so a new stop string must end in the newest token: only a tail
        window is decoded (O(1) per token instead of O(n)). A character takes at most 4 byte-level
        tokens; the margin lets a window that starts mid-character or at a stripped leading space
        still decode the stop string intact.
        """
        if tokens[-1] in self.eos_ids or tokens[-1] in sampling.stop_token_ids:
            return "stop", None
        if sampling.stop:
            window = 4 * max(map(len, sampling.stop)) + 8
            text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
            hit = next((s for s in sampling.stop if s in text), None)
            if hit is not None:
                return "stop", hit
        if len(tokens) >= budget:
            return "length", None
        return None, None

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place between batches; names are HF checkpoint names (model.state_dict())."""
        self._ensure_worker()
        state = self.model.state_dict()
        tensors = [(self._base_name(name, state), tensor) for name, tensor in named_tensors]
        unknown = [name for name, _ in tensors if name not in state]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter name(s) {unknown[:5]} (expected HF names like {next(iter(state))!r})")
        for name, tensor in tensors:
            if tensor.shape != state[name].shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(state[name].shape)}")
        async with self._lock:  # never swap weights in the middle of a batch
            with torch.no_grad():
                for name, tensor in tensors:
                    state[name].copy_(tensor)

    @staticmethod
    def _base_name(name: str, state: dict) -> str:
        """An HF checkpoint name in this model's state dict: once peft adapters are loaded an adapted layer's weight
        is `<module>.base_layer.<leaf>` (a new base, e.g. after an engine restart, goes there; adapters stay)."""
        if name in state:
            return name
        module, _, leaf = name.rpartition(".")
        wrapped = f"{module}.base_layer.{leaf}"
        return wrapped if wrapped in state else name

    async def load_adapter(self, adapter: AdapterFiles | str | Path, version: int) -> list[int]:
        """trainer.lora.sync=adapter: write the peft adapter's bytes (a folder path is read first) into this engine's
        own folder for version `version`, load it there (peft's load_adapter, adapter name f"v{version}"), make it the
        one new requests sample with, and delete versions older than the newest engine.max_loras, folders included;
        returns the versions loaded. Between batches, never inside one."""
        import json

        if self.cfg.max_lora_rank is None:
            raise RuntimeError("load_adapter: this engine was started without LoRA (engine.max_lora_rank=null); "
                               "trainer.lora.sync=adapter sets it")
        adapter = as_adapter_files(adapter)
        rank = json.loads(adapter.files[ADAPTER_CONFIG])["r"]
        if rank > self.cfg.max_lora_rank:
            raise ValueError(f"trainer.lora.rank={rank} is above the engine's LoRA rank limit "
                             f"engine.max_lora_rank={self.cfg.max_lora_rank}")
        self._ensure_worker()
        async with self._lock:
            path = self.adapter_folders.write(version, adapter)
            try:
                self.model.load_adapter(str(path), adapter_name=f"v{version}")
            except BaseException:
                self.adapter_folders.remove(version)
                raise
            self.adapters.append(int(version))
            self.active_adapter = int(version)
            while len(self.adapters) > self.cfg.max_loras:
                old = self.adapters.pop(0)
                self.model.delete_adapter(f"v{old}")
                self.adapter_folders.remove(old)
        return list(self.adapters)

    def shutdown(self) -> None:
        """Remove this engine's adapter folders (the model lives in this process: nothing else to stop)."""
        self.adapter_folders.remove_all()

    def _use_adapter(self, version: int | None) -> None:
        """Switch the model to `version`'s adapter (None: the base, every adapter off) for the next batch."""
        if not self.adapters:
            if version is not None:
                raise RuntimeError(f"adapter v{version} requested but no adapter is loaded")
            return
        if version is None:
            self.model.disable_adapters()
            return
        if version not in self.adapters:
            raise RuntimeError(f"a request of policy version {version} arrived after its adapter was removed "
                               f"(loaded: {self.adapters}); raise engine.max_loras")
        self.model.enable_adapters()
        self.model.set_adapter(f"v{version}")

    @property
    def node_id(self) -> str:
        """In-process: the driver's node."""
        from skyrl_stepwise.inference.weights import current_node_id

        return current_node_id()

    async def update_weights_from_file(self, path: str) -> None:
        """Reload from a safetensors file written by the trainer on this node (see inference/weights.py)."""
        from skyrl_stepwise.inference.weights import load_weights_file

        await self.update_weights(load_weights_file(path).items())

    async def health(self) -> bool:
        """The model lives in this process: healthy unless the batching task died with an error."""
        worker = getattr(self, "_worker", None)
        return worker is None or not worker.done() or worker.cancelled() or worker.exception() is None
