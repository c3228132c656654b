"""Prefect tasks of the SLA stages (Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward";
docs/sla.md): the Reward Transformer's reward channel and its adapter baselines, DPO, and the decoder benchmark.

* ``train_reward`` / ``train_reward_dpo`` — on the frozen policy (the base policy or the DPO-tuned one), the
  reward channel and one final-state adapter per configured depth, on the same training pairs with the same
  schedule, compared on the same held-out pairs (pair accuracy, token-level reward curve, AuTRC): the
  paper's Figure 4 ablation.
* ``dpo`` — the base policy fine-tuned with DPO on the same training pairs (the shared
  :func:`foresight.pairs.split_pairs` split with ``reward.eval_fraction`` / ``reward.seed``), so the held-out
  pairs are unseen by both and "SLA on top of DPO" is a fair comparison. The held-out preference accuracy of
  DPO's implicit reward is reported before (policy = reference: every margin is 0, so 0.5) and after training.
* ``benchmark_sla`` — the paper's decoder comparison (Table 1, Figure 3) on held-out prompts. For the base and
  the DPO policy, each with its own trained reward channel: greedy, temperature, top-p, top-k, beam search and
  SLA. Quality is judged by the configured labeler (win/tie/loss against base greedy, win rate = win + tie/2,
  mean reward, accuracy where answers are known), plus the paper's extra row "DPO + SLA vs DPO + greedy".
  Speed is measured in the same run at batch 1: tokens/s and per-token latency of each decoder relative to
  greedy, and the reward channel's forward overhead.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from foresight.benchmark import (
    DecodeTimer,
    markdown_table,
    speed_row,
    synchronize,
    win_tie_loss,
)
from foresight.config import Config, component
from foresight.pairs import split_pairs
from foresight.plots import bar_plot, line_plot
from foresight.storage import atomic_path, read_table, write_table
from models.sla.config import SLASearch
from tasks.data import (
    StageResult,
    gpu_task,
    load_stage_policy,
    markdown_artifact,
    read_prompts,
    stage_accelerator,
    stage_logger,
    table_artifact,
)


def plot_reward_curves(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path) -> Path:
    """One token-level reward curve per head (Figure 4 of the SLA paper), AuTRC in the legend."""
    from models.sla.reward_training import autrc

    series = {f"{name} (AuTRC {autrc(xs, accuracies):.3f})": ([100 * x for x in xs], accuracies)
              for name, (xs, accuracies) in curves.items()}
    return line_plot(series, "Token-level reward curve", "share of the response read (%)",
                     "held-out accuracy of\nR'(chosen prefix) > R'(rejected prefix)", path,
                     reference=(0.5, "chance"), ylim=(0, 1))


def plot_losses(histories: dict[str, dict[str, list[float]]], path: Path) -> Path:
    """Training loss per optimizer step of each head; ln 2 marks an untrained (indifferent) head."""
    series = {name: (range(1, len(h["loss"]) + 1), h["loss"]) for name, h in histories.items()}
    return line_plot(series, "Reward-head training", "optimizer step", "Bradley–Terry loss (eq. 17)", path,
                     reference=(math.log(2), "ln 2 (margin 0)"))


def _metric_key(head_name: str) -> str:
    """``adapter-4`` → ``adapter4``: metric names without dashes (``pair_accuracy_adapter4``)."""
    return head_name.replace("-", "")


@gpu_task("train-reward")
def train_reward_task(cfg: Config, policy_source: str, out_dir: Path) -> StageResult:
    """Train the reward channel and the adapter baselines on ``policy_source`` (``base`` or ``dpo``), jointly
    (one policy forward per batch feeds every head).

    Writes into ``out_dir``, all or nothing: one head folder per model (``channel/``, ``adapter-1/``, …,
    loadable with ``RewardTransformer.from_head``), ``curves.json`` (held-out metrics and the
    token-level reward curve of each head), ``history.json`` (training losses), ``autrc.png``, ``loss.png``.

    Under ``accelerate launch`` every process runs this task: batches are split between them, each evaluates
    the (identical) trained heads, and only the main process writes.
    """
    from models.sla.config import RewardTraining
    from models.sla.reward_training import evaluate_reward_head, train_reward_heads
    from models.sla.reward_transformer import RewardHeadConfig

    logger = stage_logger()
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
    training = component(RewardTraining, cfg.reward)
    models, histories = train_reward_heads(policy, train_pairs, training, heads, accelerator, on_step)
    metrics["train_seconds"] = time.perf_counter() - train_started
    curves: dict[str, dict] = {}
    for name, model in models.items():  # every process evaluates (a small held-out set): all return the metrics
        curves[name] = evaluation = evaluate_reward_head(model, policy.tokenizer, held_out, training)
        key = _metric_key(name)
        metrics |= {
            f"pair_accuracy_{key}": evaluation["pair_accuracy"],
            f"autrc_{key}": evaluation["autrc"],
            f"train_pair_accuracy_{key}": histories[name]["train_pair_accuracy"][-1],
            f"final_loss_{key}": histories[name]["loss"][-1],
            f"{key}_params": sum(p.numel() for p in model.head.parameters()),
        }
        logger.info("%s: held-out pair accuracy %.3f, AuTRC %.3f (%d params)", name,
                    evaluation["pair_accuracy"], evaluation["autrc"], metrics[f"{key}_params"])
    if accelerator.is_main_process:
        _write_reward_heads(Path(out_dir), models, curves, histories)
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    metrics["wall_seconds"] = time.perf_counter() - started
    return StageResult(metrics=metrics, artifacts={"reward": Path(out_dir)})


def _write_reward_heads(out_dir: Path, models: dict, curves: dict[str, dict],
                        histories: dict[str, dict[str, list[float]]]) -> None:
    """One head folder per model, the curves, the histories and their plots into ``out_dir``, whole or not at all."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for name, model in models.items():
            model.save_head(tmp / name)
        (tmp / "curves.json").write_text(json.dumps(curves, indent=2) + "\n")
        (tmp / "history.json").write_text(json.dumps(histories, indent=2) + "\n")
        plot_reward_curves({name: (c["x"], c["accuracy"]) for name, c in curves.items()}, tmp / "autrc.png")
        plot_losses(histories, tmp / "loss.png")


