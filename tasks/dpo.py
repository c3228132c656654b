"""Prefect task of the DPO stage: the base policy fine-tuned with DPO on the pipeline's preference pairs.

DPO trains on the same training pairs as the reward heads (the shared :func:`foresight.pairs.split_pairs`
split with ``reward.eval_fraction`` / ``reward.seed``), so the held-out pairs are unseen by both and the
"SLA on top of DPO" comparison is fair. The held-out preference accuracy of DPO's implicit reward is
reported before (policy = reference: every margin is 0, so 0.5) and after training.
"""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from foresight.config import Config
from foresight.pairs import split_pairs
from foresight.storage import read_table
from tasks.data import GPU_TAG, StageResult


@task(name="train-dpo", tags=[GPU_TAG], cache_policy=NO_CACHE)
def dpo_task(cfg: Config) -> StageResult:
    """Train the DPO policy into ``paths.dpo_dir`` (atomically) and evaluate it on the held-out pairs."""
    from models.dpo import preference_accuracy, train_dpo
    from models.policy import load_policy, load_pretrained

    logger = get_run_logger()
    started = time.perf_counter()
    pairs = read_table(cfg.path(cfg.paths.pairs), "pairs")
    train_pairs, held_out = split_pairs(pairs, cfg.reward.eval_fraction, cfg.reward.seed)
    policy = load_policy(cfg.policy, cfg.path(cfg.paths.policy_dir))
    dpo_dir = cfg.path(cfg.paths.dpo_dir)
    logger.info("DPO on %d pairs (%d held out) on %s, beta=%g", len(train_pairs), len(held_out), policy.device,
                cfg.dpo.beta)
    metrics = train_dpo(policy, train_pairs, cfg.dpo, dpo_dir)

    # The saved folder is what later stages load, so that is what gets evaluated; the untouched base
    # policy is the reference.
    tuned = load_pretrained(dpo_dir, cfg.policy)
    evaluate = dict(tokenizer=policy.tokenizer, pairs=held_out, beta=cfg.dpo.beta, max_length=cfg.dpo.max_length)
    before = preference_accuracy(policy.model, policy.model, **evaluate)
    after = preference_accuracy(tuned.model, policy.model, **evaluate)
    metrics.update({
        "num_heldout": len(held_out),
        "heldout_accuracy_before": before["accuracy"],
        "heldout_margin_before": before["margin"],
        "heldout_accuracy_after": after["accuracy"],
        "heldout_margin_after": after["margin"],
        "wall_seconds": time.perf_counter() - started,
    })
    logger.info("DPO loss %.4f → %.4f; held-out implicit-reward accuracy %.3f → %.3f (margin %.4f)",
                metrics.get("loss_first", float("nan")), metrics.get("loss_last", float("nan")),
                before["accuracy"], after["accuracy"], after["margin"])
    return StageResult(metrics=metrics)
