"""Prefect tasks of the COrAL stages: two-stage order-agnostic training and the decoding benchmark.

Thin wrappers around :mod:`models.coral.training` and :mod:`models.coral.decoding`:

* ``train_coral`` — SFT data from the pipeline (the ``distill`` stage's responses, or the samples
  labeled correct), split by prompt (distilled: the ``distill`` stage's held-out split), a validation share of the
  training prompts for stage 1's early stopping; stage 1 (last layer) then stage 2 (the rest, off by default);
  held-out top-1 accuracy per offset (forward, confirm, reconstruct; all held-out text and task text) before and
  after (intervals over held-out sequences); the trained model as a Hugging Face
  folder, with per-offset curves. Under ``accelerate launch`` every process trains; the main process alone
  writes the folder.
* ``benchmark_coral`` — on that model: next-token greedy (HF, KV cache) and full COrAL on every held-out prompt
  for accuracy; on the first ``speed_prompts`` of them, at batch 1 and interleaved prompt by prompt, every
  decoder — COrAL w/o verifier, w/o multi-forward (the paper's Table 1) and the block-size / forward-window
  ablations of the w/o-verifier decoder too: accuracy, tokens/s, speedup, tokens per forward, each with its 95 %
  interval over prompts (:mod:`foresight.statistics`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from tqdm.auto import tqdm

from foresight import statistics
from foresight.benchmark import display_rows, interleaved_decoding, markdown_table, speed_row
from foresight.plots import bar_panels, interval_bands, interval_bar, line_panels, line_plot
from foresight.storage import atomic_path, write_json, write_table
from models.common.lora import ADAPTER_DIR, Adapter, trained_weight_names
from models.common.sequences import fitting_sft
from models.common.training import check_update, weight_changes
from models.coral.decoding import CoralStats, coral_generate
from models.coral.training import PER_EPOCH, evaluated_offsets, offset_hits, train_coral
from models.engine.decoding import GREEDY, hf_decode
from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
from models.labeling.answers import cut_by_length, is_correct
from tasks.common import (
    StageResult,
    gpu_task,
    live_curves,
    load_stage_policy,
    load_trained_policy,
    markdown_artifact,
    read_prompts,
    stage_accelerator,
    stage_logger,
    table_artifact,
)
from tasks.distilled import drafter_split, sft_responses, validation_split

if TYPE_CHECKING:
    from foresight.config import Config


@gpu_task("train-coral")
def train_coral_task(cfg: Config) -> StageResult:
    """Two-stage COrAL training of the base policy; writes the model folder with its curves and evaluation."""
    logger = stage_logger()
    started = time.perf_counter()
    c = cfg.coral
    policy = load_stage_policy(cfg, "base", training=True)
    # rows too long for coral.max_length are dropped whole, never truncated (models/common/sequences.py)
    responses, sequences, too_long = fitting_sft(policy.tokenizer, sft_responses(cfg, cfg.coral.data, "coral.data"),
                                                 c.max_length, "coral.max_length")
    if too_long:
        logger.warning("dropped %d responses longer than coral.max_length %d tokens", too_long, c.max_length)
    train_rows, eval_rows = drafter_split(cfg, responses, c.eval_fraction, c.seed)
    fit_rows, validation_rows = validation_split(responses, train_rows, c.validation_fraction, c.seed)
    train, validation, held_out = ([sequences[i] for i in rows] for rows in (fit_rows, validation_rows, eval_rows))
    prompt_sets = responses["prompt_set"] if "prompt_set" in responses else pd.Series("task", index=responses.index)
    task = [i for i, row in enumerate(eval_rows.tolist()) if prompt_sets.iloc[row] == "task"]
    logger.info("COrAL SFT data (%s): %d training / %d validation (stage 1's early stopping) / %d held-out sequences "
                "(%d of task prompts)", c.data, len(train), len(validation), len(held_out), len(task))
    before = _held_out_accuracy(policy, held_out, task, c, "before")
    logger.info("held-out top-1 per offset before training: %s", json.dumps(before))

    def on_step(stage: str, step: int, num_steps: int, stats: dict[str, float]) -> None:
        if step % max(1, num_steps // 5) == 0 or step == num_steps:
            logger.info("%s step %d/%d: loss %.4f (forward %.4f, backward %.4f)", stage, step, num_steps,
                        stats["loss"], stats["forward_loss"], stats.get("backward_loss", float("nan")))

    # per stage, before stage 2's adapters are merged away: the names of the weights it trained, and its adapters
    initial, trained_names, adapters = Path(policy.model.name_or_path), {}, {}

    def on_trained(stage: int, model) -> None:
        trained_names[stage], adapters[stage] = trained_weight_names(model), Adapter.of(model)

    accelerator = stage_accelerator(policy.device, c.mixed_precision, c.gradient_accumulation_steps)
    train_started = time.perf_counter()
    # every per-step key of both stages is a curve under its own name (stage 2's steps continue stage 1's)
    with live_curves(cfg, lambda key: key):
        history = train_coral(policy, train, c, accelerator, on_step, validation=validation, on_trained=on_trained)
    train_seconds = time.perf_counter() - train_started
    after = _held_out_accuracy(policy, held_out, task, c, "after")
    logger.info("held-out top-1 per offset after training: %s", json.dumps(after))

    out = cfg.path(cfg.paths.coral_dir)
    changed = {}
    if accelerator.is_main_process:  # every process holds the same model; one writes it
        _write_coral_model(policy, out, history, {**before, **after, "num_train_sequences": len(train),
                                                  "num_eval_sequences": len(held_out),
                                                  "num_eval_task_sequences": len(task), "data": c.data},
                           adapters.get(2))
        # the saved files against the policy's own checkpoint files, one tensor at a time (no second 8B copy)
        for stage, names in trained_names.items():
            rate = c.stage1_learning_rate if stage == 1 else c.stage2_learning_rate
            changed[f"stage{stage}_weights_changed"] = check_update(
                weight_changes(out, initial, names), f"COrAL stage {stage}", rate, policy.model.dtype, logger)
    accelerator.wait_for_everyone()
    metrics = {"num_train_sequences": len(train), "num_validation_sequences": len(validation),
               "num_eval_sequences": len(held_out), "num_sequences_dropped_too_long": too_long,
               "train_seconds": train_seconds,
               "final_loss": history["loss"][-1] if history["loss"] else float("nan"),
               **{key: history[key][-1] for key in ("stage1_held_out_loss", "stage1_best_epoch") if key in history},
               "stage1_epochs_run": len(history.get("stage1_held_out_loss", [])),
               "stage1_steps": history["stage"].count(1), "next_token_weight": c.next_token_weight,
               **{f"{when}_{key}": value for when, accuracy in (*before.items(), *after.items())
                  for key, value in accuracy.items()},
               **changed, "wall_seconds": time.perf_counter() - started}
    # per-step curves only: stage 1's per-epoch early-stopping entries are metrics (their last values) and history.json
    curves = {key: values for key, values in history.items()
              if key != "stage" and key.removeprefix("stage1_") not in PER_EPOCH}
    return StageResult(metrics=metrics, curves=curves, artifacts={"coral": out})


def _held_out_accuracy(policy, held_out: list, task: list[int], training, when: str) -> dict[str, dict[str, float]]:
    """Held-out top-1 per offset (:func:`models.coral.training.offset_hits`) over every held-out sequence (key
    ``when``) and over those of task prompts alone, the benchmark's kind of text (``{when}_task``)."""
    hits, counts = offset_hits(policy, held_out, training)
    offsets = evaluated_offsets(training)
    return {when: _offset_accuracy(hits, counts, offsets),
            f"{when}_task": _offset_accuracy(hits[task], counts[task], offsets)}