@gpu_task("train-dpo")
def dpo_task(cfg: Config) -> StageResult:
    """Train the DPO policy into ``paths.dpo_dir`` (atomically) and evaluate it on the held-out pairs."""
    from models.sla.config import DPOTraining
    from models.sla.dpo import preference_accuracy, train_dpo

    logger = stage_logger()
    started = time.perf_counter()
    pairs = read_table(cfg.path(cfg.paths.pairs), "pairs")
    train_pairs, held_out = split_pairs(pairs, cfg.reward.eval_fraction, cfg.reward.seed)
    policy = load_stage_policy(cfg, "base")
    training = component(DPOTraining, cfg.dpo)
    logger.info("DPO on %d pairs (%d held out) on %s, beta=%g", len(train_pairs), len(held_out), policy.device,
                training.beta)
    metrics = train_dpo(policy, train_pairs, training, cfg.path(cfg.paths.dpo_dir))

    # The saved folder is what later stages load, so that is what gets evaluated; the untouched base
    # policy is the reference.
    tuned = load_stage_policy(cfg, "dpo")
    evaluate = dict(tokenizer=policy.tokenizer, pairs=held_out, beta=training.beta, max_length=training.max_length)
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


TABLE_COLUMNS = ["policy", "decoder", "versus", "win", "tie", "loss", "win_rate", "mean_reward", "accuracy",
                 "tokens_per_s", "ms_per_token", "latency_vs_reference"]


def _load(cfg: Config, which: str):
    """(policy, reward transformer) for ``base`` or ``dpo``, each with the reward head trained on it."""
    from models.sla.reward_transformer import RewardTransformer

    policy = load_stage_policy(cfg, which)
    head = cfg.path(cfg.paths.reward_dir) / which / "channel"
    return policy, RewardTransformer.from_head(policy.model, head).eval()


