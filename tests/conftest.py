"""Shared fixtures: offline environment, tiny models, and config factories."""

from __future__ import annotations

import os

# Set before anything imports huggingface_hub / prefect / mlflow: no network, no telemetry.
os.environ.update({
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
    "GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "TOKENIZERS_PARALLELISM": "false",
})

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from tests.tiny import (  # noqa: E402
    build_remote_code_classifier,
    build_tiny_armorm,
    build_tiny_classifier,
    build_tiny_llama,
)

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine two threads contend
# badly (forwards measured 10-40x slower); subprocesses the tests start keep torch's default.
torch.set_num_threads(1)


REPO = Path(__file__).resolve().parent.parent

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


def build_bos_llama3(folder: Path) -> Path:
    """A random 2-layer Llama over a Llama-3-style tokenizer that, like Meta-Llama-3's own tokenizer.json (its
    post-processor: ByteLevel, then TemplateProcessing), puts ``<|begin_of_text|>`` before every text it tokenizes with
    special tokens, while its chat template writes that BOS too: the pair that gives a second BOS to whatever tokenizes
    templated text with special tokens on. SmolLM2's tokenizer adds none, so the default run never shows it."""
    from tokenizers import processors
    from transformers import LlamaForCausalLM

    from tests.tiny import _llama_config, build_llama3_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_llama3_tokenizer(folder)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.bos_token_id)])])
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(tok)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama3_bos(tmp_path_factory) -> Path:
    """:func:`build_bos_llama3`'s model folder."""
    return build_bos_llama3(tmp_path_factory.mktemp("tiny-llama3-bos"))


def tiny_params(root: Path, model: Path, **sections) -> dict:
    """A params dict for a fast run on the tiny model under ``root`` (a small, complete pipeline)."""
    params = {
        # float32: the tests prove exact token-for-token identity with greedy, a float32 property (bf16 rounds a
        # multi-token forward differently from a one-token one); the default run's bf16 is measured by its benchmarks
        "policy": {"model": str(model), "device": "cpu", "dtype": "float32"},
        "label": {"dtype": "float32"},
        "prompts": {"num_train": 6, "num_eval": 2, "seed": 0},
        "generate": {"num_samples": 3, "max_new_tokens": 12, "batch_size": 4, "seed": 0},
        "tracking": {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "test"},
        "reward": {"hidden_size": 16, "epochs": 1, "batch_size": 2, "max_length": 256, "learning_rate": 1e-3},
        "dpo": {"epochs": 1, "batch_size": 2, "max_length": 256},
        "sla": {"depth": 2, "width": 2, "step": 3},
        "sla_benchmark": {"num_prompts": 2, "speed_prompts": 2, "max_new_tokens": 8, "overhead_repeats": 4},
        "medusa": {"num_heads": 2, "epochs": 1, "batch_size": 16, "distill_batch_size": 4, "mixed_precision": "no",
                   "task_prompts": 8, "general_prompts": 2},
        "rlmedusa": {"trajectory_tokens": 4, "top_pool": 10, "reward_width": 16, "reward_epochs": 1,
                     "num_actions": 4, "batch_size": 8},
        "medusa_benchmark": {"tree": [[0], [1], [0, 0]], "num_prompts": 2, "speed_prompts": 2, "general_prompts": 2,
                             "max_new_tokens": 8, "curve_batch_sizes": [1, 2], "curve_batches": 2,
                             "decoders": ["greedy", "prompt_lookup", "medusa_supervised", "medusa_rl"]},
        "coral": {"stage1_epochs": 1, "stage2_epochs": 1, "batch_size": 4, "max_length": 256, "mixed_precision": "no"},
        "coral_benchmark": {"block_size": 6, "num_prompts": 2, "speed_prompts": 2, "max_new_tokens": 8,
                            "ablations": ["no_verifier", "no_multi_forward"], "ablation_block_sizes": [3],
                            "ablation_forward_windows": [2]},
        "mtp": {"num_depths": 2, "ce_weights": [0.6, 0.4], "epochs": 1, "batch_size": 4, "max_length": 256,
                "ablation_depths": [1], "mixed_precision": "no"},
        "mtp_rl": {"steps": 1, "group_size": 2, "max_new_tokens": 6, "eval_prompts": 2,
                   "variants": ["vanilla", "mtp_rl", "frozen_mtp", "ce_only", "no_backprop"],
                   "curve_batch_sizes": [1, 2], "curve_batches": 2},
    }
    for name, values in sections.items():
        params.setdefault(name, {}).update(values)
    return params


def project_cache_type() -> str:
    """``cache.type`` of this project's ``.dvc/config`` (how DVC links outputs to its cache)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / ".dvc" / "config")
    return config.get("cache", "type", fallback="reflink,copy")  # DVC's default


def make_dvc_repo(repo: Path, params: dict, env: dict, remote: Path | None = None) -> None:
    """A committed git + DVC repository at ``repo`` with this project's code, ``dvc.yaml`` and ``params`` (written
    resolved: DVC reads params.yaml itself, and the config's defaults are invisible to it) and this project's DVC
    cache links (``cache.type`` of ``.dvc/config``); ``remote``: a local DVC remote. ``env``: the environment of its
    git and dvc commands (a git identity included)."""
    import shutil
    import subprocess
    import sys

    from foresight.config import parse_config
    from foresight.stages import render_dvc_yaml

    repo.mkdir(parents=True, exist_ok=True)
    for package in ("foresight", "models", "tasks", "flows"):
        shutil.copytree(REPO / package, repo / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cfg = parse_config(params, root=repo)
    (repo / "dvc.yaml").write_text(render_dvc_yaml(cfg))  # with the local files these params name (tiny models)
    (repo / "params.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False))
    (repo / ".gitignore").write_text("__pycache__/\nmlflow.db\nmlflow.db.lock\nmlruns/\n*.log\n")
    dvc = [sys.executable, "-m", "dvc"]
    commands = [["git", "init", "-q"], ["git", "config", "user.name", "test"],
                ["git", "config", "user.email", "test@example.com"], [*dvc, "init", "-q"],
                [*dvc, "config", "cache.type", project_cache_type()],
                *([[*dvc, "remote", "add", "-d", "local", str(remote)]] if remote else []),
                ["git", "add", "-A"], ["git", "commit", "-q", "-m", "tiny pipeline"]]
    for command in commands:
        subprocess.run(command, cwd=repo, env=env, check=True, capture_output=True)


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