def _offset_accuracy(hits, counts, columns) -> dict[str, float]:
    """Held-out top-1 accuracy per (kind, offset) column, Σ hits / Σ targets of the per-sequence counts (S, C), with
    its interval over sequences (``top1_{kind}_{|o|}``, ``_low``, ``_high``); NaN where a column has no target."""
    accuracy = {}
    for column, (kind, offset) in enumerate(columns):
        accuracy |= statistics.interval_columns(
            f"top1_{kind}_{abs(offset)}", statistics.ratio_of_sums(hits[:, column].tolist(), counts[:, column].tolist()))
    return accuracy


def _write_coral_model(policy, out, history: dict[str, list], evaluation: dict, adapter=None) -> None:
    """The trained model as a Hugging Face folder (in the policy's dtype), its evaluation, history and curves; with
    stage 2's LoRA ``adapter``, the adapter itself in ``adapter/`` (models/common/lora.py): what a bf16 merge may round
    away survives there. Its base is the initial policy with this folder's last decoder layer (stage 1's; stage 2's
    adapters leave that layer out)."""
    with atomic_path(out) as tmp:
        policy.model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        if adapter is not None:
            adapter.save(tmp / ADAPTER_DIR)
        write_json(evaluation, tmp / "evaluation.json")
        (tmp / "history.json").write_text(json.dumps(history) + "\n")
        for prefix, name, what in (("ce_forward_", "loss.png", "forward prediction of m + k"),
                                   ("ce_reconstruct_", "reconstruction.png", "reconstruction of m − k (stage 1)")):
            line_plot({f"k = {key.removeprefix(prefix)}": (list(range(1, len(values) + 1)), values)
                       for key, values in history.items() if key.startswith(prefix)},
                      f"COrAL: {what}", "step (stage 1, then stage 2)", "cross-entropy", tmp / name)


