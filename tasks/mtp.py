"""Prefect tasks of the MTP-RL stages: the MTP-equipped stage, then GRPO with MTP-drafted rollouts.

Thin wrappers around :mod:`models.mtp.training` and :mod:`models.mtp.rl`:

* ``train_mtp`` — self-distilled data (the policy's own greedy responses, as the ``distill`` stage wrote them),
  split by prompt; the main model's states computed once; a K-depth shared MTP module trained with eq. 1's
  weighted CE; held-out per-depth accuracy and expected acceptance length, with 95 % intervals over held-out
  responses; the same for every K of the depth ablation (Table 2).
* ``train_mtp_rl`` — each configured variant (vanilla GRPO, MTP-RL, frozen MTP, CE only, no backprop) from
  the same policy and module, on the same prompts and sampling seeds — by default the training prompts whose
  label-stage samples did not all score alike — rewarded by the configured labeler (``label``: the verifiable
  answer check on prompts with answers, or a reward model such as ArmoRM on any prompts): per step τ, acceptance
  rate, tokens per target forward, rollout time, mean reward and the share of groups with mixed rewards; the
  labeler's mean score of the held-out greedy responses before and after (and their accuracy where every held-out
  prompt has an answer), with intervals over prompts and the change's significance; τ (over the whole run and
  its first and last steps), α, tokens per target forward and the rollout speedup over vanilla with intervals
  over rollout batches (:mod:`foresight.statistics`).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from foresight import statistics
from foresight.benchmark import CURVE_METRICS, batch_speed_curve, curve_bars, display_rows, markdown_table
from foresight.plots import bar_panels, bar_plot, interval_bar, line_panels, line_plot
from foresight.storage import atomic_path, read_table, write_json, write_table
from models.common.lora import trained_weight_names
from models.common.sequences import fitting_sft
from models.common.training import check_update, weight_changes
from models.engine.batched import BatchGreedy, batched_speculative_generate
from models.engine.decoding import GREEDY, hf_decode
from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
from models.labeling.answers import cut_by_length, is_correct
from models.labeling.labelers import build_labeler
from models.mtp.dynamic_tree import CALIBRATION_COLUMNS, DEPTH_COLUMNS, MTPBatchTreeDrafter, resolved_tree
from models.mtp.module import MTPBatchDrafter, MTPModule, MTPModuleConfig, draft_parts, frequent_tokens
from models.mtp.rl import (
    rollout_drafting,
    rollout_generator,
    sample_plainly,
    sample_speculatively,
    train_variant,
    variant,
)
from models.mtp.training import ChainAcceptance, chain_acceptance, depth_weights, frozen_states, train_mtp_module
from tasks.common import (
    StageResult,
    gpu_task,
    live_curves,
    load_stage_policy,
    markdown_artifact,
    progress_artifact,
    read_prompts,
    reference_answers,
    stage_accelerator,
    stage_logger,
    table_artifact,
)
from tasks.distilled import drafter_split, sampled_responses, sft_responses, validation_split

if TYPE_CHECKING:
    from foresight.config import Config


@contextlib.contextmanager
def _shared_scratch(accelerator, prefix: str) -> Iterator[Path]:
    """A scratch folder that every process of the stage sees (the main process makes it and names it to the
    others; on one machine they share its temporary directory), removed once all are done with it."""
    name = [tempfile.mkdtemp(prefix=prefix) if accelerator.is_main_process else None]
    broadcast_object_list(name)
    try:
        yield Path(name[0])
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(name[0], ignore_errors=True)


@gpu_task("train-mtp")
def train_mtp_task(cfg: Config) -> StageResult:
    """Equip the frozen base policy with a K-depth shared MTP module; run the depth ablation. Runs in every
    process of ``accelerate launch`` (batches split between them); the main process writes the outputs."""
    logger = stage_logger()
    started = time.perf_counter()
    m = cfg.mtp
    policy = load_stage_policy(cfg, "base", training=True)
    policy.model.requires_grad_(False).eval()
    accelerator = stage_accelerator(policy.device, m.mixed_precision, m.gradient_accumulation_steps)
    # rows too long for mtp.max_length are dropped whole, never truncated (models/common/sequences.py)
    responses = sft_responses(cfg, m.data, "mtp.data", further=m.further_prompts)
    if m.samples_per_prompt:
        responses = pd.concat([responses, sampled_responses(cfg, m.samples_per_prompt, "mtp.samples_per_prompt")],
                              ignore_index=True)
    responses, sequences, too_long = fitting_sft(policy.tokenizer, responses, m.max_length, "mtp.max_length")
    if too_long:
        logger.warning("dropped %d responses longer than mtp.max_length %d tokens", too_long, m.max_length)
    train_rows, eval_rows = drafter_split(cfg, responses, m.eval_fraction, m.seed)
    fit_rows, validation_rows = validation_split(responses, train_rows, m.validation_fraction, m.seed)
    depths = [m.num_depths, *sorted(set(m.ablation_depths) - {m.num_depths})]
    modules, histories, evaluations, acceptance, seconds = {}, {}, {}, {}, {}
    # per prompt set (task text, general instructions): the same held-out sequences Medusa's heads are scored on
    sets = responses["prompt_set"].to_numpy()[eval_rows.numpy()] if "prompt_set" in responses else None
    # the frozen policy's states, on disk in its dtype: at 8B they would not fit in RAM
    with _shared_scratch(accelerator, "mtp-states-") as scratch:
        hidden = frozen_states(policy, sequences, scratch, accelerator=accelerator)
        train = ([sequences[i] for i in fit_rows], hidden.select(fit_rows))
        validation = ([sequences[i] for i in validation_rows], hidden.select(validation_rows))
        held_out = ([sequences[i] for i in eval_rows], hidden.select(eval_rows))
        logger.info("MTP self-distilled data (%s): %d training / %d validation (early stopping) / %d held-out "
                    "sequences", m.data, len(train[0]), len(validation[0]), len(held_out[0]))
        draft_vocab = _draft_vocab(train[0], m.draft_vocab_size, policy)
        for num_depths in depths:
            def on_step(step: int, num_steps: int, stats: dict[str, float], k: int = num_depths) -> None:
                if step % max(1, num_steps // 4) == 0 or step == num_steps:
                    logger.info("K = %d, step %d/%d: loss %.4f", k, step, num_steps, stats["loss"])

            depth_started = time.perf_counter()
            # the stage's curves are the main module's per-step history (the ablation's modules: history.json)
            with live_curves(cfg, (lambda key: key) if num_depths == m.num_depths else (lambda key: None)):
                modules[num_depths], histories[num_depths] = train_mtp_module(policy, *train, num_depths, m,
                                                                              accelerator, on_step, validation,
                                                                              draft_vocab)
            seconds[num_depths] = time.perf_counter() - depth_started
            acceptance[num_depths] = chain_acceptance(policy, modules[num_depths], *held_out)
            evaluations[num_depths] = _chain_evaluation(acceptance[num_depths])
            accelerator.free_memory()
            logger.info("K = %d: held-out %s", num_depths, json.dumps(evaluations[num_depths]))
        data_curve = _data_curve(policy, sequences, hidden, fit_rows, validation, held_out, sets, m, accelerator,
                                 acceptance[m.num_depths])

    ablation = pd.DataFrame([{"num_depths": k, "main": k == m.num_depths, **evaluations[k],
                              "train_seconds": seconds[k]} for k in sorted(depths)])
    ablation_columns = ["num_depths", "main", *(f"top1_depth_{k}" for k in range(1, max(depths) + 1)),
                        "expected_tau", "expected_acceptance_rate", "positions", "train_seconds"]
    out = cfg.path(cfg.paths.mtp_dir)
    if accelerator.is_main_process:  # every process holds the same module; one writes it
        _write_mtp(out, modules[m.num_depths], evaluations, histories, ablation, policy, m, len(train[0]),
                   len(held_out[0]), data_curve)
        table_artifact(key="mtp-depth-ablation", table=display_rows(ablation.to_dict("records"), ablation_columns),
                       description="Expected initial acceptance length per number of shared MTP depths (95 % "
                                   "intervals over held-out responses)")
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    by_set = ({name: _chain_evaluation(_responses_of(acceptance[m.num_depths], torch.from_numpy(sets == name)))
               for name in sorted(set(sets))} if sets is not None else {})
    history = histories[m.num_depths]
    metrics = {"num_train_sequences": len(train[0]), "num_validation_sequences": len(validation[0]),
               "num_eval_sequences": len(held_out[0]), "num_sequences_dropped_too_long": too_long,
               "final_loss": history["loss"][-1],
               "optimizer_steps": len(history["loss"]), "best_epoch": history["best_epoch"][0],
               "weights_changed": history["weights_changed"][0],
               "epochs_run": len(history["held_out_loss"]), "best_validation_loss": min(history["held_out_loss"]),
               **{f"held_out_{key}": value for key, value in evaluations[m.num_depths].items()},
               **{f"held_out_{name}_{key}": value for name, evaluation in by_set.items()
                  for key, value in evaluation.items()},
               **{f"ablation_k{k}_expected_tau{end}": evaluations[k][f"expected_tau{end}"] for k in depths
                  for end in ("", "_low", "_high")},
               **{f"data_curve_{row['train_responses']}_{key}": value for row in data_curve.to_dict("records")
                  for key, value in row.items() if key != "train_responses" and not key.endswith(("_low", "_high"))},
               "wall_seconds": time.perf_counter() - started}
    curves = {key: values for key, values in history.items()
              if key not in ("held_out_loss", "best_epoch", "weights_changed")}
    tables = {"mtp_ablation": out / "ablation.csv"} | (
        {"mtp_data_curve": out / DATA_CURVE_FILE} if len(data_curve) else {})
    return StageResult(metrics=metrics, curves=curves, tables=tables, artifacts={"mtp": out},
                       models={"mtp-module": out / "module"})


DATA_CURVE_FILE = "data_curve.csv"
"""In ``${paths.mtp_dir}``, with ``mtp.data_curve``: held-out acceptance per number of training responses."""
DATA_CURVE_KEYS = ("expected_tau", "top1_depth_1")
"""What a data curve's point records of each held-out prompt set's evaluation (:func:`_chain_evaluation`)."""


def data_curve_rows(rows: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """The first ``count`` of the training ``rows`` in a shuffle seeded with ``seed``, sorted: a data curve's
    training responses, task and general mixed as in the whole set, and each count's a subset of every larger one."""
    if count > len(rows):
        raise ValueError(f"mtp.data_curve asks for {count} training responses; the training split holds {len(rows)}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return rows[order[:count].sort().values]


def _data_curve(policy, sequences, hidden, fit_rows: torch.Tensor, validation, held_out, sets, m, accelerator,
                main_acceptance) -> pd.DataFrame:
    """``mtp.data_curve``: for each count n, a module trained as the main one (same knobs, validation responses and
    early stopping) on n of its training responses (:func:`data_curve_rows`), evaluated on the same held-out
    responses; then the main module's point (every training response). One row per n: ``train_responses`` and
    :data:`DATA_CURVE_KEYS` with their intervals, over all held-out responses and per prompt set (``<set>_…``).
    Empty without counts."""
    if not m.data_curve:
        return pd.DataFrame()
    points = []
    for count in sorted(m.data_curve):
        rows = data_curve_rows(fit_rows, count, m.seed).tolist()
        subset = [sequences[i] for i in rows]
        module, _ = train_mtp_module(policy, subset, hidden.select(rows), m.num_depths, m, accelerator, None,
                                     validation, _draft_vocab(subset, m.draft_vocab_size, policy))
        points.append((count, chain_acceptance(policy, module, *held_out)))
        accelerator.free_memory()
    points.append((len(fit_rows), main_acceptance))
    table = []
    for count, acceptance in points:
        evaluations = {"all": _chain_evaluation(acceptance)} | (
            {name: _chain_evaluation(_responses_of(acceptance, torch.from_numpy(sets == name)))
             for name in sorted(set(sets))} if sets is not None else {})
        table.append({"train_responses": count, **{f"{name}_{key}{end}": evaluation[f"{key}{end}"]
                                                   for name, evaluation in evaluations.items()
                                                   for key in DATA_CURVE_KEYS for end in ("", "_low", "_high")}})
        stage_logger().info("data curve, %d training responses: %s", count, json.dumps(table[-1]))
    return pd.DataFrame(table)


def _write_data_curve(data_curve: pd.DataFrame, folder: Path) -> None:
    """:data:`DATA_CURVE_FILE` and its plot, ``data_curve.png``: held-out expected τ and depth-1 top-1 against the
    number of training responses, one line per held-out prompt set."""
    write_table(data_curve, folder / DATA_CURVE_FILE)
    counts = data_curve["train_responses"].tolist()
    names = [column.removesuffix("_expected_tau") for column in data_curve.columns
             if column.endswith("_expected_tau")]
    panels, bands = {}, {}
    for key, label in (("expected_tau", "expected τ"), ("top1_depth_1", "depth-1 top-1")):
        panels[label] = {f"{name} ({label})": (counts, data_curve[f"{name}_{key}"].tolist()) for name in names}
        bands |= {f"{name} ({label})": (data_curve[f"{name}_{key}_low"].tolist(),
                                        data_curve[f"{name}_{key}_high"].tolist()) for name in names}
    line_panels(panels, "MTP module: held-out acceptance against training responses", "training responses",
                folder / "data_curve.png", bands)


def _responses_of(acceptance, mask: torch.Tensor):
    """The counts of the held-out responses ``mask`` selects (:class:`models.mtp.training.ChainAcceptance`)."""
    return ChainAcceptance(acceptance.hits[mask], acceptance.targets[mask], acceptance.accepted[mask],
                           acceptance.positions[mask])


def _chain_evaluation(acceptance) -> dict:
    """The held-out evaluation of a module from its per-response counts (:class:`models.mtp.training.ChainAcceptance`):
    top-1 accuracy per depth (Σ hits / Σ targets), the greedy chain's expected τ (1 + Σ accepted / Σ positions) and
    α = (τ − 1) / K, each with its 95 % interval over held-out responses; ``positions``, ``responses``: the counts."""
    num_depths = acceptance.hits.shape[1]
    evaluation = {}
    for k in range(num_depths):
        evaluation |= statistics.interval_columns(f"top1_depth_{k + 1}", statistics.ratio_of_sums(
            acceptance.hits[:, k].tolist(), acceptance.targets[:, k].tolist()))
    tau = statistics.ratio_of_sums((acceptance.accepted + acceptance.positions).tolist(), acceptance.positions.tolist())
    alpha = statistics.Interval(*((x - 1) / num_depths for x in (tau.value, tau.low, tau.high)), tau.n)
    return {**evaluation, **statistics.interval_columns("expected_tau", tau),
            **statistics.interval_columns("expected_acceptance_rate", alpha),
            "positions": int(acceptance.positions.sum()), "responses": len(acceptance.positions)}


def _draft_vocab(sequences, size: int | None, policy) -> torch.Tensor | None:
    """``mtp.draft_vocab_size``: the most frequent tokens of the training responses (their response positions)."""
    if size is None:
        return None
    responses = [[token for token, counted in zip(ids, mask, strict=True) if counted] for ids, mask in sequences]
    return frequent_tokens(responses, size, len(policy.model.get_output_embeddings().weight))


def _write_mtp(out: Path, module, evaluations: dict, histories: dict, ablation: pd.DataFrame, policy, m,
               num_train: int, num_eval: int, data_curve: pd.DataFrame) -> None:
    """The equip stage's folder: the module (and its draft vocabulary), its held-out evaluation, the histories, the
    ablation, the data curve (with ``mtp.data_curve``) and plots."""
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        module.save(tmp / "module")
        write_json({"held_out": evaluations[m.num_depths], "num_train_sequences": num_train,
                    "num_eval_sequences": num_eval, "data": m.data,
                    "parameters": sum(p.numel() for p in module.parameters()),
                    "policy_parameters": sum(p.numel() for p in policy.model.parameters())}, tmp / "evaluation.json")
        (tmp / "history.json").write_text(json.dumps({str(k): h for k, h in histories.items()}) + "\n")
        write_table(ablation, tmp / "ablation.csv")
        history = histories[m.num_depths]
        line_plot({f"depth {k} (t + {k + 1})": (list(range(1, len(history["loss"]) + 1)), history[f"ce_depth_{k}"])
                   for k in range(1, m.num_depths + 1)},
                  f"MTP equip (K = {m.num_depths}): cross-entropy per depth", "step", "cross-entropy", tmp / "loss.png")
        bar_plot({"expected τ (greedy chain)": {f"K = {row['num_depths']}": interval_bar(row, "expected_tau")
                                                for row in ablation.to_dict("records")}},
                 "MTP depth ablation: expected initial acceptance length (1 = no drafts)", "τ", tmp / "ablation.png",
                 reference_line=1.0)
        if len(data_curve):
            _write_data_curve(data_curve, tmp)


ROLLOUT_COLUMNS = ["variant", "steps", "nonzero_advantage_share", "tau_window", "tau_start", "tau_end",
                   "tau_end_over_start", "tau_end_vs_frozen_mtp", "tau_pooled", "acceptance_rate_pooled",
                   "tokens_per_forward", "total_rollout_seconds", "rollout_speedup", "rollout_tokens_per_s",
                   "ms_per_cycle", "break_even_tau", "reward_mean"]
JUDGED = ("reward", "accuracy")  # what the held-out greedy responses are judged by
HELD_OUT_COLUMNS = [f"{key}_{when}" for key in JUDGED for when in ("before", "after", "change")]
SUMMARY_COLUMNS = ROLLOUT_COLUMNS + HELD_OUT_COLUMNS
CURVE_COLUMNS = ["batch", "decoder", "speedup_vs_reference", "tokens_per_s", "tokens_per_forward",
                 "slowest_row_tokens_per_forward", "plain_share", "identical_to_reference", "batches"]
INTERVAL_ENDS = ("", "_low", "_high")  # a figure's columns with its interval
RL_CURVES = ("tau", "acceptance_rate", "tokens_per_forward", "rollout_seconds", "reward_seconds", "reward",
             "nonzero_advantage_share")
"""The per-step curves of each GRPO variant (``<variant>.per_step.<key>``), keys of its step record."""


def _held_out(policy, labeler, prompt_ids: list[list[int]], questions: list[str], answers: list[str | None],
              max_new_tokens: int, batch_size: int) -> dict[str, list[float]]:
    """The policy's greedy responses to the held-out prompts (HF greedy, ``batch_size`` prompts at a time), judged
    per prompt: ``reward``, the labeler's score; ``accuracy``, 1 for a right final answer and 0 for a wrong one,
    only when every prompt has a reference answer (for the verifiable labeler the two are equal)."""
    eos = end_token_ids(policy)
    outputs = hf_decode(policy, prompt_ids, GREEDY, max_new_tokens, eos, batch_size=batch_size)
    responses = [policy.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    cut = [cut_by_length(o, eos, max_new_tokens) for o in outputs]  # credited only for a marked answer
    scores = labeler.score(questions, responses, answers, truncated=cut)
    judged = {"reward": [float(score) for score in scores]}
    correct = [is_correct(r, a, c) for r, a, c in zip(responses, answers, cut, strict=True)]
    if all(c is not None for c in correct):
        judged["accuracy"] = [float(c) for c in correct]
    return judged


def _judged_text(judged: dict[str, list[float]]) -> str:
    """``reward 0.5 [0.3, 0.7], accuracy …``: the means with their intervals, for the log."""
    return ", ".join(f"{key} {statistics.mean_interval(values)}" for key, values in judged.items())


def _rl_prompts(cfg: Config, split: str) -> pd.DataFrame:
    """The split's prompts the configured labeler can reward: with ``verifiable`` those with a known answer (an
    error when none has one), with a reward model every prompt."""
    table = read_prompts(cfg, split)
    if cfg.label.labeler != "verifiable":
        return table
    table = table[table["answer"].notna()].reset_index(drop=True)
    if table.empty:
        raise ValueError(f"no {split} prompt has a known answer: GRPO's verifiable reward (label.labeler: "
                         "verifiable) needs them (prompts.source: arithmetic, or a source with an answer column); "
                         "a reward model (label.labeler: armorm or hf-classifier) scores prompts without answers")
    return table


def _spread_prompts(prompts: pd.DataFrame, scores: pd.DataFrame) -> pd.DataFrame:
    """The ``prompts`` whose label-stage samples (``scores``: one row per sample, ``prompt_id`` and ``score``) did not
    all score alike — for the verifiable labeler (score = correct) a pass rate strictly between 0 and 1 — so that a
    group of their rollouts can carry a gradient. A prompt without scored samples is left out."""
    ranges = scores.groupby("prompt_id")["score"].agg(["min", "max"])  # (prompts scored, 2)
    spread = ranges.index[ranges["max"] > ranges["min"]]
    return prompts[prompts["prompt_id"].isin(spread)].reset_index(drop=True)


def _training_prompts(cfg: Config) -> tuple[pd.DataFrame, int, int]:
    """The prompts of GRPO's steps: the rewardable training prompts that ``mtp_rl.prompt_filter`` keeps, shuffled by
    the seed and cut to the steps' need; and how many it kept and dropped. Too few kept: an error naming the
    filter."""
    r = cfg.mtp_rl
    rewardable = _rl_prompts(cfg, "train")
    kept = (_spread_prompts(rewardable, read_table(cfg.path(cfg.paths.scores), "label-stage scores"))
            if r.prompt_filter == "spread" else rewardable)
    needed = r.steps * r.prompts_per_step
    if len(kept) < needed:
        raise ValueError(f"mtp_rl.prompt_filter {r.prompt_filter}: {len(kept)} of {len(rewardable)} training prompts "
                         f"qualify, {r.steps} steps × {r.prompts_per_step} prompts need {needed}" +
                         (" (spread: prompts whose label-stage samples did not all score alike; raise "
                          "prompts.num_train or generate.num_samples, or set mtp_rl.prompt_filter: all)"
                          if r.prompt_filter == "spread" else ""))
    shuffled = kept.sample(frac=1.0, random_state=r.seed).reset_index(drop=True)
    return shuffled.head(needed), len(kept), len(rewardable) - len(kept)


def _scorer(label) -> str:
    """Which labeler scored, in words."""
    return "the verifiable answer check" if label.labeler == "verifiable" else f"{label.labeler} `{label.model}`"


@gpu_task("train-mtp-rl")
def train_mtp_rl_task(cfg: Config) -> StageResult:
    """GRPO per variant with (or without) MTP-drafted rollouts, rewarded by the configured labeler; τ, rollout
    time, reward, held-out reward (and accuracy). Runs in every process of ``accelerate launch`` (each rolls out and
    scores its share of a step's prompts); the main process writes."""
    logger = stage_logger()
    started = time.perf_counter()
    r = cfg.mtp_rl
    module_dir = cfg.path(cfg.paths.mtp_dir) / "module"
    # K is the saved module's (the one source of truth); reading it fails early, naming the missing stage
    num_depths = MTPModuleConfig.read(module_dir).num_depths
    train_prompts, kept, dropped = _training_prompts(cfg)
    logger.info("mtp_rl.prompt_filter %s: %d training prompts kept, %d dropped; the steps use %d", r.prompt_filter,
                kept, dropped, len(train_prompts))
    eval_prompts = _rl_prompts(cfg, "eval").head(r.eval_prompts)
    # The policy in its decoding dtype (bf16 on a CPU with bf16 units, as on a GPU), not float32 as the other
    # training stages load it on a CPU: most of GRPO's time is sampling, which runs in that dtype as an inference
    # engine's would, and the updates keep float32 master weights (models.mtp.rl)
    policy = load_stage_policy(cfg, "base")
    accelerator = stage_accelerator(policy.device, r.mixed_precision)
    # loaded once for every variant, beside the policy on its device (under a launch, each process's own GPU)
    labeler = build_labeler(cfg.label.model_copy(update={"device": cfg.policy.device}))
    eos = end_token_ids(policy)
    system = cfg.prompts.system_prompt
    rl_ids = [encode_prompt(policy, p)
              for p in chat_prompts(policy.tokenizer, train_prompts["question"].tolist(), system)]
    eval_ids = [encode_prompt(policy, p)[0].tolist()
                for p in chat_prompts(policy.tokenizer, eval_prompts["question"].tolist(), system)]
    eval_set = (eval_ids, eval_prompts["question"].tolist(), reference_answers(eval_prompts), r.max_new_tokens,
                r.eval_batch_size)
    before = _held_out(policy, labeler, *eval_set)
    logger.info("held-out greedy responses before RL, scored by %s: %s on %d prompts", _scorer(cfg.label),
                _judged_text(before), len(eval_ids))
    tree_metrics = {}
    if r.dynamic_tree is not None and r.dynamic_tree.budget == "auto":  # resolved once, for every variant
        # calibrated by greedy decoding of the training prompts: sampled rollouts accept less, so it may be wider
        # than their best
        parts = draft_parts(policy.model, MTPModule.load(module_dir, policy.model).eval(),
                            getattr(torch, r.draft_dtype))
        dynamic, calibration = resolved_tree(policy.model, *parts, r.dynamic_tree, rl_ids, r.max_new_tokens, eos)
        logger.info("mtp_rl.dynamic_tree: %d nodes, depth %d, calibrated on %d training prompts:\n%s\n%s",
                    dynamic.budget, dynamic.depth, min(len(rl_ids), r.dynamic_tree.calibration_prompts),
                    markdown_table(calibration.depth_rows(), DEPTH_COLUMNS),
                    markdown_table(calibration.rows(), CALIBRATION_COLUMNS))
        tree_metrics = {"dynamic_tree.budget": dynamic.budget, "dynamic_tree.depth": dynamic.depth,
                        "dynamic_tree.budget_expected_speedup": calibration.expected_speedup(dynamic.budget)}
        r = r.model_copy(update={"dynamic_tree": dynamic})
        cfg = cfg.model_copy(update={"mtp_rl": r})
    weights = depth_weights(cfg.mtp.ce_weights, num_depths)
    curves_by_batch = {}
    if r.curve_batch_sizes and accelerator.is_main_process:
        curves_by_batch = _mtp_curves(cfg, policy, MTPModule.load(module_dir, policy.model),
                                      [ids[0].tolist() for ids in rl_ids], eval_ids, eos)
        for curve_name, curve_rows in curves_by_batch.items():
            logger.info("MTP %s speed against batch size:\n%s", curve_name, markdown_table(curve_rows, CURVE_COLUMNS))
    accelerator.wait_for_everyone()

    # this process's rollouts (each rolls out its share of every step's prompts)
    total_rollouts = len(r.variants) * r.steps * r.prompts_per_step * r.group_size // accelerator.num_processes
    main = accelerator.is_main_process
    progress = progress_artifact(key="mtp-rl-progress", description="Rollouts sampled") if main else None
    bar = tqdm(total=total_rollouts, desc="MTP-RL rollouts", unit="rollout", disable=not main)

    def on_rollout() -> None:
        bar.update(1)
        if progress is not None:
            progress(100.0 * bar.n / total_rollouts)

    histories, after, changed = {}, {}, {}
    for name in r.variants:
        var = variant(name, r)
        policy = load_stage_policy(cfg, "base")
        initial, trained_names = Path(policy.model.name_or_path), []
        module = MTPModule.load(module_dir, policy.model) if var.drafts else None

        def on_step(step: int, record: dict, name: str = name) -> None:
            logger.info("%s step %d/%d: rollouts %.1f s, τ %.2f, α %.2f, reward %.2f, groups with mixed rewards "
                        "%.2f", name, step, r.steps, record["rollout_seconds"], record["tau"],
                        record["acceptance_rate"], record["reward"], record["nonzero_advantage_share"])

        with live_curves(cfg, {key: f"{name}.per_step.{key}" for key in RL_CURVES}.get):
            histories[name] = train_variant(policy, module, var, rl_ids, train_prompts["question"].tolist(),
                                            reference_answers(train_prompts), labeler.score, r, weights, eos,
                                            accelerator, on_step, on_rollout,
                                            on_trained=lambda model: trained_names.extend(trained_weight_names(model)))
        if main:  # nothing is saved: the weights evaluated below against their checkpoint files, tensor by tensor
            changed[f"{name}.weights_changed"] = check_update(
                weight_changes(policy.model.state_dict(), initial, trained_names), f"MTP-RL {name}: the policy",
                r.learning_rate, policy.model.dtype, logger)
            if var.trains_module:
                changed[f"{name}.module_weights_changed"] = check_update(
                    weight_changes(module.state_dict(), module_dir), f"MTP-RL {name}: the MTP module",
                    r.mtp_learning_rate, next(module.parameters()).dtype, logger)
        after[name] = _held_out(policy, labeler, *eval_set)
        logger.info("%s: held-out greedy responses after RL: %s", name, _judged_text(after[name]))
        accelerator.free_memory()
        del policy, module
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()
    del labeler  # the reward model's memory back before the outputs are written
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    rows = _summary(histories, {name: variant(name, r).drafts for name in histories}, before, after,
                    r.adaptive, r.tau_window)
    logger.info("\n%s", markdown_table(rows, SUMMARY_COLUMNS))
    out = cfg.path(cfg.paths.mtp_rl_dir)
    report = _report(rows, curves_by_batch, cfg, len(eval_ids), num_depths, kept, dropped)
    if main:  # every process holds the same histories (gathered per step); one writes them
        with atomic_path(out) as tmp:
            tmp.mkdir(parents=True)
            write_json({"labeler": cfg.label.labeler, "label_model": cfg.label.model, "variants": histories,
                        **{f"{key}_before": rows[0][f"{key}_before"] for key in before},
                        **{f"{key}_after": {row["variant"]: row[f"{key}_after"] for row in rows} for key in before},
                        "held_out_per_prompt": {"before": before, "after": after}},
                       tmp / "history.json")
            write_table(pd.DataFrame(rows), tmp / "table.csv")
            _plots(histories, rows, tmp, _scorer(cfg.label))
            for curve_name, curve_rows in curves_by_batch.items():
                write_table(pd.DataFrame(curve_rows), tmp / f"{curve_name}_curve.csv")
            if curves_by_batch:  # one group per batch size, a bar per curve
                groups: dict[str, dict] = {}
                for curve_name, curve_rows in curves_by_batch.items():
                    for group, bars in curve_bars(curve_rows, lambda row, name=curve_name: name).items():
                        groups.setdefault(group, {}).update(bars)
                bar_plot(groups, "MTP drafting over HF batched greedy (decoding) and sampling (rollout)",
                         "× HF tokens/s", tmp / "speed_curve.png", reference_line=1.0)
            (tmp / "report.md").write_text(report)
        table_artifact(key="mtp-rl-summary", table=display_rows(rows, SUMMARY_COLUMNS),
                       description="GRPO variants: acceptance length, rollout time, speedup, reward and held-out "
                                   f"reward by {_scorer(cfg.label)} (95 % intervals; * = differs significantly)")
        markdown_artifact(key="mtp-rl-report", markdown=report, description="MTP-RL report")
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    metrics = {f"{row['variant']}.{key}{end}": row[key + end] for row in rows for key in ROLLOUT_COLUMNS[1:]
               for end in INTERVAL_ENDS if key + end in row}
    # held-out accuracy only where every held-out prompt has an answer (its columns are NaN otherwise)
    metrics |= {f"{key}_before{end}": rows[0][f"{key}_before{end}"] for key in before for end in INTERVAL_ENDS}
    metrics |= {f"{row['variant']}.{key}_{when}{end}": row[f"{key}_{when}{end}"] for row in rows for key in before
                for when in ("after", "change") for end in INTERVAL_ENDS}
    metrics |= {f"{curve_name}_curve.{row['decoder']}.batch{row['batch']}.{column}": row[column]
                for curve_name, curve_rows in curves_by_batch.items() for row in curve_rows
                for key in CURVE_METRICS for column in (key, f"{key}_low", f"{key}_high") if column in row}
    metrics |= {"rl_prompts_kept": kept, "rl_prompts_dropped": dropped, **changed, **tree_metrics,
                "wall_seconds": time.perf_counter() - started}
    curves = {f"{name}.per_step.{key}": [record[key] for record in history] for name, history in histories.items()
              for key in RL_CURVES}
    return StageResult(metrics=metrics, curves=curves, tables={"mtp_rl_table": out / "table.csv"},
                       artifacts={"mtp_rl": out})


def _mtp_curves(cfg: Config, policy, module, train_prompts: list[list[int]], eval_prompts: list[list[int]],
                eos: set[int]) -> dict[str, list[dict]]:
    """MTP drafting's speed against batch size before RL (:func:`foresight.benchmark.batch_speed_curve`), with the
    starting policy and the equipped ``module`` (adaptive as ``mtp_rl.adaptive``, one decision state per batch size
    and curve), every decoder on the same batch in turn:

    - ``decoding``: the held-out prompts greedily — HF batched greedy against greedy-verified MTP drafting, the
      outputs compared row by row;
    - ``rollout``: the training prompts (cycled) at the rollout temperature — ``vanilla`` (HF batched sampling)
      against ``mtp`` (batched speculative sampling), the j-th batch of both from the same per-row seeded streams.
    """
    r = cfg.mtp_rl
    device = policy.model.get_output_embeddings().weight.device
    draft_base, draft_module = draft_parts(policy.model, module.eval(), getattr(torch, r.draft_dtype))
    states, calls = {}, {"vanilla": 0, "mtp": 0}

    def drafting(curve: str, batch: list[list[int]]):
        if (curve, len(batch)) not in states:
            states[curve, len(batch)] = rollout_drafting(r)
        return states[curve, len(batch)]

    def decode(decoder: str, batch: list[list[int]], max_new_tokens: int):
        if decoder == "greedy":
            return hf_decode(policy, batch, GREEDY, max_new_tokens, eos, batch_size=len(batch)), None
        drafter = (MTPBatchDrafter(draft_base, draft_module, 0.0) if r.dynamic_tree is None
                   else MTPBatchTreeDrafter(draft_base, draft_module, r.dynamic_tree, r.dynamic_tree.budget))
        return batched_speculative_generate(policy.model, drafter,
                                            BatchGreedy(), batch, max_new_tokens, eos, drafting("decoding", batch))

    def sample(decoder: str, batch: list[list[int]], max_new_tokens: int):
        call, calls[decoder] = calls[decoder], calls[decoder] + 1  # both decoders' j-th call: the same batch
        # streams apart from the RL steps' (whose step numbers are small)
        generators = [rollout_generator(r.seed, 1_000_000 + len(batch), call * len(batch) + row, device)
                      for row in range(len(batch))]
        if decoder == "vanilla":
            return sample_plainly(policy.model, batch, max_new_tokens, eos, r.temperature, generators[0]), None
        return sample_speculatively(policy.model, draft_base, draft_module, batch, max_new_tokens, eos, r.temperature,
                                    r.draft_temperature, generators, drafting("rollout", batch), r.dynamic_tree)

    return {"decoding": batch_speed_curve(["greedy", "mtp"], eval_prompts, decode, "greedy", r.curve_batch_sizes,
                                          r.curve_batches, r.max_new_tokens, "MTP greedy decoding curve"),
            "rollout": batch_speed_curve(["vanilla", "mtp"], train_prompts, sample, "vanilla", r.curve_batch_sizes,
                                          r.curve_batches, r.max_new_tokens, "MTP rollout curve",
                                          compare_outputs=False)}


def _summary(histories: dict[str, list[dict]], drafting: dict[str, bool], before: dict[str, list[float]],
             after: dict[str, dict[str, list[float]]], adaptive: bool, tau_window: int) -> list[dict]:
    """One row per variant, with 95 % intervals over its rollout batches (each step's ``rollouts``):
    ``nonzero_advantage_share``, the mean over steps of the share of groups with mixed rewards (an interval over
    steps); τ and α pooled over its draft cycles, and τ over the first and last ``tau_window`` steps (at most half
    of them: ``tau_start`` / ``tau_end``), ``tau_end_over_start`` their ratio (the windows' batches paired by
    place: independent draws, so this only keeps the resamples' sizes equal) and ``tau_end_vs_frozen_mtp`` the
    ratio of ``tau_end`` to the frozen module's, the batches paired by their place in the run (NaN without
    ``frozen_mtp``); 1 and 0 for a variant that does not draft; ``tokens_per_forward``: rollout tokens per policy
    forward of a row (1 for plain sampling; above 1 only through accepted drafts); ``rollout_speedup``, its
    tokens/s over vanilla's, the batches paired by their place in the run (the same prompts and sampling streams:
    the different samples of different policies, but of the same prompts), NaN without vanilla; then the held-out
    columns (:func:`_held_out_columns`). ``adaptive``: the drafting variants also took plain steps, which their
    rollout time includes and their cycle count does not, so a cycle's time (and the break-even τ) cannot be told
    from the totals: NaN."""
    def units(history: list[dict]) -> list[dict]:
        return [rollout for record in history for rollout in record["rollouts"]]

    def column(rollouts: list[dict], key: str) -> list[float]:
        return [rollout[key] for rollout in rollouts]

    def tau(rollouts: list[dict]) -> statistics.Interval:
        return statistics.ratio_of_sums(column(rollouts, "cycle_tokens"), column(rollouts, "cycles"))

    def tau_ratio(rollouts: list[dict], reference: list[dict]) -> statistics.Interval:
        return statistics.speedup(column(rollouts, "cycle_tokens"), column(rollouts, "cycles"),
                                  column(reference, "cycle_tokens"), column(reference, "cycles"))

    nan = statistics.Interval(math.nan, math.nan, math.nan, 0)
    vanilla = "vanilla" in histories
    vanilla_ms_per_token = (1000 * sum(h["rollout_seconds"] for h in histories["vanilla"])
                            / sum(h["rollout_tokens"] for h in histories["vanilla"]) if vanilla else math.nan)
    rows = []
    for name, history in histories.items():
        window = max(1, min(tau_window, len(history) // 2))
        every, start, end = units(history), units(history[:window]), units(history[-window:])
        seconds = sum(h["rollout_seconds"] for h in history)
        tokens = sum(h["rollout_tokens"] for h in history)
        ms_per_cycle = (math.nan if adaptive and drafting[name]
                        else 1000 * seconds / sum(h["cycles"] for h in history))
        if drafting[name]:
            taus = {"tau_pooled": tau(every), "tau_start": tau(start), "tau_end": tau(end),
                    "tau_end_over_start": tau_ratio(end, start),
                    "tau_end_vs_frozen_mtp": (tau_ratio(end, units(histories["frozen_mtp"][-window:]))
                                              if "frozen_mtp" in histories else nan)}
            alpha = statistics.ratio_of_sums(column(every, "accepted"), column(every, "drafted"))
        else:  # every token its own step
            one = statistics.Interval(1.0, 1.0, 1.0, len(every))
            taus = {"tau_pooled": one, "tau_start": one, "tau_end": one, "tau_end_over_start": one,
                    "tau_end_vs_frozen_mtp": nan}
            alpha = statistics.Interval(0.0, 0.0, 0.0, len(every))
        speedup = (statistics.speedup(column(every, "tokens"), column(every, "seconds"),
                                      column(units(histories["vanilla"]), "tokens"),
                                      column(units(histories["vanilla"]), "seconds")) if vanilla else nan)
        rows.append({"variant": name, "steps": len(history), "tau_window": window,
                     **statistics.interval_columns("nonzero_advantage_share", statistics.mean_interval(
                         [h["nonzero_advantage_share"] for h in history])),
                     **_tau_columns(taus),
                     **statistics.interval_columns("acceptance_rate_pooled", alpha),
                     **statistics.interval_columns("tokens_per_forward", statistics.ratio_of_sums(
                         column(every, "tokens"), column(every, "forwards"))),
                     "total_rollout_seconds": seconds,
                     **statistics.interval_columns("rollout_speedup", speedup, reference=1.0),
                     "rollout_tokens_per_s": tokens / seconds, "ms_per_cycle": ms_per_cycle,
                     # the τ at which this variant's cycles would match vanilla's speed per token
                     "break_even_tau": ms_per_cycle / vanilla_ms_per_token,
                     "reward_mean": sum(h["reward"] for h in history) / len(history),
                     **_held_out_columns(before, after[name])})
    return rows


def _tau_columns(taus: dict[str, statistics.Interval]) -> dict:
    """The τ figures' columns with their intervals; the ratios (``tau_end_*``) marked significant against 1."""
    columns = {}
    for key, interval in taus.items():
        columns |= statistics.interval_columns(key, interval, reference=1.0 if key.startswith("tau_end_") else None)
    return columns


def _held_out_columns(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict:
    """Per judged quantity (reward; accuracy where known, NaN otherwise): its mean over the held-out prompts before
    and after RL, each with its interval, and ``<key>_change``, the paired difference after − before with its
    interval; ``<key>_after_significant``: that interval excludes 0."""
    columns = {}
    for key in JUDGED:
        if key not in before:
            columns |= {f"{key}_{when}": math.nan for when in ("before", "after", "change")}
            continue
        change = statistics.paired_difference(after[key], before[key])
        columns |= {**statistics.interval_columns(f"{key}_before", statistics.mean_interval(before[key])),
                    **statistics.interval_columns(f"{key}_after", statistics.mean_interval(after[key])),
                    f"{key}_after_significant": change.excludes(0.0),
                    **statistics.interval_columns(f"{key}_change", change)}
    return columns


def _plots(histories: dict[str, list[dict]], rows: list[dict], folder, scorer: str) -> None:
    """Per-step curves of every variant, and per variant with their intervals: the rollout speedup beside the
    tokens per target forward (does a speedup come from drafting?), τ over the first and last steps."""
    # a speed ratio and token counts per forward: a panel each
    speedup, tokens = "× vanilla rollout tokens/s", "tokens per target forward"
    bar_panels({speedup: {"rollout speedup vs vanilla": {row["variant"]: interval_bar(row, "rollout_speedup")
                                                         for row in rows}},
                tokens: {"tokens per target forward": {row["variant"]: interval_bar(row, "tokens_per_forward")
                                                       for row in rows},
                         "τ, first steps": {row["variant"]: interval_bar(row, "tau_start") for row in rows},
                         "τ, last steps": {row["variant"]: interval_bar(row, "tau_end") for row in rows}}},
               "GRPO variants: rollout tokens/s over vanilla's, tokens per forward, τ (1 = no drafts)",
               folder / "speedup.png", reference_lines={speedup: 1.0, tokens: 1.0})
    drafting = {name: h for name, h in histories.items() if name != "vanilla"}
    for key, title, ylabel, which in (
            ("tau", "τ per RL step (tokens per draft–verify cycle, bonus included)", "τ", drafting),
            ("rollout_seconds", "Rollout wall time per RL step", "seconds", histories),
            ("reward", f"Mean rollout reward per RL step ({scorer})", "reward", histories),
            ("nonzero_advantage_share", "Groups with mixed rewards (nonzero advantages) per RL step", "share",
             histories)):
        if which:
            line_plot({name: ([h["step"] for h in history], [h[key] for h in history])
                       for name, history in which.items()}, title, "RL step", ylabel, folder / f"{key}.png")


def _reward_text(label) -> str:
    """What the reward is, for the report."""
    if label.labeler == "verifiable":
        return ("Reward: the verifiable answer check (`label.labeler: verifiable`), 1 for the right final answer, "
                "else 0, so a step's mean reward is its accuracy.")
    return (f"Reward: the score of reward model `{label.model}` (`label.labeler: {label.labeler}`) for each "
            "(question, response), on prompts with or without a known answer.")


def _prompts_text(prompt_filter: str, kept: int, dropped: int) -> str:
    """Which training prompts the steps drew from, for the report."""
    if prompt_filter == "all":
        return f"Prompts: drawn from all {kept} rewardable training prompts (`mtp_rl.prompt_filter: all`). "
    return (f"Prompts: drawn from the {kept} training prompts whose label-stage samples did not all score alike (a "
            f"pass rate strictly between 0 and 1 for the verifiable check; `mtp_rl.prompt_filter: spread`), {dropped} "
            "dropped: a group whose rollouts all score alike has zero advantages and gives no gradient. ")


def _report(rows: list[dict], curves_by_batch: dict[str, list[dict]], cfg: Config, num_eval: int,
            num_depths: int, kept: int, dropped: int) -> str:
    r = cfg.mtp_rl
    batch = r.rollout_batch_size or r.prompts_per_step * r.group_size
    lines = [
        "# GRPO with MTP-drafted rollouts (MTP-RL) and its baselines",
        f"\n{r.steps} RL steps per variant at policy learning rate {r.learning_rate:g}; each step "
        f"{r.prompts_per_step} prompt(s) × G = {r.group_size} rollouts at "
        f"temperature {r.temperature}, max {r.max_new_tokens} new tokens, sampled in batches of {batch}. "
        f"{_prompts_text(r.prompt_filter, kept, dropped)}"
        "`nonzero_advantage_share` = the share of groups with mixed rewards (the others carry no gradient), mean "
        "over steps. Rollouts of "
        f"the drafting variants use K = {num_depths} chained MTP drafts and batched speculative sampling (the same "
        "distribution as plain sampling, each rollout with its own seeded stream); vanilla samples with HF batched "
        f"`generate`. {_reward_text(cfg.label)} Rollout time is the sampling's, "
        "the scoring's apart (`reward_seconds` in `history.json`). "
        "τ = tokens per draft–verify cycle, the bonus token included, over all of a variant's cycles (`tau_pooled`), "
        "over its first and last `tau_window` steps (`tau_start`, `tau_end`); `tau_end_over_start` = their ratio "
        "(below 1: τ fell during RL); `tau_end_vs_frozen_mtp` = `tau_end` over the frozen module's, batch by batch "
        "(above 1: training the module kept it closer to the policy). `tokens_per_forward` = rollout tokens per "
        "policy forward of a row, plain steps included: 1 for plain sampling, so a speedup with "
        "`tokens_per_forward` ≈ 1 does not come from drafting. α = accepted share of draft tokens; speedup = the "
        "variant's rollout "
        "tokens/s over vanilla's (the paper divides rollout times; the variants' policies drift apart and sample "
        "responses of other lengths, so the rate is the fair comparison). `ms_per_cycle` = rollout time per "
        "draft–verify cycle (per token for vanilla); `break_even_tau` = the τ at which a variant's cycles would "
        "produce tokens as fast as vanilla sampling (its ms per cycle / vanilla's ms per token): drafting pays only "
        "where τ exceeds it (both – under adaptive drafting, `mtp_rl.adaptive`: the rollout time then includes plain "
        "steps that no cycle counts). Every variant starts from the same "
        f"policy and MTP module and draws from the same seeded streams. Held-out: the greedy responses to {num_eval} "
        f"prompts, `reward_*` their mean score by {_scorer(cfg.label)}, `accuracy_*` their share of right answers "
        "(NaN unless every held-out prompt has a known answer); `*_change` = after − before, prompt by prompt.\n",
        ("Brackets: 95 % bootstrap intervals. τ, α and the speedup resample rollout batches (the speedup pairs each "
         "batch with vanilla's of the same prompts and sampling streams; τ and α are Σ / Σ over the batches "
         "drawn); held-out figures resample prompts (the change pairs each prompt's before and after). `*` = "
         "differs significantly: a speedup whose interval excludes 1, a held-out `*_after` whose change's interval "
         "excludes 0. The variants run one after another, so a slow drift of the machine's speed between them "
         "enters the speedup; the rollout curve below interleaves its decoders batch by batch.\n"),
        markdown_table(rows, SUMMARY_COLUMNS),
    ]
    if curves_by_batch:
        lines += [
            "\n## MTP drafting against batch size\n",
            (f"Before RL, the starting policy and the equipped module, in batches of "
             f"{', '.join(map(str, r.curve_batch_sizes))} ({r.curve_batches} timed batches per size, every decoder on "
             "the same batch in turn; MTP drafting adaptive with one decision state per batch size"
             f"{'' if r.adaptive else ' — off: every step drafts'}). Speedup = tokens/s over the HF reference's with "
             "its 95 % interval over the batches; `tokens_per_forward` = tokens per batch forward per row; "
             "`plain_share` = share of forwards that drafted nothing.\n"),
            (f"**Greedy decoding** of the {num_eval} held-out prompts: HF batched greedy against greedy-verified MTP "
             "drafting; `identical_to_reference` = share of rows equal to HF's output token for token (in half "
             "precision the two engines round a batch differently).\n"),
            markdown_table(curves_by_batch["decoding"], CURVE_COLUMNS),
            (f"\n**Rollouts** of the training prompts (cycled) at temperature {r.temperature}: `vanilla` (HF batched "
             "sampling) against `mtp` (batched speculative sampling), the j-th batch of both from the same seeded "
             "streams (samples differ by design).\n"),
            markdown_table(curves_by_batch["rollout"], CURVE_COLUMNS),
        ]
    lines.append("\nPlots: `speedup.png` (speedup, tokens per forward, τ of the first and last steps with intervals), "
                 "`tau.png`, `rollout_seconds.png`, `reward.png`, `nonzero_advantage_share.png`" + (", `speed_curve.png`" if curves_by_batch else "") + "; per-step and per-batch "
                 "numbers in "
                 "`history.json`.")
    return "\n".join(lines) + "\n"
