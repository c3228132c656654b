"""Prefect tasks of the MTP-RL stages: the MTP-equipped stage, then GRPO with MTP-drafted rollouts.

Thin wrappers around :mod:`models.mtp.training` and :mod:`models.mtp.rl`:

* ``train_mtp`` — self-distilled data (the policy's own greedy responses, as ``train_medusa`` distilled them),
  split by prompt; the main model's states computed once; a K-depth shared MTP module trained with eq. 1's
  weighted CE; held-out per-depth accuracy and expected acceptance length; the same for every K of the
  depth ablation (Table 2).
* ``train_mtp_rl`` — each configured variant (vanilla GRPO, MTP-RL, frozen MTP, CE only, no backprop) from
  the same policy and module, on the same prompts and sampling seeds, rewarded by the configured labeler
  (``label``: the verifiable answer check on prompts with answers, or a reward model such as ArmoRM on any
  prompts): per step τ, acceptance rate, rollout time and mean reward; the labeler's mean score of the held-out
  greedy responses before and after (and their accuracy where every held-out prompt has an answer); rollout
  speedup over vanilla.
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

import pandas as pd
from tqdm.auto import tqdm

from foresight.benchmark import markdown_table
from foresight.config import Config, component
from foresight.plots import line_plot
from foresight.storage import atomic_path, write_json, write_table
from tasks.data import (
    StageResult,
    gpu_task,
    load_stage_policy,
    markdown_artifact,
    progress_artifact,
    read_prompts,
    sft_responses,
    split_responses,
    stage_accelerator,
    stage_logger,
    table_artifact,
)


@contextlib.contextmanager
def _shared_scratch(accelerator, prefix: str) -> Iterator[Path]:
    """A scratch folder that every process of the stage sees (the main process makes it and names it to the
    others; on one machine they share its temporary directory), removed once all are done with it."""
    from accelerate.utils import broadcast_object_list

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
    from models.common.sequences import sft_sequences
    from models.mtp.config import MTPTraining
    from models.mtp.training import chain_acceptance, frozen_states, train_mtp_module

    logger = stage_logger()
    started = time.perf_counter()
    m = cfg.mtp
    training = component(MTPTraining, m, ce_weights=tuple(m.ce_weights))
    policy = load_stage_policy(cfg, "base")
    policy.model.requires_grad_(False).eval()
    accelerator = stage_accelerator(policy, m.mixed_precision)
    responses = sft_responses(cfg, m.data, "mtp.data")
    train_rows, eval_rows = split_responses(responses, m.eval_fraction, m.seed)
    sequences = sft_sequences(policy.tokenizer, responses, m.max_length)
    depths = [m.num_depths, *sorted(set(m.ablation_depths) - {m.num_depths})]
    modules, histories, evaluations, seconds = {}, {}, {}, {}
    # the frozen policy's states, on disk in its dtype: at 8B they would not fit in RAM
    with _shared_scratch(accelerator, "mtp-states-") as scratch:
        hidden = frozen_states(policy, sequences, scratch, accelerator=accelerator)
        train = ([sequences[i] for i in train_rows], hidden.select(train_rows))
        held_out = ([sequences[i] for i in eval_rows], hidden.select(eval_rows))
        logger.info("MTP self-distilled data (%s): %d training / %d held-out sequences", m.data, len(train[0]),
                    len(held_out[0]))
        for num_depths in depths:
            def on_step(step: int, num_steps: int, stats: dict[str, float], k: int = num_depths) -> None:
                if step % max(1, num_steps // 4) == 0 or step == num_steps:
                    logger.info("K = %d, step %d/%d: loss %.4f", k, step, num_steps, stats["loss"])

            depth_started = time.perf_counter()
            modules[num_depths], histories[num_depths] = train_mtp_module(policy, *train, num_depths, training,
                                                                          accelerator, on_step)
            seconds[num_depths] = time.perf_counter() - depth_started
            evaluations[num_depths] = chain_acceptance(policy, modules[num_depths], *held_out)
            accelerator.free_memory()
            logger.info("K = %d: held-out %s", num_depths, json.dumps(evaluations[num_depths]))

    ablation = pd.DataFrame([{"num_depths": k, "main": k == m.num_depths, **evaluations[k],
                              "train_seconds": seconds[k]} for k in sorted(depths)])
    out = cfg.path(cfg.paths.mtp_dir)
    if accelerator.is_main_process:  # every process holds the same module; one writes it
        _write_mtp(out, modules[m.num_depths], evaluations, histories, ablation, policy, m, len(train[0]),
                   len(held_out[0]))
        table_artifact(key="mtp-depth-ablation", table=ablation.to_dict("records"),
                       description="Expected initial acceptance length per number of shared MTP depths")
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    metrics = {"num_train_sequences": len(train[0]), "num_eval_sequences": len(held_out[0]),
               "final_loss": histories[m.num_depths]["loss"][-1],
               **{f"held_out_{key}": value for key, value in evaluations[m.num_depths].items()},
               **{f"ablation_k{k}_expected_tau": evaluations[k]["expected_tau"] for k in depths},
               "wall_seconds": time.perf_counter() - started}
    curves = dict(histories[m.num_depths])
    return StageResult(metrics=metrics, curves=curves, tables={"mtp_ablation": out / "ablation.csv"},
                       artifacts={"mtp": out})


def _write_mtp(out: Path, module, evaluations: dict, histories: dict, ablation: pd.DataFrame, policy, m,
               num_train: int, num_eval: int) -> None:
    """The equip stage's folder: the module, its held-out evaluation, the histories, the ablation and plots."""
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
        line_plot({"expected τ (greedy chain)": (ablation["num_depths"].tolist(), ablation["expected_tau"].tolist())},
                  "MTP depth ablation: expected initial acceptance length", "K (shared-layer depths)", "τ",
                  tmp / "ablation.png", reference=(1.0, "no drafts"))