TABLE_COLUMNS = ["decoder", "verifier", "block_size", "forward_window", "accuracy", "accuracy_vs_next_token",
                 "tokens_per_s", "speedup_vs_reference", "tokens_per_forward", "ms_per_forward", "forced_tokens",
                 "prompts"]


def coral_decoders(cfg: Config) -> dict:
    """Name → :class:`models.coral.config.CoralDecoding` of every COrAL decoder the benchmark runs (the section
    itself is full COrAL's)."""
    b = cfg.coral_benchmark
    ablations = {"no_verifier": b.model_copy(update={"verify": False}),
                 "no_multi_forward": b.model_copy(update={"forward_window": 1})}
    decoders = {"coral": b, **{f"coral_{name}": ablations[name] for name in b.ablations}}
    decoders |= {f"coral_no_verifier_b{size}": b.model_copy(update={"verify": False, "block_size": size})
                 for size in b.ablation_block_sizes if size != b.block_size}
    decoders |= {f"coral_no_verifier_kf{window}": b.model_copy(update={"verify": False, "forward_window": window})
                 for window in b.ablation_forward_windows if window != b.forward_window}
    return decoders


@gpu_task("benchmark-coral")
def benchmark_coral_task(cfg: Config) -> StageResult:
    """Next-token greedy vs the COrAL decoders on held-out prompts, on the COrAL-trained model: every decoder on
    the speed prompts at batch 1, interleaved and timed; next-token and full COrAL on the rest, for accuracy."""
    logger = stage_logger()
    started = time.perf_counter()
    b = cfg.coral_benchmark
    folder = cfg.path(cfg.paths.coral_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no COrAL model: run the train_coral stage first")
    policy = load_trained_policy(cfg, folder)
    eos = end_token_ids(policy)
    held_out = read_prompts(cfg, "eval").head(b.num_prompts)
    if held_out.empty:
        raise ValueError("no held-out prompts to benchmark COrAL on: set prompts.num_eval > 0")
    settings = coral_decoders(cfg)
    decoders = ["next_token", *settings]

    def decode(decoder: str, ids, max_new_tokens: int) -> tuple[list[int], CoralStats | None]:
        if decoder == "next_token":
            (tokens,) = hf_decode(policy, [ids[0].tolist()], GREEDY, max_new_tokens, eos, batch_size=1)
            return tokens, None
        stats = CoralStats()
        return coral_generate(policy.model, ids, max_new_tokens, eos, settings[decoder], stats), stats

    prompt_ids = [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, held_out["question"].tolist(),
                                                                  cfg.prompts.system_prompt)]
    speed_prompts = min(b.speed_prompts, len(prompt_ids))
    timers, decoded = interleaved_decoding(decoders, prompt_ids[:speed_prompts], decode, b.max_new_tokens,
                                           "COrAL decoding")
    decoded = [{**r, "timed": True} for r in decoded]
    # accuracy alone on the other prompts: next-token batched (greedy either way; its speed was timed above), full
    # COrAL at batch 1 (its decoder has no batch dimension)
    rest = prompt_ids[speed_prompts:]
    batched = hf_decode(policy, [ids[0].tolist() for ids in rest], GREEDY, b.max_new_tokens, eos, batch_size=16)
    decoded += [{"prompt_index": i, "decoder": "next_token", "tokens": tokens, "stats": None, "timed": False}
                for i, tokens in enumerate(batched, start=speed_prompts)]
    for i, ids in enumerate(tqdm(rest, desc="COrAL accuracy", unit="prompt"), start=speed_prompts):
        tokens, stats = decode("coral", ids, b.max_new_tokens)
        decoded.append({"prompt_index": i, "decoder": "coral", "tokens": tokens, "stats": stats, "timed": False})
    records = []
    for r in decoded:
        stats, response = r["stats"], policy.tokenizer.decode(r["tokens"], skip_special_tokens=True)
        records.append({"prompt_index": r["prompt_index"], "decoder": r["decoder"], "timed": r["timed"],
                        "new_tokens": len(r["tokens"]), "forwards": stats.forwards if stats else len(r["tokens"]),
                        "forced": stats.forced if stats else 0,
                        "correct": is_correct(response, held_out["answer"].iloc[r["prompt_index"]],
                                              cut_by_length(r["tokens"], eos, b.max_new_tokens)),
                        "response": response})
    outputs = pd.DataFrame(records)
    rows = _coral_rows(outputs, settings, timers)
    logger.info("\n%s", markdown_table(rows, TABLE_COLUMNS))
    return _coral_report(cfg, outputs, rows, speed_prompts, time.perf_counter() - started)


