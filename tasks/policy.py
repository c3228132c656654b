"""Prefect task of the ``prepare_policy`` stage: the configured policy, available locally (docs/pipeline.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from models.engine.policy import prepare_policy
from tasks.common import StageResult

if TYPE_CHECKING:
    from foresight.config import Config


@task(name="prepare-policy", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def prepare_policy_task(cfg: Config) -> StageResult:
    """Make the configured policy available locally (retried: a hub download can fail transiently)."""
    started = time.perf_counter()
    manifest = prepare_policy(cfg.policy, cfg.path(cfg.paths.policy_dir))
    get_run_logger().info("policy ready: %s", manifest)
    return StageResult(metrics={"wall_seconds": time.perf_counter() - started})