@torch.no_grad()
def forward_overhead(reward_model, input_ids: torch.Tensor, repeats: int = 5) -> dict:
    """Wall time of one forward of the policy alone vs the policy + reward channel (median of repeats).

    Both ask for hidden states off/on and for the last position's logits, as they would in use: the policy
    alone does not need the states. CUDA runs kernels asynchronously, so each timing starts and ends with
    ``synchronize()`` (else it measures the launches, not the forward).
    """
    def median_time(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            synchronize()
            started = time.perf_counter()
            fn()
            synchronize()
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]

    policy_s = median_time(lambda: reward_model.policy(input_ids=input_ids, logits_to_keep=1))
    joint_s = median_time(lambda: reward_model(input_ids=input_ids, logits_to_keep=1))
    return {"policy_forward_ms": 1000 * policy_s, "reward_transformer_forward_ms": 1000 * joint_s,
            "reward_channel_overhead": joint_s / policy_s - 1}


def _decode_all(cfg: Config, which: str, questions: list[str], sla_settings: dict[str, SLASearch],
                time_sampling: bool) -> tuple[list[dict], dict]:
    """Every decoder on every question for one policy (chat template of its own tokenizer); returns output
    records and speed/overhead stats (the sampling decoders are timed only if ``time_sampling``)."""
    from models.engine.config import HF_DECODERS, ClassicalDecoding
    from models.engine.decoding import generate_kwargs, hf_decode
    from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
    from models.sla.search import sla_generate

    b = cfg.sla_benchmark
    classical = component(ClassicalDecoding, b)
    policy, reward_model = _load(cfg, which)
    eos = end_token_ids(policy)
    prompt_ids = [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, questions, cfg.prompts.system_prompt)]
    records, timers = [], {}

    def record(decoder: str, i: int, tokens: list[int]) -> None:
        records.append({"policy": which, "decoder": decoder, "prompt_index": i, "new_tokens": len(tokens),
                        "response": policy.tokenizer.decode(tokens, skip_special_tokens=True).strip()})

    # Quality: the classical decoders (greedy included) in batches of sla_benchmark.batch_size prompts (all
    # prompts at once would not fit at 8B: beam search holds num_beams rows per prompt); SLA at batch 1.
    plain = [ids[0].tolist() for ids in prompt_ids]
    for decoder in ("greedy", *(d for d in b.decoders if d in HF_DECODERS and d != "greedy")):
        outputs = hf_decode(policy, plain, generate_kwargs(decoder, classical), b.max_new_tokens, eos,
                            batch_size=b.batch_size, seed=b.seed)
        for i, tokens in enumerate(outputs):
            record(decoder, i, tokens)
    for name, sla_cfg in sla_settings.items():
        timer = timers[name] = DecodeTimer()
        for i, ids in enumerate(tqdm(prompt_ids, desc=f"{which} {name}", unit="prompt")):
            timed = i < b.speed_prompts
            with timer if timed else contextlib.nullcontext():
                tokens, _ = sla_generate(reward_model, ids, sla_cfg, b.max_new_tokens, eos)
            if timed:
                timer.add_tokens(len(tokens))
            record(name, i, tokens)
    # Speed at batch 1 on the first prompts: HF greedy on the policy alone (the reference SLA is an
    # alternative to), and the sampling decoders where asked (same architecture for both policies: once).
    timed_decoders = ["greedy"] + [d for d in b.decoders if d in HF_DECODERS and d != "greedy" and time_sampling]
    for decoder in timed_decoders:
        timer = timers["hf_greedy" if decoder == "greedy" else decoder] = DecodeTimer()
        for i, ids in enumerate(plain[: b.speed_prompts]):
            with timer:
                (tokens,) = hf_decode(policy, [ids], generate_kwargs(decoder, classical), b.max_new_tokens, eos,
                                      batch_size=1, seed=b.seed + i)
            timer.add_tokens(len(tokens))
    overhead = forward_overhead(reward_model, prompt_ids[0])
    return records, {"timers": timers, "overhead": overhead}