def _accuracy_columns(correct: pd.Series, reference: pd.Series) -> dict:
    """``accuracy`` over a decoder's prompts with its interval; ``accuracy_vs_next_token``, the paired difference
    to next-token on the same prompts, with its interval; ``accuracy_significant``: that interval excludes 0.
    Both series are indexed by prompt; NaN without intervals unless every prompt has a known answer (None)."""
    if correct.isna().any():
        return {"accuracy": math.nan, "accuracy_vs_next_token": math.nan}
    values, reference = correct.astype(float).to_numpy(), reference.loc[correct.index].astype(float).to_numpy()
    difference = statistics.paired_difference(values, reference)
    return {**statistics.interval_columns("accuracy", statistics.mean_interval(values)),
            "accuracy_significant": difference.excludes(0.0),
            **statistics.interval_columns("accuracy_vs_next_token", difference)}


def _coral_rows(outputs: pd.DataFrame, settings: dict, timers: dict) -> list[dict]:
    """One row per decoder (next-token first): its settings; accuracy and tokens per forward (Σ tokens / Σ
    forwards) over the prompts it decoded (``prompts``: all of them for next-token and full COrAL, the speed
    prompts for the ablations), with intervals over those prompts; speed over the timed speed prompts, against
    next-token's on the same prompts (:func:`foresight.benchmark.speed_row`)."""
    reference = outputs[outputs["decoder"] == "next_token"].set_index("prompt_index")["correct"]
    rows = []
    for decoder in ["next_token", *settings]:
        mine = outputs[outputs["decoder"] == decoder].set_index("prompt_index").sort_index()
        s = settings.get(decoder)
        tokens_per_forward = statistics.ratio_of_sums(mine["new_tokens"].tolist(), mine["forwards"].tolist())
        timed_forwards = float(mine.loc[mine["timed"], "forwards"].sum())
        rows.append({"decoder": decoder, "verifier": s.verify if s else None,
                     "block_size": s.block_size if s else None, "forward_window": s.forward_window if s else 1,
                     **_accuracy_columns(mine["correct"], reference),
                     **speed_row(timers[decoder], timers["next_token"]),
                     **statistics.interval_columns("tokens_per_forward", tokens_per_forward),
                     "ms_per_forward": 1000 * timers[decoder].seconds / timed_forwards,
                     "forced_tokens": int(mine["forced"].sum()), "prompts": len(mine)})
    return rows


SPEEDUP = "× next-token tokens/s"
"""The y label of the speedup panels."""


