"""Prefect tasks of the MTP-RL stages: the MTP-equipped stage, then GRPO with MTP-drafted rollouts.

Thin wrappers around :mod:`models.mtp.training` and :mod:`models.mtp.rl`:

* ``train_mtp`` — self-distilled data (the policy's own greedy responses, as ``train_medusa`` distilled them),
  split by prompt; the main model's states computed once; a K-depth shared MTP module trained with eq. 1's
  weighted CE; held-out per-depth accuracy and expected acceptance length; the same for every K of the
  depth ablation (Table 2).
* ``train_mtp_rl`` — each configured variant (vanilla GRPO, MTP-RL, frozen MTP, CE only, no backprop) from
  the same policy and module, on the same prompts and sampling seeds: per step τ, acceptance rate, rollout
  time, reward and accuracy; held-out greedy accuracy before and after; rollout speedup over vanilla.
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


SUMMARY_COLUMNS = ["variant", "steps", "tau_first", "tau_last", "tau_mean", "acceptance_rate",
                   "total_rollout_seconds", "rollout_speedup", "rollout_tokens_per_s", "ms_per_cycle", "break_even_tau",
                   "reward_mean", "accuracy_before", "accuracy_after"]


def _greedy_accuracy(policy, prompt_ids: list[list[int]], answers: list[str], max_new_tokens: int) -> float:
    """Share of held-out prompts whose greedy answer is right (batched HF greedy)."""
    from models.engine.decoding import GREEDY, hf_decode
    from models.engine.generation import end_token_ids
    from models.labeling.labelers import is_correct

    outputs = hf_decode(policy, prompt_ids, GREEDY, max_new_tokens, end_token_ids(policy), batch_size=16)
    decoded = [policy.tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    return sum(bool(is_correct(text, answer)) for text, answer in zip(decoded, answers, strict=True)) / len(answers)


def _prompts_with_answers(cfg: Config, split: str) -> pd.DataFrame:
    table = read_prompts(cfg, split)
    table = table[table["answer"].notna()].reset_index(drop=True)
    if table.empty:
        raise ValueError(f"no {split} prompt has a known answer: GRPO's verifiable reward needs them "
                         "(prompts.source: arithmetic, or a source with an answer column)")
    return table


@gpu_task("train-mtp-rl")
def train_mtp_rl_task(cfg: Config) -> StageResult:
    """GRPO per variant with (or without) MTP-drafted rollouts; τ, rollout time, reward, accuracy. Runs in every
    process of ``accelerate launch`` (each rolls out its share of a step's prompts); the main process writes."""
    import torch

    from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
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
    train_prompts = _prompts_with_answers(cfg, "train").sample(frac=1.0, random_state=r.seed).reset_index(drop=True)
    train_prompts = train_prompts.head(r.steps * r.prompts_per_step)
    eval_prompts = _prompts_with_answers(cfg, "eval").head(r.eval_prompts)
    policy = load_stage_policy(cfg, "base")
    accelerator = stage_accelerator(policy, r.mixed_precision)
    eos = end_token_ids(policy)
    system = cfg.prompts.system_prompt
    rl_ids = [encode_prompt(policy, p)
              for p in chat_prompts(policy.tokenizer, train_prompts["question"].tolist(), system)]
    eval_ids = [encode_prompt(policy, p)[0].tolist()
                for p in chat_prompts(policy.tokenizer, eval_prompts["question"].tolist(), system)]
    accuracy_before = _greedy_accuracy(policy, eval_ids, eval_prompts["answer"].tolist(), r.max_new_tokens)
    logger.info("held-out greedy accuracy before RL: %.3f on %d prompts", accuracy_before, len(eval_ids))
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

    histories, accuracy_after = {}, {}
    for name in r.variants:
        var = variant(name, training)
        policy = load_stage_policy(cfg, "base")
        module = MTPModule.load(module_dir, policy.model) if var.drafts else None

        def on_step(step: int, record: dict, name: str = name) -> None:
            logger.info("%s step %d/%d: rollouts %.1f s, τ %.2f, α %.2f, reward %.2f", name, step, r.steps,
                        record["rollout_seconds"], record["tau"], record["acceptance_rate"], record["reward"])

        histories[name] = train_variant(policy, module, var, rl_ids, train_prompts["answer"].tolist(), training,
                                        weights, eos, accelerator, on_step, on_rollout)
        accuracy_after[name] = _greedy_accuracy(policy, eval_ids, eval_prompts["answer"].tolist(), r.max_new_tokens)
        logger.info("%s: held-out greedy accuracy after RL %.3f", name, accuracy_after[name])
        accelerator.free_memory()
        del policy, module
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()

    rows = _summary(histories, accuracy_before, accuracy_after)
    logger.info("\n%s", markdown_table(rows, SUMMARY_COLUMNS))
    out = cfg.path(cfg.paths.mtp_rl_dir)
    report = _report(rows, cfg, len(eval_ids), num_depths)
    if main:  # every process holds the same histories (gathered per step); one writes them
        with atomic_path(out) as tmp:
            tmp.mkdir(parents=True)
            write_json({"variants": histories, "accuracy_before": accuracy_before, "accuracy_after": accuracy_after},
                       tmp / "history.json")
            write_table(pd.DataFrame(rows), tmp / "table.csv")
            _plots(histories, tmp)
            (tmp / "report.md").write_text(report)
        table_artifact(key="mtp-rl-summary", table=[{c: row[c] for c in SUMMARY_COLUMNS} for row in rows],
                       description="GRPO variants: acceptance length, rollout time, speedup, accuracy")
        markdown_artifact(key="mtp-rl-report", markdown=report, description="MTP-RL report")
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    metrics = {f"{row['variant']}.{key}": row[key] for row in rows for key in SUMMARY_COLUMNS[1:]
               if isinstance(row[key], (int, float))}
    metrics |= {"accuracy_before": accuracy_before, "wall_seconds": time.perf_counter() - started}
    curves = {f"{name}.{key}": [record[key] for record in history] for name, history in histories.items()
              for key in ("tau", "acceptance_rate", "rollout_seconds", "reward", "accuracy")}
    return StageResult(metrics=metrics, curves=curves, tables={"mtp_rl_table": out / "table.csv"},
                       artifacts={"mtp_rl": out})


def _summary(histories: dict[str, list[dict]], accuracy_before: float, accuracy_after: dict[str, float]) -> list[dict]:
    """One row per variant; speedup = vanilla's total rollout time / the variant's (NaN without vanilla)."""
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
                     "accuracy_before": accuracy_before, "accuracy_after": accuracy_after[name]})
    return rows