def _sla_settings(cfg: Config) -> dict[str, SLASearch]:
    """The main SLA setting plus the optional sweep (Figure 3: vary one of d, k, n at a time)."""
    main = component(SLASearch, cfg.sla)
    settings = {"sla": main} if "sla" in cfg.sla_benchmark.decoders else {}
    for field, values in (("depth", cfg.sla_benchmark.sweep_depth), ("width", cfg.sla_benchmark.sweep_width),
                          ("step", cfg.sla_benchmark.sweep_step)):
        for value in values:
            variant = replace(main, **{field: value})
            settings[f"sla_d{variant.depth}_k{variant.width}_n{variant.step}"] = variant
    return settings


def _table(outputs: pd.DataFrame, speed: dict) -> list[dict]:
    """Table 1: each (policy, decoder) against base greedy, plus DPO+SLA against DPO+greedy."""
    # in decoding order: greedy, SLA, then the classical decoders as configured
    by = {key: group.sort_values("prompt_index") for key, group in outputs.groupby(["policy", "decoder"], sort=False)}
    reference = by[("base", "greedy")]["score"].tolist()
    rows = []
    comparisons = [(p, d, ("base", "greedy")) for (p, d) in by]
    if ("dpo", "sla") in by and ("dpo", "greedy") in by:
        comparisons.append(("dpo", "sla", ("dpo", "greedy")))
    for policy, decoder, versus in comparisons:
        group = by[(policy, decoder)]
        versus_scores = reference if versus == ("base", "greedy") else by[versus]["score"].tolist()
        row = {"policy": policy, "decoder": decoder, "versus": "+".join(versus),
               **win_tie_loss(group["score"].tolist(), versus_scores),
               "mean_reward": float(group["score"].mean()),
               "accuracy": float(group["correct"].astype(float).mean()) if group["correct"].notna().all() else float("nan")}
        timers = speed[policy]["timers"]
        if decoder in timers:
            row.update(speed_row(timers[decoder], timers["hf_greedy"]))
        rows.append(row)
    return rows


