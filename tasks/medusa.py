"""Prefect tasks of the Medusa training stages: Medusa-1 heads and RLMedusa's t + 2 head.

Thin wrappers around :mod:`models.medusa.training` and :mod:`models.medusa.rlmedusa`: they read the data, split it by
prompt, log progress, and write each output folder atomically. The ``benchmark_medusa`` stage that decodes with the
trained heads, beside every other drafter, is :mod:`tasks.speculative_benchmark`.

* ``train_medusa`` — one frozen pass over the ``distill`` stage's responses (:mod:`tasks.distill`: the policy's
  greedy responses to the training prompts, or the generated samples, and to training instructions of the general
  set), kept in ``distilled/`` for the RL stage, its hidden states read back from disk as training needs them; then
  Medusa-1 training of K heads; held-out top-1/top-k accuracy per head (the ``distill`` stage's split).
* ``train_rlmedusa`` — the trajectory states and their candidates over that pass's states
  (:func:`models.medusa.rlmedusa.trajectory_candidates`), the reward model r(e, h) (MSE on the base model's t + 2
  probabilities), then head 1 by REINFORCE on r − β·KL; held-out accuracy at t + 2 of the RL head against the
  supervised head.

The two training tasks may run in every process of ``accelerate launch`` (docs/gpu.md): each process trains
on its share of every batch, only the main process writes (the distilled cache, then the heads), and all wait
for each other after the writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from foresight import statistics
from foresight.plots import line_panels, line_plot
from foresight.storage import atomic_path, write_json
from models.engine.speculative import likeliest_paths
from models.medusa.heads import IGNORE_INDEX, MedusaHeads
from models.medusa.rlmedusa import evaluate_reward_model, fit_reward_model, train_rl_head, trajectory_candidates
from models.medusa.training import (
    accuracy_by_rank,
    evaluate_heads,
    load_distilled as load_cache,
    self_distill,
    target_ranks,
    too_long_responses,
    train_medusa_heads,
)
from tasks.common import StageResult, gpu_task, live_curves, load_stage_policy, stage_accelerator, stage_logger
from tasks.distilled import DISTILLED_SPLIT_FILE, distilled_dir, shared_distilled_responses

if TYPE_CHECKING:
    from foresight.config import Config

EVAL_RANKS = 10  # held-out accuracy per rank of each head's tokens, up to this rank
TREE_PATHS = 64  # the most often accepted paths kept in evaluation.json (medusa_benchmark.tree_size ≤ this)
RL_CURVES = ("loss", "reward", "kl")
"""The per-step curves of each RL head (``rl_<init>.<key>``): the stats of
:func:`models.medusa.rlmedusa.reinforce_step_loss`."""


def _medusa_dir(cfg: Config) -> Path:
    return cfg.path(cfg.paths.medusa_dir)


def _accuracy_metrics(prefix: str, accuracy: dict[str, list[float]]) -> dict[str, float]:
    return {f"{prefix}{name}_head{k + 1}": value for name, values in accuracy.items() if name != "rank_accuracy"
            for k, value in enumerate(values)}


@gpu_task("train-medusa")
def train_medusa_task(cfg: Config) -> StageResult:
    """The frozen pass over the ``distill`` stage's responses, Medusa-1 heads trained on it, evaluated on the
    held-out prompts of the ``distill`` stage's split.

    Writes ``distilled/`` (the frozen pass's cache: hidden states and targets) and ``supervised/`` (heads,
    ``evaluation.json``, ``history.json``, ``loss.png``).
    """
    logger = stage_logger()
    started = time.perf_counter()
    m = cfg.medusa
    policy = load_stage_policy(cfg, "base")
    accelerator = stage_accelerator(policy.device, m.mixed_precision, m.gradient_accumulation_steps)
    pass_started = time.perf_counter()
    if accelerator.is_main_process:  # one pass, one cache on disk: every process then reads it from there
        _frozen_pass(cfg, policy, _cache_dir(cfg))
    accelerator.wait_for_everyone()
    data, train_rows, eval_rows = load_distilled(cfg)
    pass_seconds = time.perf_counter() - pass_started
    train, held_out = data.subset(train_rows), data.subset(eval_rows)
    logger.info("%d training / %d held-out positions; training %d heads", len(train.hidden), len(held_out.hidden),
                m.num_heads)
    prompt_sets = shared_distilled_responses(cfg, "train_medusa", further=True)["prompt_set"]

    def on_step(step: int, num_steps: int, losses: dict[str, float]) -> None:
        if step % max(1, num_steps // 10) == 0 or step == num_steps:
            logger.info("step %d/%d, loss %.4f", step, num_steps, losses["loss"])

    train_started = time.perf_counter()
    curve_keys = ("loss", *(f"ce_head{k + 1}" for k in range(m.num_heads)))
    with live_curves(cfg, lambda key: key if key in curve_keys else None):
        heads, history = train_medusa_heads(policy, train, m, accelerator, on_step)
    train_seconds = time.perf_counter() - train_started
    lm_head = policy.model.get_output_embeddings()
    ranks = max(EVAL_RANKS, m.eval_top_k)
    found = target_ranks(heads, lm_head, held_out, ranks)  # (M, K)
    accuracy = accuracy_by_rank(found, held_out.targets, m.eval_top_k, ranks)
    logger.info("held-out top-1 per head: %s, top-%d: %s", accuracy["top1"], m.eval_top_k, accuracy[f"top{m.eval_top_k}"])
    # the same accuracies on each prompt set's held-out responses alone: do the heads draft open-ended text too?
    position_sets = prompt_sets.to_numpy()[held_out.sample.numpy()]
    by_set = {name: accuracy_by_rank(found[mask], held_out.targets[mask], m.eval_top_k, ranks)
              for name in sorted(set(position_sets)) for mask in [torch.from_numpy(position_sets == name)]}
    logger.info("held-out top-1 per head and prompt set: %s", {name: a["top1"] for name, a in by_set.items()})
    # what `medusa_benchmark.tree: auto` picks from: every path's held-out acceptance, measured jointly
    paths = [{"path": list(path), "acceptance": frequency}
             for path, frequency in likeliest_paths(found, ranks, TREE_PATHS)]

    out = _medusa_dir(cfg) / "supervised"
    if accelerator.is_main_process:
        with atomic_path(out) as tmp:
            heads.save(tmp)
            write_json({"held_out": accuracy, "held_out_by_prompt_set": by_set, "path_acceptance": paths,
                        "num_train_positions": len(train.hidden), "num_eval_positions": len(held_out.hidden)},
                       tmp / "evaluation.json")
            (tmp / "history.json").write_text(json.dumps(history) + "\n")
            steps = list(range(1, len(history["loss"]) + 1))
            line_plot({f"head {k + 1}": (steps, history[f"ce_head{k + 1}"]) for k in range(m.num_heads)},
                      "Medusa-1 training: cross-entropy per head", "step", "cross-entropy", tmp / "loss.png")
    accelerator.wait_for_everyone()
    metrics = {"num_responses": len(train_rows) + len(eval_rows),
               # responses longer than medusa.max_length: dropped whole, never truncated (models/common/sequences.py)
               "num_responses_dropped_too_long": too_long_responses(_cache_dir(cfg)),
               "num_train_positions": len(train.hidden),
               "num_eval_positions": len(held_out.hidden), "frozen_pass_seconds": pass_seconds,
               "train_seconds": train_seconds, "final_loss": history["loss"][-1],
               "weights_changed": history["weights_changed"][0],
               **_accuracy_metrics("", accuracy),
               **{key: value for name, a in by_set.items() for key, value in _accuracy_metrics(f"{name}_", a).items()},
               "wall_seconds": time.perf_counter() - started}
    curves = {key: history[key] for key in curve_keys}
    return StageResult(metrics=metrics, curves=curves, models={"medusa-heads": out})


def _cache_dir(cfg: Config) -> Path:
    """``train_medusa``'s frozen-pass cache (:func:`models.medusa.training.self_distill`)."""
    return _medusa_dir(cfg) / "distilled"