def _plots(histories: dict[str, list[dict]], folder) -> None:
    drafting = {name: h for name, h in histories.items() if name != "vanilla"}
    for key, title, ylabel, which in (
            ("tau", "τ per RL step (tokens per draft–verify cycle, bonus included)", "τ", drafting),
            ("rollout_seconds", "Rollout wall time per RL step", "seconds", histories),
            ("reward", "Mean rollout reward per RL step", "reward", histories)):
        if which:
            line_plot({name: ([h["step"] for h in history], [h[key] for h in history])
                       for name, history in which.items()}, title, "RL step", ylabel, folder / f"{key}.png")


def _report(rows: list[dict], cfg: Config, num_eval: int, num_depths: int) -> str:
    r = cfg.mtp_rl
    return "\n".join([
        "# GRPO with MTP-drafted rollouts (MTP-RL) and its baselines",
        f"\n{r.steps} RL steps per variant; each step {r.prompts_per_step} prompt(s) × G = {r.group_size} rollouts at "
        f"temperature {r.temperature}, max {r.max_new_tokens} new tokens, batch 1. Rollouts of the drafting variants "
        f"use K = {num_depths} chained MTP drafts and speculative sampling (the same distribution as plain "
        "sampling); vanilla samples with HF `generate`. Reward = 1 for the right answer, else 0 (so the step's mean "
        "reward is its accuracy). τ = tokens per draft–verify cycle, the bonus token included; α = accepted share of "
        "draft tokens; speedup = vanilla's total rollout time / the variant's. `ms_per_cycle` = rollout time per "
        "draft–verify cycle (per token for vanilla); `break_even_tau` = the τ at which a variant's cycles would "
        "produce tokens as fast as vanilla sampling (its ms per cycle / vanilla's ms per token): drafting pays only "
        "where τ exceeds it. Every variant starts from the same "
        f"policy and MTP module and draws from the same seeded streams. Held-out accuracy: greedy, {num_eval} "
        "prompts.\n",
        markdown_table(rows, SUMMARY_COLUMNS),
        "\nPlots: `tau.png`, `rollout_seconds.png`, `reward.png`; per-step numbers in `history.json`.",
    ]) + "\n"