@gpu_task("benchmark-sla")
def benchmark_sla_task(cfg: Config) -> StageResult:
    """Decode the held-out prompts with every decoder for the base and the DPO policy; score; compare."""
    logger = stage_logger()
    started = time.perf_counter()
    b = cfg.sla_benchmark
    held_out = read_prompts(cfg, "eval").head(b.num_prompts)
    if held_out.empty:
        raise ValueError("no held-out prompts: set prompts.num_eval > 0")
    questions = held_out["question"].tolist()
    settings = _sla_settings(cfg)
    records, speed = [], {}
    for which in ("base", "dpo"):
        logger.info("decoding %d held-out prompts with the %s policy", len(questions), which)
        policy_records, speed[which] = _decode_all(cfg, which, questions, settings if which == "base" else
                                                   {k: v for k, v in settings.items() if k == "sla"},
                                                   time_sampling=which == "base")
        records += policy_records
    outputs = _scored(pd.DataFrame(records), held_out, cfg)
    rows = _table(outputs[~outputs["decoder"].str.startswith("sla_")], speed)
    sweep_rows = _table(outputs[outputs["policy"] == "base"], speed) if len(settings) > 1 else []
    out_dir = _write_benchmark(cfg, outputs, rows, sweep_rows, speed)
    metrics = _metrics(rows, speed)
    metrics["benchmark_seconds"] = time.perf_counter() - started
    logger.info("\n%s", markdown_table(rows, TABLE_COLUMNS))
    table_artifact(key="sla-benchmark", table=[{c: _json_cell(row.get(c)) for c in TABLE_COLUMNS} for row in rows],
                          description="Decoders against greedy (the SLA paper's Table 1)")
    markdown_artifact(key="sla-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                             description="SLA benchmark report")
    return StageResult(metrics=metrics, tables={"sla_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def _scored(outputs: pd.DataFrame, held_out: pd.DataFrame, cfg: Config) -> pd.DataFrame:
    """The decoded outputs with their question, known answer, the labeler's score and correctness."""
    from models.labeling.answers import is_correct
    from models.labeling.config import LabelerSpec
    from models.labeling.labelers import build_labeler

    answers = [None if pd.isna(a) else a for a in held_out["answer"]]
    outputs["question"] = [held_out["question"].iloc[i] for i in outputs["prompt_index"]]
    outputs["answer"] = [answers[i] for i in outputs["prompt_index"]]
    labeler = build_labeler(component(LabelerSpec, cfg.label))
    outputs["score"] = labeler.score(outputs["question"].tolist(), outputs["response"].tolist(),
                                     outputs["answer"].tolist())
    outputs["correct"] = pd.array([is_correct(r, a) for r, a in zip(outputs["response"], outputs["answer"])],
                                  dtype="boolean")
    return outputs


def _write_benchmark(cfg: Config, outputs: pd.DataFrame, rows: list[dict], sweep_rows: list[dict],
                     speed: dict) -> Path:
    """Outputs, table, plots and report into ``benchmarks_dir/sla``, whole or not at all; returns the folder."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "sla"
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_table(outputs, tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        bar_plot({p: {r["decoder"]: r["win_rate"] for r in rows if r["policy"] == p and r["versus"] == "base+greedy"}
                  for p in ("base", "dpo")}, "Win rate against base greedy (win + tie/2)", "win rate",
                 tmp / "win_rate.png", reference_line=0.5)
        bar_plot({p: {r["decoder"]: r["latency_vs_reference"] for r in rows if r["policy"] == p and "latency_vs_reference" in r}
                  for p in ("base", "dpo")}, "Per-token latency relative to greedy (batch 1)", "× greedy",
                 tmp / "latency.png", reference_line=1.0)
        if sweep_rows:
            bar_plot({"base": {r["decoder"]: r["win_rate"] for r in sweep_rows if r["decoder"].startswith("sla")}},
                     "SLA settings (Figure 3): win rate against greedy", "win rate", tmp / "sweep.png", 0.5)
        (tmp / "report.md").write_text(_report(rows, sweep_rows, speed, cfg))
    return out_dir


def _json_cell(value):
    """NaN (e.g. accuracy without known answers) as null: artifacts are JSON."""
    return None if isinstance(value, float) and value != value else value


def _metrics(rows: list[dict], speed: dict) -> dict:
    metrics = {}
    for r in rows:
        key = f"{r['policy']}_{r['decoder']}" + ("_vs_dpo_greedy" if r["versus"] == "dpo+greedy" else "")
        metrics[f"{key}.win_rate"] = r["win_rate"]
        metrics[f"{key}.accuracy"] = r["accuracy"]
        if "latency_vs_reference" in r:
            metrics[f"{key}.latency_vs_greedy"] = r["latency_vs_reference"]
    for which, s in speed.items():
        metrics[f"{which}.reward_channel_overhead"] = s["overhead"]["reward_channel_overhead"]
        metrics[f"{which}.greedy_tokens_per_s"] = s["timers"]["hf_greedy"].tokens_per_s
    return metrics


def _report(rows: list[dict], sweep_rows: list[dict], speed: dict, cfg: Config) -> str:
    s = cfg.sla
    lines = [
        "# SLA benchmark (the shape of the SLA paper's Table 1)",
        f"\n{cfg.sla_benchmark.num_prompts} held-out prompts, max {cfg.sla_benchmark.max_new_tokens} new tokens, "
        f"labeler `{cfg.label.labeler}`, SLA(d={s.depth}, k={s.width}, n={s.step}). Win rate = win + tie/2 "
        "against the row's reference; speed at batch 1 on the first "
        f"{cfg.sla_benchmark.speed_prompts} prompts, latency relative to HF greedy on the same policy.\n",
        markdown_table(rows, TABLE_COLUMNS),
        "\n## Reward channel overhead (one forward over the first prompt)\n",
        markdown_table([{"policy": w, **v["overhead"]} for w, v in speed.items()]),
    ]
    if sweep_rows:
        lines += ["\n## SLA sweep (base policy, against base greedy)\n",
                  markdown_table([r for r in sweep_rows if r["decoder"].startswith("sla")], TABLE_COLUMNS)]
    return "\n".join(lines) + "\n"
