"""Shared fixtures: offline environment and tiny models (the helpers tests import: tests/helpers.py)."""

from __future__ import annotations

import logging
import os
import warnings

# Set before anything imports huggingface_hub / prefect / mlflow / torch: no network, no telemetry; one intra-op thread
# (OMP_NUM_THREADS, inherited by every process a test starts: DVC's stage processes, `foresight run`, Prefect workers).
# Tiny models gain nothing from intra-op threads, and on the loaded 2-core machine (the other xdist worker busy) two
# threads contend badly: forwards measured 10-40x slower; the tiny DVC pipeline's stages took 386 s with torch's
# default of 2 threads per stage process against 225 s with 1 (its SLA benchmark 72.5 s against 5.8 s).
os.environ.update({
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
    "GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "TOKENIZERS_PARALLELISM": "false",
})

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny import (  # noqa: E402
    build_bos_llama3,
    build_remote_code_classifier,
    build_tiny_armorm,
    build_tiny_classifier,
    build_tiny_llama,
)

torch.set_num_threads(1)  # OMP_NUM_THREADS above; and in case torch was imported before this file (a plugin)


class _LoggedCacheDeprecation(logging.Filter):
    """transformers logs (``warning_once``), rather than warns, "`past_key_values`/`cache_params` are deprecated"
    where code reads an output's KV cache by its pre-5.24 name (transformers/utils/generic.py): re-issued as a
    FutureWarning, which pyproject.toml's filterwarnings turns into an error raised at the line that read it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("`past_key_values`/`cache_params` are deprecated"):
            warnings.warn(record.getMessage(), FutureWarning, stacklevel=2)
        return True


logging.getLogger("transformers.utils.generic").addFilter(_LoggedCacheDeprecation())


# The longest file first: under pytest-xdist (``--dist loadfile``, pyproject.toml) one worker spends the run on the
# DVC pipeline, mostly waiting for stage processes to start, while the other takes every other file.
FIRST = "test_dvc_pipeline.py"


def pytest_collection_modifyitems(config, items):
    """The DVC pipeline's tests first (a stable sort: the order within and between other files stays); tests marked
    ``cuda`` run wherever a GPU is visible and are skipped elsewhere (CI has none)."""
    items.sort(key=lambda item: item.path.name != FIRST)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test starts with no process-wide ``AcceleratorState``: a Trainer's or an Accelerator's mixed precision
    would otherwise carry over into the next test's Accelerators in this worker."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-classifier"))


@pytest.fixture(scope="session")
def tiny_armorm(tmp_path_factory) -> Path:
    return build_tiny_armorm(tmp_path_factory.mktemp("tiny-armorm"))


@pytest.fixture(scope="session")
def remote_code_classifier(tmp_path_factory) -> Path:
    return build_remote_code_classifier(tmp_path_factory.mktemp("remote-code-classifier"))


@pytest.fixture(scope="session")
def tiny_llama3_bos(tmp_path_factory) -> Path:
    """:func:`tests.tiny.build_bos_llama3`'s model folder."""
    return build_bos_llama3(tmp_path_factory.mktemp("tiny-llama3-bos"))


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """A temporary Prefect API (``prefect_test_harness``) with its own ``PREFECT_HOME``; yields the API URL.

    ``PREFECT_HOME`` goes both into ``os.environ`` (the harness's server subprocess and any process a test
    starts inherit it) and into the in-process settings (prefect read its settings at import time), so
    result storage, profiles and the memo store live in a temp dir, not in ``~/.prefect``.
    """
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(home))
        mp.delenv("PREFECT_API_URL", raising=False)
        with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_HOME: home}):
            with prefect_test_harness(server_startup_timeout=60):
                url = prefect.settings.PREFECT_API_URL.value()
                assert url and prefect.settings.PREFECT_HOME.value() == home
                assert prefect.settings.get_current_settings().results.local_storage_path == home / "storage"
                yield url
