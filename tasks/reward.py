"""Prefect task of the reward stages: the Reward Transformer and its adapter baselines (SLA §4.3, §5.3).

One task trains, on the frozen policy (the base policy or the DPO-tuned one), the reward channel and
one final-state adapter per configured depth, on the same training pairs with the same schedule, and
compares them on the same held-out pairs (pair accuracy, token-level reward curve, AuTRC): the paper's
Figure 4 ablation. The work lives in :mod:`models.reward_training`; this wrapper reads, splits, logs and
writes the folder atomically, as the other tasks do (:mod:`tasks.data`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from foresight.config import Config
from foresight.pairs import split_pairs
from foresight.storage import atomic_path, read_table
from tasks.data import GPU_TAG, StageResult, load_stage_policy, stage_accelerator


def _metric_key(head_name: str) -> str:
    """``adapter-4`` → ``adapter4``: metric names without dashes (``pair_accuracy_adapter4``)."""
    return head_name.replace("-", "")


@task(name="train-reward", tags=[GPU_TAG], cache_policy=NO_CACHE)
def train_reward_task(cfg: Config, policy_source: str, out_dir: Path) -> StageResult:
    """Train the reward channel and the adapter baselines on ``policy_source`` (``base`` or ``dpo``), jointly
    (one policy forward per batch feeds every head).

    Writes into ``out_dir``, all or nothing: one head folder per model (``channel/``, ``adapter-1/``, …,
    loadable with ``RewardTransformer.from_head``), ``curves.json`` (held-out metrics and the
    token-level reward curve of each head), ``history.json`` (training losses), ``autrc.png``, ``loss.png``.
    """
    from models.reward_training import evaluate_reward_head, plot_losses, plot_reward_curves, train_reward_heads
    from models.reward_transformer import RewardHeadConfig

    logger = get_run_logger()
    started = time.perf_counter()
    pairs_path = cfg.path(cfg.paths.pairs)
    pairs = read_table(pairs_path, "preference pairs")
    train_pairs, held_out = split_pairs(pairs, cfg.reward.eval_fraction, cfg.reward.seed)
    if train_pairs.empty or held_out.empty:
        raise ValueError(
            f"{pairs_path} has {len(pairs)} pair(s) from {pairs['prompt_id'].nunique()} prompt(s): reward training "
            "needs at least 2 (one to train on, one held out). Sample more prompts (prompts.num_train) or more "
            "responses per prompt (generate.num_samples)."
        )
    policy = load_stage_policy(cfg, policy_source)
    accelerator = stage_accelerator(policy)

    heads = {"channel": RewardHeadConfig(kind="channel", hidden_size=cfg.reward.hidden_size)}
    # §5.3's adapters are as wide as the policy: "4K" parameters for 1 layer and 50.3M for 4 layers on
    # Llama-3-8B are exactly d + 1 and 3·(d² + d) + d + 1 with d = 4096 (reward.hidden_size is the channel's)
    heads |= {f"adapter-{layers}": RewardHeadConfig(kind="adapter", hidden_size=policy.model.config.hidden_size,
                                                    adapter_layers=layers)
              for layers in cfg.reward.adapter_layers}
    logger.info("training %s on the %s policy (%s): %d train / %d held-out pairs", ", ".join(heads), policy_source,
                policy.device, len(train_pairs), len(held_out))

    metrics: dict = {"num_train_pairs": len(train_pairs), "num_eval_pairs": len(held_out)}

    def on_step(step: int, num_steps: int, losses: dict[str, float]) -> None:
        if step % max(1, num_steps // 10) == 0 or step == num_steps:
            logger.info("step %d/%d, loss %s", step, num_steps, ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))

    train_started = time.perf_counter()
    models, histories = train_reward_heads(policy, train_pairs, cfg.reward, heads, accelerator, on_step)
    metrics["train_seconds"] = time.perf_counter() - train_started
    curves: dict[str, dict] = {}
    with atomic_path(Path(out_dir)) as tmp:
        tmp.mkdir(parents=True)
        for name, model in models.items():
            evaluation = evaluate_reward_head(model, policy.tokenizer, held_out, cfg.reward)
            model.save_head(tmp / name)
            key = _metric_key(name)
            metrics |= {
                f"pair_accuracy_{key}": evaluation["pair_accuracy"],
                f"autrc_{key}": evaluation["autrc"],
                f"train_pair_accuracy_{key}": histories[name]["train_pair_accuracy"][-1],
                f"final_loss_{key}": histories[name]["loss"][-1],
                f"{key}_params": sum(p.numel() for p in model.head.parameters()),
            }
            curves[name] = evaluation
            logger.info("%s: held-out pair accuracy %.3f, AuTRC %.3f (%d params)", name,
                        evaluation["pair_accuracy"], evaluation["autrc"], metrics[f"{key}_params"])
        (tmp / "curves.json").write_text(json.dumps(curves, indent=2) + "\n")
        (tmp / "history.json").write_text(json.dumps(histories, indent=2) + "\n")
        plot_reward_curves({name: (c["x"], c["accuracy"]) for name, c in curves.items()}, tmp / "autrc.png")
        plot_losses(histories, tmp / "loss.png")
    metrics["wall_seconds"] = time.perf_counter() - started
    return StageResult(metrics=metrics, artifacts={"reward": Path(out_dir)})
