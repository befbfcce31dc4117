# Entry points: `make quickstart`, `make quickstart-headless`, `make test` (see README.md).
# Everything runs from the project virtual environment in .venv, which `setup` creates.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
# torch is pinned and installed first, then held by a constraints file while the extras install (lightning,
# accelerate, transformers, deepspeed would otherwise be free to pull a newer, multi-GB CUDA build).
TORCH  := torch==2.13.0
QUICKSTART := notebooks/00_quickstart.ipynb
LINT_PATHS := jupyter_shard tests benchmarks notebooks/run_headless.py .ci/build_ops.py
# Collected after tests/unit; each must exist and hold tests, so none is skipped silently.
SUITES := tests/integration tests/faults tests/notebooks tests/gpu tests/ui tests/launchers
PIP_FLAGS := $(if $(CI),--progress-bar off,)
# JupyterLab refuses to run as root (containers, CI) without this flag.
LAB_FLAGS := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup quickstart quickstart-headless lint test cuda-build-setup test-cuda-build

LABEXT := jupyter_shard/labextension/package.json
LABEXT_LINK := $(VENV)/share/jupyter/labextensions/jupyter_shard

setup: $(STAMP) $(LABEXT)

# The JupyterLab extension: labextension/ (TypeScript) built into jupyter_shard/labextension, which the
# venv's share/jupyter/labextensions/jupyter_shard points to (as `jupyter labextension develop` does).
# `pip install -e` builds it once; this rebuilds it when its sources change. Without npm the prebuilt
# output, if present, is used.
$(LABEXT): $(STAMP) labextension/package.json labextension/package-lock.json $(wildcard labextension/src/*.ts labextension/style/*)
	@if command -v npm >/dev/null 2>&1; then \
		echo "+ build labextension"; \
		(cd labextension && npm install --no-audit --no-fund && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" npm run build) || exit 1; \
	else echo "npm not found: using the prebuilt jupyter_shard/labextension (if present)"; fi
	@if [ -f $@ ]; then rm -rf $(LABEXT_LINK) && ln -s $(CURDIR)/jupyter_shard/labextension $(LABEXT_LINK) && touch $@; fi

# Re-runs only when pyproject.toml changes (or the venv is missing).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) $(TORCH)
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(PY) -m pip install $(PIP_FLAGS) -c $(VENV)/constraints.txt -e '.[test,dev,bench,lab,deepspeed,frameworks]'
	$(PY) -c "import jupyter_shard, torch, nbval, lightning, transformers, accelerate; print('setup ok: torch', torch.__version__)"
	touch $@

quickstart: setup
	$(VENV)/bin/jupyter lab $(LAB_FLAGS) $(QUICKSTART)

quickstart-headless: setup
	$(PY) notebooks/run_headless.py $(QUICKSTART)

# Shell commands of `lint`: every check runs; $status ends up 1 if any failed.
LINT_SH = status=0; \
	echo "+ ruff check $(LINT_PATHS)"; $(VENV)/bin/ruff check $(LINT_PATHS) || status=1; \
	echo "+ ruff format --check $(LINT_PATHS)"; $(VENV)/bin/ruff format --check $(LINT_PATHS) || status=1; \
	echo "+ mypy (strict, jupyter_shard)"; $(VENV)/bin/mypy || status=1; \
	echo "+ mypy --strict notebooks/run_headless.py .ci/build_ops.py"; \
	$(VENV)/bin/mypy --strict notebooks/run_headless.py .ci/build_ops.py || status=1; \
	echo "+ nbqa ruff notebooks (cells under %%distributed and %%rank included)"; \
	$(VENV)/bin/nbqa ruff notebooks || status=1; \
	echo "+ nbqa 'ruff format --check' notebooks"; \
	$(VENV)/bin/nbqa "ruff format --check" notebooks || status=1

lint: setup
	@$(LINT_SH); exit $$status

# lint, then tests/unit (fast), then the real-process suites, the browser tests, the launcher tests
# on a local SLURM and the notebooks (nbval compares the stored outputs). Every stage runs; the target
# fails if any stage failed. pytest's exit code 5 (no tests collected) counts as a failure.
# SLURM (.ci/slurm.sh) is started before the suites and stopped on exit, failure or interrupt
# included, unless it was already up; a failed start fails the run under CI and is a warning elsewhere.
# DeepSpeed's CPU ops are built (.ci/build_ops.py, at most 30 min) at low priority from the start, in
# the CPU time the tests leave; a test that reaches an op still building waits for it, and the one that
# needs the op built last is marked `late` (run last). An interrupt, hangup or failure stops the build's
# whole process group.
test: setup
	@failed=""; \
	run_pytest() { \
		name=$$1; shift; \
		echo "+ pytest $$*"; $(PY) -m pytest "$$@"; rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests in: $$*"; fi; \
		if [ $$rc -ne 0 ]; then failed="$$failed $$name(exit $$rc)"; fi; \
	}; \
	mkdir -p test-artifacts; rm -f test-artifacts/junit-*.xml; \
	echo "+ .ci/build_ops.py in the background at nice 19 (DeepSpeed's CPU ops; a test waits for one still building)"; \
	setsid nice -n 19 timeout 1800 $(PY) .ci/build_ops.py >test-artifacts/build-ops.log 2>&1 & ops=$$!; \
	trap '[ -z "$$ops" ] || kill -- -$$ops 2>/dev/null || true' EXIT; \
	trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 131' QUIT; trap 'exit 143' TERM; \
	$(LINT_SH); [ $$status -eq 0 ] || failed="$$failed lint"; \
	run_pytest unit tests/unit --junitxml=test-artifacts/junit-unit.xml; \
	if command -v npm >/dev/null 2>&1; then \
		echo "+ npm test (labextension, Jest)"; (cd labextension && npm test) || failed="$$failed jest"; \
	elif [ -n "$(CI)" ]; then echo "error: npm not found; the extension's Jest tests need Node"; failed="$$failed jest"; \
	else echo "npm not found: skipping the extension's Jest tests"; fi; \
	if ! bash .ci/slurm.sh status >/dev/null 2>&1; then \
		trap '[ -z "$$ops" ] || kill -- -$$ops 2>/dev/null || true; bash .ci/slurm.sh stop || true' EXIT; \
	fi; \
	echo "+ .ci/slurm.sh start"; \
	if ! bash .ci/slurm.sh start; then \
		if [ -n "$(CI)" ]; then echo "error: SLURM did not start"; failed="$$failed slurm"; \
		else echo "warning: SLURM did not start; the tests in tests/launchers will be skipped"; fi; \
	fi; \
	for suite in $(SUITES); do \
		if ! find $$suite \( -name 'test_*.py' -o -name '*_test.py' \) 2>/dev/null | grep -q .; then \
			echo "error: $$suite has no test files"; failed="$$failed $$suite(missing)"; \
		fi; \
	done; \
	echo "+ .ci/build_ops.py so far:"; tr '\r' '\n' <test-artifacts/build-ops.log | grep '^build_ops:'; \
	run_pytest integration+faults+notebooks $(foreach s,$(SUITES),$(wildcard $(s))) notebooks \
		--nbval --nbval-current-env --nbval-sanitize-with tests/notebooks/nbval_sanitize.cfg \
		--junitxml=test-artifacts/junit-suites.xml; \
	wait $$ops || true; ops=""; echo "+ .ci/build_ops.py:"; \
	tr '\r' '\n' <test-artifacts/build-ops.log | grep '^build_ops:' || tail -c 2000 test-artifacts/build-ops.log; \
	echo "+ .ci/ran_each.py (each test folder ran a test; tests/gpu needs a GPU)"; \
	if ! $(PY) .ci/ran_each.py test-artifacts/junit-*.xml -- tests/unit $(filter-out tests/gpu,$(SUITES)) notebooks; then \
		if [ -n "$(CI)" ]; then failed="$$failed ran-each"; else echo "warning: (outside CI, a folder may skip for what this machine lacks)"; fi; \
	fi; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed"; exit 1; fi; \
	echo "make test: all stages passed"

# -- the planner under a CUDA build of torch, no GPU needed: `make cuda-build-setup`, then `make test-cuda-build` --
# Optional, and not part of `make test` or CI: a CUDA build of torch is several GB. It behaves unlike the CPU
# build even without a GPU (FakeTensorMode installs a CUDA device guard, so a backward starts autograd's
# device threads, which broke the dry run's forked child: issue 38), and it is what every GPU machine has.
# $(CUDA_VENV) holds it, apart from .venv; 2.14.1 is the CUDA build this machine's pip has on disk.
CUDA_VENV  ?= .venv-cuda
CUDA_TORCH ?= torch==2.14.1
PYTEST_ARGS ?= tests/unit/planner

cuda-build-setup: $(CUDA_VENV)/.setup-stamp

$(CUDA_VENV)/.setup-stamp: pyproject.toml
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install $(PIP_FLAGS) $(CUDA_TORCH)
	echo "$(CUDA_TORCH)" > $(CUDA_VENV)/constraints.txt
	$(CUDA_VENV)/bin/python -m pip install $(PIP_FLAGS) -c $(CUDA_VENV)/constraints.txt -e '.[test]'
	$(CUDA_VENV)/bin/python -c "import torch; assert torch.version.cuda, 'not a CUDA build'; print('cuda build ok: torch', torch.__version__)"
	touch $@

# The planner's unit tests (or PYTEST_ARGS) with the CUDA build; an error, not a skip, without its venv.
test-cuda-build:
	@test -x $(CUDA_VENV)/bin/python || { echo "error: no venv at $(CUDA_VENV); run \`make cuda-build-setup\` or pass CUDA_VENV=<a venv with a CUDA build of torch>"; exit 1; }
	$(CUDA_VENV)/bin/python -c "import torch; assert torch.version.cuda, 'torch in $(CUDA_VENV) is not a CUDA build'"
	$(CUDA_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# -- a GPU machine with no network (README, Development): `make gpu-bundle` here, `make gpu-check` there ------
# Neither depends on `setup`: the GPU machine has no .venv and never makes one.
.PHONY: gpu-bundle gpu-check

GPU_BUNDLE ?= gpu-bundle
GPU_DEEPSPEED ?= deepspeed==0.19.8
# pip reads dependencies' environment markers for the Python it runs in: a 3.12, as on the GPU machine,
# where one is found (on PATH or pyenv's), else $(PYTHON).
GPU_BUNDLE_PYTHON ?= $(or $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c "" 2>/dev/null && { echo "$$p"; break; }; done),$(PYTHON))
# On the GPU machine: the Python that has torch and Lightning, and where the report goes.
GPU_PYTHON ?= python3
GPU_REPORT ?= benchmarks/results/gpu_check.md

# Wheels for CPython 3.12 manylinux x86-64 into $(GPU_BUNDLE)/: this package, DeepSpeed (built here, no
# ops), pytest, pytest-timeout and their dependencies; never torch, nvidia-* or Lightning. Checks that it
# resolves offline and stays under 64 MiB, and prints its size.
gpu-bundle:
	$(GPU_BUNDLE_PYTHON) benchmarks/gpu_bundle.py --out $(GPU_BUNDLE) --deepspeed $(GPU_DEEPSPEED)

# On the GPU machine, with $(GPU_BUNDLE)/ carried there: a venv that sees the machine's torch and Lightning,
# the bundle installed offline, the GPU benchmark, `pytest -m gpu tests/gpu`, one report in $(GPU_REPORT).
# Under 9 minutes; each stage has its own timeout.
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py check --bundle $(GPU_BUNDLE) --results $(GPU_REPORT)