ROLLOUT_COLUMNS = ["variant", "steps", "tau_first", "tau_last", "tau_mean", "acceptance_rate",
                   "total_rollout_seconds", "rollout_speedup", "rollout_tokens_per_s", "ms_per_cycle", "break_even_tau",
                   "reward_mean"]
HELD_OUT_COLUMNS = ["reward_before", "reward_after", "accuracy_before", "accuracy_after"]
SUMMARY_COLUMNS = ROLLOUT_COLUMNS + HELD_OUT_COLUMNS


def _held_out(policy, labeler, prompt_ids: list[list[int]], questions: list[str], answers: list[str | None],
              max_new_tokens: int) -> dict[str, float]:
    """The policy's greedy responses to the held-out prompts (batched HF greedy), judged: ``reward``, the labeler's
    mean score; ``accuracy``, the share of right final answers, only when every prompt has a reference answer
    (for the verifiable labeler the two are equal)."""
    from models.engine.decoding import GREEDY, hf_decode
    from models.engine.generation import end_token_ids
    from models.labeling.answers import is_correct

    outputs = hf_decode(policy, prompt_ids, GREEDY, max_new_tokens, end_token_ids(policy), batch_size=16)
    responses = [policy.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    scores = labeler.score(questions, responses, answers)
    judged = {"reward": sum(scores) / len(scores)}
    correct = [is_correct(response, answer) for response, answer in zip(responses, answers, strict=True)]
    if all(c is not None for c in correct):
        judged["accuracy"] = sum(correct) / len(correct)
    return judged


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


def _answers(table: pd.DataFrame) -> list[str | None]:
    return [None if pd.isna(answer) else answer for answer in table["answer"]]


def _scorer(label) -> str:
    """Which labeler scored, in words."""
    return "the verifiable answer check" if label.labeler == "verifiable" else f"{label.labeler} `{label.model}`"


@gpu_task("train-mtp-rl")
def train_mtp_rl_task(cfg: Config) -> StageResult:
    """GRPO per variant with (or without) MTP-drafted rollouts, rewarded by the configured labeler; τ, rollout
    time, reward, held-out reward (and accuracy). Runs in every process of ``accelerate launch`` (each rolls out and
    scores its share of a step's prompts); the main process writes."""
    import torch

    from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
    from models.labeling.config import LabelerSpec
    from models.labeling.labelers import build_labeler
    from models.mtp.config import MTPRLTraining
    from models.mtp.module import MTPModule, MTPModuleConfig
    from models.mtp.rl import train_variant, variant
    from models.mtp.training import depth_weights

    logger = stage_logger()
    started = time.perf_counter()
    r = cfg.mtp_rl
    training = component(MTPRLTraining, r)
    module_dir = cfg.path(cfg.paths.mtp_dir) / "module"
    # K is the saved module's (the one source of truth); reading it fails early, naming the missing stage
    num_depths = MTPModuleConfig.read(module_dir).num_depths
    train_prompts = _rl_prompts(cfg, "train").sample(frac=1.0, random_state=r.seed).reset_index(drop=True)
    train_prompts = train_prompts.head(r.steps * r.prompts_per_step)
    eval_prompts = _rl_prompts(cfg, "eval").head(r.eval_prompts)
    policy = load_stage_policy(cfg, "base")
    accelerator = stage_accelerator(policy, r.mixed_precision)
    # loaded once for every variant, beside the policy on its device (under a launch, each process's own GPU)
    labeler = build_labeler(component(LabelerSpec, cfg.label, device=cfg.policy.device))
    eos = end_token_ids(policy)
    system = cfg.prompts.system_prompt
    rl_ids = [encode_prompt(policy, p)
              for p in chat_prompts(policy.tokenizer, train_prompts["question"].tolist(), system)]
    eval_ids = [encode_prompt(policy, p)[0].tolist()
                for p in chat_prompts(policy.tokenizer, eval_prompts["question"].tolist(), system)]
    eval_set = (eval_ids, eval_prompts["question"].tolist(), _answers(eval_prompts), r.max_new_tokens)
    before = _held_out(policy, labeler, *eval_set)
    logger.info("held-out greedy responses before RL, scored by %s: %s on %d prompts", _scorer(cfg.label),
                json.dumps(before), len(eval_ids))
    weights = depth_weights(cfg.mtp.ce_weights, num_depths)

    # this process's rollouts (each rolls out its share of every step's prompts)
    total_rollouts = len(r.variants) * r.steps * r.prompts_per_step * r.group_size // accelerator.num_processes
    main = accelerator.is_main_process
    progress = progress_artifact(key="mtp-rl-progress", description="Rollouts sampled") if main else None
    bar = tqdm(total=total_rollouts, desc="MTP-RL rollouts", unit="rollout", disable=not main)

    def on_rollout() -> None:
        bar.update(1)
        if progress is not None:
            progress(100.0 * bar.n / total_rollouts)

    histories, after = {}, {}
    for name in r.variants:
        var = variant(name, training)
        policy = load_stage_policy(cfg, "base")
        module = MTPModule.load(module_dir, policy.model) if var.drafts else None

        def on_step(step: int, record: dict, name: str = name) -> None:
            logger.info("%s step %d/%d: rollouts %.1f s, τ %.2f, α %.2f, reward %.2f", name, step, r.steps,
                        record["rollout_seconds"], record["tau"], record["acceptance_rate"], record["reward"])

        histories[name] = train_variant(policy, module, var, rl_ids, train_prompts["question"].tolist(),
                                        _answers(train_prompts), labeler.score, training, weights, eos, accelerator,
                                        on_step, on_rollout)
        after[name] = _held_out(policy, labeler, *eval_set)
        logger.info("%s: held-out greedy responses after RL: %s", name, json.dumps(after[name]))
        accelerator.free_memory()
        del policy, module
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()
    del labeler  # the reward model's memory back before the outputs are written
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    rows = _summary(histories, before, after)
    logger.info("\n%s", markdown_table(rows, SUMMARY_COLUMNS))
    out = cfg.path(cfg.paths.mtp_rl_dir)
    report = _report(rows, cfg, len(eval_ids), num_depths)
    if main:  # every process holds the same histories (gathered per step); one writes them
        with atomic_path(out) as tmp:
            tmp.mkdir(parents=True)
            write_json({"labeler": cfg.label.labeler, "label_model": cfg.label.model, "variants": histories,
                        **{f"{key}_before": value for key, value in before.items()},
                        **{f"{key}_after": {name: scores[key] for name, scores in after.items()} for key in before}},
                       tmp / "history.json")
            write_table(pd.DataFrame(rows), tmp / "table.csv")
            _plots(histories, tmp, _scorer(cfg.label))
            (tmp / "report.md").write_text(report)
        table_artifact(key="mtp-rl-summary", table=[{c: row[c] for c in SUMMARY_COLUMNS} for row in rows],
                       description="GRPO variants: acceptance length, rollout time, speedup, reward and held-out "
                                   f"reward by {_scorer(cfg.label)}")
        markdown_artifact(key="mtp-rl-report", markdown=report, description="MTP-RL report")
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    metrics = {f"{row['variant']}.{key}": row[key] for row in rows for key in ROLLOUT_COLUMNS[1:]
               if isinstance(row[key], (int, float))}
    # held-out accuracy only where every held-out prompt has an answer (its columns are NaN otherwise)
    metrics |= {f"{key}_before": value for key, value in before.items()}
    metrics |= {f"{name}.{key}_after": value for name, scores in after.items() for key, value in scores.items()}
    metrics["wall_seconds"] = time.perf_counter() - started
    curves = {f"{name}.{key}": [record[key] for record in history] for name, history in histories.items()
              for key in ("tau", "acceptance_rate", "rollout_seconds", "reward_seconds", "reward")}
    return StageResult(metrics=metrics, curves=curves, tables={"mtp_rl_table": out / "table.csv"},
                       artifacts={"mtp_rl": out})


def _summary(histories: dict[str, list[dict]], before: dict[str, float],
             after: dict[str, dict[str, float]]) -> list[dict]:
    """One row per variant; speedup = vanilla's total rollout time / the variant's (NaN without vanilla); the
    held-out accuracy NaN where it is not known."""
    vanilla = sum(h["rollout_seconds"] for h in histories["vanilla"]) if "vanilla" in histories else math.nan
    vanilla_ms_per_token = (1000 * vanilla / sum(h["rollout_tokens"] for h in histories["vanilla"])
                            if "vanilla" in histories else math.nan)
    rows = []
    for name, history in histories.items():
        seconds = sum(h["rollout_seconds"] for h in history)
        tokens = sum(h["rollout_tokens"] for h in history)
        ms_per_cycle = 1000 * seconds / sum(h["cycles"] for h in history)
        rows.append({"variant": name, "steps": len(history), "tau_first": history[0]["tau"],
                     "tau_last": history[-1]["tau"], "tau_mean": sum(h["tau"] for h in history) / len(history),
                     "acceptance_rate": sum(h["acceptance_rate"] for h in history) / len(history),
                     "total_rollout_seconds": seconds, "rollout_speedup": vanilla / seconds,
                     "rollout_tokens_per_s": tokens / seconds, "ms_per_cycle": ms_per_cycle,
                     # the τ at which this variant's cycles would match vanilla's speed per token
                     "break_even_tau": ms_per_cycle / vanilla_ms_per_token,
                     "reward_mean": sum(h["reward"] for h in history) / len(history),
                     "reward_before": before["reward"], "reward_after": after[name]["reward"],
                     "accuracy_before": before.get("accuracy", math.nan),
                     "accuracy_after": after[name].get("accuracy", math.nan)})
    return rows


def _plots(histories: dict[str, list[dict]], folder, scorer: str) -> None:
    drafting = {name: h for name, h in histories.items() if name != "vanilla"}
    for key, title, ylabel, which in (
            ("tau", "τ per RL step (tokens per draft–verify cycle, bonus included)", "τ", drafting),
            ("rollout_seconds", "Rollout wall time per RL step", "seconds", histories),
            ("reward", f"Mean rollout reward per RL step ({scorer})", "reward", histories)):
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


def _report(rows: list[dict], cfg: Config, num_eval: int, num_depths: int) -> str:
    r = cfg.mtp_rl
    return "\n".join([
        "# GRPO with MTP-drafted rollouts (MTP-RL) and its baselines",
        f"\n{r.steps} RL steps per variant; each step {r.prompts_per_step} prompt(s) × G = {r.group_size} rollouts at "
        f"temperature {r.temperature}, max {r.max_new_tokens} new tokens, batch 1. Rollouts of the drafting variants "
        f"use K = {num_depths} chained MTP drafts and speculative sampling (the same distribution as plain "
        f"sampling); vanilla samples with HF `generate`. {_reward_text(cfg.label)} Rollout time is the sampling's, "
        "the scoring's apart (`reward_seconds` in `history.json`). "
        "τ = tokens per draft–verify cycle, the bonus token included; α = accepted share of "
        "draft tokens; speedup = vanilla's total rollout time / the variant's. `ms_per_cycle` = rollout time per "
        "draft–verify cycle (per token for vanilla); `break_even_tau` = the τ at which a variant's cycles would "
        "produce tokens as fast as vanilla sampling (its ms per cycle / vanilla's ms per token): drafting pays only "
        "where τ exceeds it. Every variant starts from the same "
        f"policy and MTP module and draws from the same seeded streams. Held-out: the greedy responses to {num_eval} "
        f"prompts, `reward_*` their mean score by {_scorer(cfg.label)}, `accuracy_*` their share of right answers "
        "(NaN unless every held-out prompt has a known answer).\n",
        markdown_table(rows, SUMMARY_COLUMNS),
        "\nPlots: `tau.png`, `rollout_seconds.png`, `reward.png`; per-step numbers in `history.json`.",
    ]) + "\n"