def _frozen_pass(cfg: Config, policy, folder: Path) -> None:
    """The frozen pass over the ``distill`` stage's responses, written to ``folder``."""
    responses = shared_distilled_responses(cfg, "train_medusa", further=True)
    stage_logger().info("self-distillation pass over %d responses", len(responses))
    with atomic_path(folder) as tmp:
        self_distill(policy, responses, cfg.medusa, tmp)


def load_distilled(cfg: Config):
    """The ``train_medusa`` stage's frozen-pass cache (hidden states memory-mapped) and the ``distill`` stage's train
    / held-out sample split."""
    path = distilled_dir(cfg) / DISTILLED_SPLIT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the distill stage first")
    split = load_file(path)
    return load_cache(_cache_dir(cfg)), split["train_samples"], split["eval_samples"]


@gpu_task("train-rlmedusa")
def train_rlmedusa_task(cfg: Config) -> StageResult:
    """Draw the trajectory states' candidates, fit r(e, h), train head 1 by REINFORCE, compare it with the
    supervised head 1 at t + 2.

    Writes ``rl/``: per ``rlmedusa.inits`` entry a folder of heads to decode with (the supervised heads
    with head 1 replaced), the reward model, ``evaluation.json`` (held-out accuracy of every head, and of
    head 1 at t + 2 for supervised, each RL head and its start), ``history.json`` and ``rl.png``.
    """
    logger = stage_logger()
    started = time.perf_counter()
    r = cfg.rlmedusa
    data, train_rows, eval_rows = load_distilled(cfg)
    # the responses to further task prompts are for the supervised heads alone (here they would nearly triple the
    # stage's time)
    shared = torch.from_numpy(shared_distilled_responses(cfg, "train_rlmedusa").index.to_numpy(copy=True))
    train_rows, eval_rows = train_rows[torch.isin(train_rows, shared)], eval_rows[torch.isin(eval_rows, shared)]
    held_out = data.subset(eval_rows)
    policy = load_stage_policy(cfg, "base", training=True)
    lm_head = policy.model.get_output_embeddings()
    embedding = policy.model.get_input_embeddings()
    # the LM head over the pass's states, under the pass's autocast: the pass's own logits
    trajectories = trajectory_candidates(data, lm_head, r, r.seed, cfg.medusa.mixed_precision, shared)
    train, held_out_states = trajectories.subset(train_rows), trajectories.subset(eval_rows)
    if len(train.rows) == 0:
        raise ValueError("no RL trajectory states: every training response is shorter than 3 tokens")
    supervised = MedusaHeads.load(_medusa_dir(cfg) / "supervised", lm_head)

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embedding(tokens.to(embedding.weight.device))

    accelerator = stage_accelerator(policy.device, gradient_accumulation_steps=r.gradient_accumulation_steps)
    logger.info("fitting r(e, h) on %d states × %d candidates", len(train.rows), train.candidates.shape[1])
    with live_curves(cfg, {"loss": "reward_model.loss"}.get):
        reward_model, reward_losses = fit_reward_model(train.states(data), embed, train.candidates, train.probs, r,
                                                       accelerator)
    reward_eval = evaluate_reward_model(reward_model, held_out_states.states(data), embed,
                                        held_out_states.candidates, held_out_states.probs)
    logger.info("reward model held-out: %s", json.dumps(reward_eval))

    def on_step(step: int, num_steps: int, stats: dict[str, float]) -> None:
        if step % max(1, num_steps // 10) == 0 or step == num_steps:
            logger.info("RL step %d/%d: reward %.4f, KL %.4f", step, num_steps, stats["reward"], stats["kl"])

    accuracy = {"supervised": evaluate_heads(supervised, lm_head, held_out, cfg.medusa.eval_top_k)}
    histories = {"reward_model_loss": reward_losses}
    rl_heads = {}
    for init in r.inits:
        start = supervised if init == "supervised" else supervised.with_fresh_head(0, lm_head)
        logger.info("REINFORCE on head 1 from the %s start", init)
        with live_curves(cfg, {key: f"rl_{init}.{key}" for key in RL_CURVES}.get):
            rl_heads[init], histories[init] = train_rl_head(start, lm_head, reward_model, embed, train.states(data),
                                                            r, accelerator, on_step)
        accuracy[f"rl_{init}"] = evaluate_heads(rl_heads[init], lm_head, held_out, cfg.medusa.eval_top_k)
        accuracy[f"start_{init}"] = (accuracy["supervised"] if start is supervised
                                     else evaluate_heads(start, lm_head, held_out, cfg.medusa.eval_top_k))
    # head 1 predicts t + 2: its accuracies are the first entry of each list
    t2 = {name: {metric: values[0] for metric, values in a.items() if metric != "rank_accuracy"}
          for name, a in accuracy.items()}
    # intervals over held-out responses: each head's t + 2 top-1, and each RL head's gain over the supervised head
    heads_by_name = {"supervised": supervised, **{f"rl_{init}": heads for init, heads in rl_heads.items()}}
    hits = {name: _t2_hits_by_response(heads, lm_head, held_out) for name, heads in heads_by_name.items()}
    targets = _t2_targets_by_response(held_out)
    t2_intervals = {name: statistics.interval_columns(f"{name}_t2_top1", statistics.ratio_of_sums(h, targets))
                    for name, h in hits.items()}
    gains = {init: statistics.interval_columns(f"rl_{init}_t2_top1_gain", statistics.paired_ratio_difference(
        hits[f"rl_{init}"], hits["supervised"], targets), reference=0.0) for init in rl_heads}
    winner = max((name for name in t2 if not name.startswith("start_")), key=lambda name: t2[name]["top1"])
    logger.info("held-out accuracy at t+2: %s; best top-1: %s", json.dumps(t2), winner)
    out = _medusa_dir(cfg) / "rl"
    if accelerator.is_main_process:
        with atomic_path(out) as tmp:
            tmp.mkdir(parents=True)
            for init, heads in rl_heads.items():
                heads.save(tmp / init)
            save_file({k: v.detach().contiguous().cpu() for k, v in reward_model.state_dict().items()},
                      tmp / "reward_model.safetensors")
            write_json({"t_plus_2": t2, "all_heads": accuracy, "reward_model": reward_eval, "top1_winner": winner},
                       tmp / "evaluation.json")
            (tmp / "history.json").write_text(json.dumps(histories) + "\n")
            # reward and KL differ in units: one panel each
            line_panels({what: {f"start {init}": (list(range(1, len(histories[init][key]) + 1)), histories[init][key])
                                for init in r.inits}
                         for what, key in (("mean r(e, h) of sampled tokens", "reward"), ("KL to start", "kl"))},
                        "RLMedusa: head 1 policy gradient", "step", tmp / "rl.png")
    accelerator.wait_for_everyone()
    metrics = {"num_trajectory_states": len(train.rows), "reward_model_mse": reward_eval["mse"],
               "reward_model_top1_ranked_first": reward_eval["top1_ranked_first"],
               **{f"rl_{init}_final_reward": histories[init]["reward"][-1] for init in r.inits},
               **{f"rl_{init}_final_kl": histories[init]["kl"][-1] for init in r.inits},
               **{f"rl_{init}_weights_changed": histories[init]["weights_changed"][0] for init in r.inits},
               **{f"{name}_t2_{metric}": value for name, d in t2.items() for metric, value in d.items()},
               **{key: value for columns in (*t2_intervals.values(), *gains.values()) for key, value in columns.items()},
               "rl_beats_supervised_top1": float(winner != "supervised"), "wall_seconds": time.perf_counter() - started}
    curves = {"reward_model.loss": reward_losses,
              **{f"rl_{init}.{key}": histories[init][key] for init in r.inits for key in RL_CURVES}}
    return StageResult(metrics=metrics, curves=curves, artifacts={"medusa_rl": out})


def _t2_hits_by_response(heads, lm_head, held_out) -> list[float]:
    """Per held-out response: the positions where head 1's top-1 token is the t + 2 target."""
    found = target_ranks(heads, lm_head, held_out, ranks=1)[:, 0]  # (M,): 0 where the top-1 token is the target
    return _by_response(held_out, (found == 0).float())


def _t2_targets_by_response(held_out) -> list[float]:
    """Per held-out response: the positions with a t + 2 target."""
    return _by_response(held_out, (held_out.targets[:, 0] != IGNORE_INDEX).float())


def _by_response(held_out, values: torch.Tensor) -> list[float]:
    """Per-position ``values`` (M,) summed per response (the unit intervals resample: a response's tokens are not
    independent)."""
    _, response = torch.unique(held_out.sample, return_inverse=True)
    return torch.bincount(response, weights=values).tolist()