def _coral_report(cfg: Config, outputs: pd.DataFrame, rows: list[dict], speed_prompts: int,
                  seconds: float) -> StageResult:
    """``benchmarks/coral``: every output, the table, its plots (ablations included) and the report."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "coral"
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(outputs, tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        # speedup and accuracy differ in units: one panel each
        bar_panels({SPEEDUP: {"speedup vs next-token": {r["decoder"]: interval_bar(r, "speedup_vs_reference")
                                                              for r in rows}},
                    "accuracy": {"accuracy": {r["decoder"]: interval_bar(r, "accuracy") for r in rows}}},
                   "COrAL decoders vs next-token greedy (batch 1, same run)", tmp / "table.png",
                   reference_lines={SPEEDUP: 1.0})
        _ablation_plots(rows, cfg.coral_benchmark, tmp)
        (tmp / "report.md").write_text(_report(rows, cfg, speed_prompts))
    metrics = {f"{r['decoder']}.{key}{end}": r[key + end] for r in rows
               for key in ("accuracy", "accuracy_vs_next_token", "tokens_per_s", "speedup_vs_reference",
                           "tokens_per_forward", "forced_tokens")
               for end in ("", "_low", "_high") if key + end in r}
    # what explains the decoders' accuracy: the trained offsets' held-out top-1 on task text (train_coral)
    evaluation = _offset_evaluation(cfg)
    metrics |= {f"offsets.{key}": value for key, value in (evaluation or {}).get("after_task", {}).items()}
    metrics["wall_seconds"] = seconds
    table_artifact(key="coral-benchmark", table=display_rows(rows, TABLE_COLUMNS),
                   description="COrAL decoders against next-token greedy (95 % intervals; * = differs significantly)")
    markdown_artifact(key="coral-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                      description="COrAL benchmark report")
    return StageResult(metrics=metrics, tables={"coral_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def _ablation_plots(rows: list[dict], b, folder) -> None:
    """Speedup and accuracy of COrAL w/o verifier per block size, then per forward window (the other knob fixed),
    with their intervals."""
    no_verifier = [r for r in rows if r["verifier"] is False]
    for knob, fixed, fixed_value in (("block_size", "forward_window", b.forward_window),
                                     ("forward_window", "block_size", b.block_size)):
        points = [r for _, r in sorted((r[knob], r) for r in no_verifier if r[fixed] == fixed_value)]
        xs = [r[knob] for r in points]
        # a line over the knob's values, its interval shaded; speedup and accuracy in panels of their own units
        line_panels({SPEEDUP: {"speedup vs next-token": (xs, [r["speedup_vs_reference"] for r in points])},
                     "accuracy": {"accuracy": (xs, [r["accuracy"] for r in points])}},
                    f"COrAL w/o verifier: {knob.replace('_', ' ')} ({fixed.replace('_', ' ')} {fixed_value})",
                    knob.replace("_", " "), folder / f"ablation_{knob}.png",
                    bands={"speedup vs next-token": interval_bands(points, "speedup_vs_reference"),
                           "accuracy": interval_bands(points, "accuracy")},
                    references={SPEEDUP: (1.0, "next-token speed")})


def _report(rows: list[dict], cfg: Config, speed_prompts: int) -> str:
    b = cfg.coral_benchmark
    lines = [
        "# COrAL benchmark (Table 1 shape)",
        f"\nOn the COrAL-trained model, max {b.max_new_tokens} new tokens. Accuracy: next-token and full COrAL on "
        f"{rows[0]['prompts']} held-out prompts; the first {speed_prompts} of them are decoded by every decoder (the "
        "ablations too) at batch 1, interleaved prompt by prompt, and timed: speed, and the ablations' accuracy, are "
        "over those (`prompts` says over how many a row's accuracy and tokens per forward are). "
        f"Full COrAL: block {b.block_size}, forward window {b.forward_window}, backward window {b.backward_window}, "
        f"ε {b.epsilon}, tree of {b.tree_size} nodes + the top-1 chain. Next-token = HF greedy with KV cache on the "
        "same model (batch 1 where timed, batches of 16 elsewhere). Speedup = tokens/s over next-token on the same "
        "prompts in the same run. `forced_tokens` = tokens the stall guard accepted. COrAL is lossy: accuracy is "
        "the quality measure. Speedup = tokens per forward × (next-token ms per forward / COrAL ms per forward): a "
        "COrAL forward scores a tree (or block) at every offset, so it must accept that many more tokens to pay off.\n",
        ("Brackets: 95 % bootstrap intervals over prompts (speedup: prompts resampled in pairs with next-token; "
         "tokens per forward: Σ tokens / Σ forwards). `*` = differs significantly from next-token: accuracy when the "
         "interval of its paired difference (`accuracy_vs_next_token`) excludes 0, speedup when its interval "
         "excludes 1.\n"),
        markdown_table(rows, TABLE_COLUMNS),
    ]
    e = _offset_evaluation(cfg)
    if e is not None:
        offsets = [key for key in e["after"] if f"{key}_low" in e["after"]]  # the figures with intervals
        lines += ["\n## Held-out top-1 accuracy per offset (train_coral): what the decoders' accuracy rests on\n",
                  f"Over the {e['num_eval_sequences']} held-out sequences, and the {e['num_eval_task_sequences']} of "
                  "task prompts (`_task`), with intervals over sequences (Σ hits / Σ targets). Forward +k: the token k "
                  "ahead on clean text (+1 = next-token); confirm k: the token k back on clean text (what verifying "
                  "a right block asks); reconstruct k: the clean token k back from a corrupted context (one fixed "
                  "corruption per sequence; its corrupted tokens only).\n",
                  markdown_table([{"when": when, **e[when]} for when in ("before", "after", "before_task", "after_task")],
                                 ["when", *offsets])]
    return "\n".join(lines) + "\n"


def _offset_evaluation(cfg: Config) -> dict | None:
    """``evaluation.json`` of the trained COrAL model (held-out top-1 per offset), or None if it has none."""
    path = cfg.path(cfg.paths.coral_dir) / "evaluation.json"
    return json.loads(path.read_text()) if path.is_file() else None
