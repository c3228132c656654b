"""Prefect tasks of the COrAL stages: two-stage order-agnostic training and the decoding benchmark.

Thin wrappers around :mod:`models.coral.training` and :mod:`models.coral.decoding`:

* ``train_coral`` — SFT data from the pipeline (the responses ``train_medusa`` distilled from, or the samples
  labeled correct), split by prompt; stage 1 (last layer) then stage 2 (the rest); held-out top-1 accuracy per
  forward offset before and after; the trained model as a Hugging Face folder, with per-offset curves. Under
  ``accelerate launch`` every process trains; the main process alone writes the folder.
* ``benchmark_coral`` — on that model, at batch 1 and prompt by prompt: next-token greedy (HF, KV cache),
  full COrAL, COrAL w/o verifier, COrAL w/o multi-forward (the paper's Table 1), and the block-size /
  forward-window ablations of the w/o-verifier decoder: accuracy, tokens/s, speedup, tokens per forward.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pandas as pd

from foresight.benchmark import interleaved_decoding, markdown_table, speed_row
from foresight.config import Config, component
from foresight.plots import bar_plot, line_plot
from foresight.storage import atomic_path, write_json, write_table
from tasks.data import (
    StageResult,
    gpu_task,
    load_stage_policy,
    load_trained_policy,
    markdown_artifact,
    read_prompts,
    sft_responses,
    split_responses,
    stage_accelerator,
    stage_logger,
    table_artifact,
)


@gpu_task("train-coral")
def train_coral_task(cfg: Config) -> StageResult:
    """Two-stage COrAL training of the base policy; writes the model folder with its curves and evaluation."""
    from models.common.sequences import sft_sequences
    from models.coral.config import CoralTraining
    from models.coral.training import offset_accuracy, train_coral

    logger = stage_logger()
    started = time.perf_counter()
    c = cfg.coral
    policy = load_stage_policy(cfg, "base")
    responses = sft_responses(cfg, cfg.coral.data, "coral.data")
    train_rows, eval_rows = split_responses(responses, c.eval_fraction, c.seed)
    sequences = sft_sequences(policy.tokenizer, responses, c.max_length)
    train, held_out = [sequences[i] for i in train_rows], [sequences[i] for i in eval_rows]
    logger.info("COrAL SFT data (%s): %d training / %d held-out sequences", c.data, len(train), len(held_out))
    before = offset_accuracy(policy, held_out, c.forward_window)
    logger.info("held-out top-1 per offset before training: %s", json.dumps(before))

    def on_step(stage: str, step: int, num_steps: int, stats: dict[str, float]) -> None:
        if step % max(1, num_steps // 5) == 0 or step == num_steps:
            logger.info("%s step %d/%d: loss %.4f (forward %.4f, backward %.4f)", stage, step, num_steps,
                        stats["loss"], stats["forward_loss"], stats.get("backward_loss", float("nan")))

    accelerator = stage_accelerator(policy, c.mixed_precision)
    train_started = time.perf_counter()
    history = train_coral(policy, train, component(CoralTraining, c), accelerator, on_step)
    train_seconds = time.perf_counter() - train_started
    after = offset_accuracy(policy, held_out, c.forward_window)
    logger.info("held-out top-1 per offset after training: %s", json.dumps(after))

    out = cfg.path(cfg.paths.coral_dir)
    if accelerator.is_main_process:  # every process holds the same model; one writes it
        _write_coral_model(policy, out, history, {"before": before, "after": after, "num_train_sequences": len(train),
                                                  "num_eval_sequences": len(held_out), "data": c.data})
    accelerator.wait_for_everyone()
    metrics = {"num_train_sequences": len(train), "num_eval_sequences": len(held_out), "train_seconds": train_seconds,
               "final_loss": history["loss"][-1] if history["loss"] else float("nan"),
               **{f"before_{k}": v for k, v in before.items()}, **{f"after_{k}": v for k, v in after.items()},
               "wall_seconds": time.perf_counter() - started}
    curves = {key: values for key, values in history.items() if key != "stage"}
    return StageResult(metrics=metrics, curves=curves, artifacts={"coral": out})


def _write_coral_model(policy, out, history: dict[str, list], evaluation: dict) -> None:
    """The trained model as a Hugging Face folder (in the policy's dtype), its evaluation, history and curves."""
    with atomic_path(out) as tmp:
        policy.model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
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
    """Name → :class:`models.coral.decoding.CoralDecoding` of every COrAL decoder the benchmark runs."""
    from models.coral.config import CoralDecoding

    b = cfg.coral_benchmark
    base = component(CoralDecoding, b, gamma=tuple(b.gamma))
    decoders = {"coral": base, "coral_no_verifier": replace(base, verify=False),
                "coral_no_multi_forward": replace(base, forward_window=1)}
    decoders |= {f"coral_no_verifier_b{size}": replace(base, verify=False, block_size=size)
                 for size in b.ablation_block_sizes if size != b.block_size}
    decoders |= {f"coral_no_verifier_kf{window}": replace(base, verify=False, forward_window=window)
                 for window in b.ablation_forward_windows if window != b.forward_window}
    return decoders


@gpu_task("benchmark-coral")
def benchmark_coral_task(cfg: Config) -> StageResult:
    """Next-token greedy vs the COrAL decoders on held-out prompts, at batch 1, on the COrAL-trained model."""
    from models.coral.decoding import CoralStats, coral_generate
    from models.engine.decoding import GREEDY, hf_decode
    from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
    from models.labeling.answers import is_correct

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
    timers, decoded = interleaved_decoding(decoders, prompt_ids, decode, b.max_new_tokens, "COrAL decoding")
    records = []
    for r in decoded:
        stats, response = r["stats"], policy.tokenizer.decode(r["tokens"], skip_special_tokens=True)
        records.append({"prompt_index": r["prompt_index"], "decoder": r["decoder"], "new_tokens": len(r["tokens"]),
                        "forwards": stats.forwards if stats else len(r["tokens"]),
                        "forced": stats.forced if stats else 0,
                        "correct": is_correct(response, held_out["answer"].iloc[r["prompt_index"]]),
                        "response": response})
    outputs = pd.DataFrame(records)
    rows = _coral_rows(outputs, settings, timers, len(prompt_ids))
    logger.info("\n%s", markdown_table(rows, TABLE_COLUMNS))
    return _coral_report(cfg, outputs, rows, time.perf_counter() - started)


def _coral_rows(outputs: pd.DataFrame, settings: dict, timers: dict, num_prompts: int) -> list[dict]:
    """One row per decoder (next-token first): its settings, accuracy, speed and tokens per forward."""
    # accuracy needs known answers (None = unknown): NaN otherwise
    accuracy = outputs.groupby("decoder")["correct"].agg(lambda c: c.astype(float).mean() if c.notna().all() else float("nan"))
    rows = []
    for decoder in ["next_token", *settings]:
        mine = outputs[outputs["decoder"] == decoder]
        s = settings.get(decoder)
        rows.append({"decoder": decoder, "verifier": s.verify if s else None,
                     "block_size": s.block_size if s else None, "forward_window": s.forward_window if s else 1,
                     "accuracy": float(accuracy[decoder]),
                     "accuracy_vs_next_token": float(accuracy[decoder] - accuracy["next_token"]),
                     **speed_row(timers[decoder], timers["next_token"]),
                     "tokens_per_forward": float(mine["new_tokens"].sum() / mine["forwards"].sum()),
                     "ms_per_forward": 1000 * timers[decoder].seconds / float(mine["forwards"].sum()),
                     "forced_tokens": int(mine["forced"].sum()), "prompts": num_prompts})
    return rows


def _coral_report(cfg: Config, outputs: pd.DataFrame, rows: list[dict], seconds: float) -> StageResult:
    """``benchmarks/coral``: every output, the table, its plots (ablations included) and the report."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "coral"
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(outputs, tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        bar_plot({"speedup vs next-token": {r["decoder"]: r["speedup_vs_reference"] for r in rows},
                  "accuracy": {r["decoder"]: r["accuracy"] for r in rows}},
                 "COrAL decoders vs next-token greedy (batch 1, same run)", "value", tmp / "table.png",
                 reference_line=1.0)
        _ablation_plots(rows, cfg.coral_benchmark, tmp)
        (tmp / "report.md").write_text(_report(rows, cfg))
    metrics = {f"{r['decoder']}.{key}": r[key] for r in rows
               for key in ("accuracy", "tokens_per_s", "speedup_vs_reference", "tokens_per_forward")}
    metrics["wall_seconds"] = seconds
    table_artifact(key="coral-benchmark", table=[{c: r[c] for c in TABLE_COLUMNS} for r in rows],
                          description="COrAL decoders against next-token greedy at batch 1")
    markdown_artifact(key="coral-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                             description="COrAL benchmark report")
    return StageResult(metrics=metrics, tables={"coral_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def _ablation_plots(rows: list[dict], b, folder) -> None:
    """Speedup and accuracy of COrAL w/o verifier against block size, then forward window (the other knob fixed)."""
    no_verifier = [r for r in rows if r["verifier"] is False]
    for knob, fixed, fixed_value in (("block_size", "forward_window", b.forward_window),
                                     ("forward_window", "block_size", b.block_size)):
        points = sorted((r[knob], r) for r in no_verifier if r[fixed] == fixed_value)
        line_plot({label: ([x for x, _ in points], [r[metric] for _, r in points])
                   for label, metric in (("speedup × next-token", "speedup_vs_reference"), ("accuracy", "accuracy"))},
                  f"COrAL w/o verifier: {knob.replace('_', ' ')} ({fixed.replace('_', ' ')} {fixed_value})",
                  knob.replace("_", " "), "value", folder / f"ablation_{knob}.png", reference=(1.0, "next-token speed"))


def _report(rows: list[dict], cfg: Config) -> str:
    b = cfg.coral_benchmark
    evaluation = cfg.path(cfg.paths.coral_dir) / "evaluation.json"
    lines = [
        "# COrAL benchmark (Table 1 shape)",
        f"\nBatch 1, {rows[0]['prompts']} held-out prompts, max {b.max_new_tokens} new tokens, on the COrAL-trained model. "
        f"Full COrAL: block {b.block_size}, forward window {b.forward_window}, backward window {b.backward_window}, "
        f"ε {b.epsilon}, tree of {b.tree_size} nodes + the top-1 chain. Next-token = HF greedy with KV cache on the "
        "same model. Speedup = tokens/s over next-token, measured prompt by prompt in the same run. "
        "`forced_tokens` = tokens the stall guard accepted. COrAL is lossy: accuracy is the quality measure. "
        "Speedup = tokens per forward × (next-token ms per forward / COrAL ms per forward): a COrAL forward scores "
        "a tree (or block) at every offset, so it must accept that many more tokens to pay off.\n",
        markdown_table(rows, TABLE_COLUMNS),
    ]
    if evaluation.is_file():
        e = json.loads(evaluation.read_text())
        lines += ["\n## Held-out top-1 accuracy per forward offset (train_coral)\n",
                  markdown_table([{"when": when, **e[when]} for when in ("before", "after")])]
    return "\n".join(lines) + "\n"
