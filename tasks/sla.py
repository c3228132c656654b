"""Prefect tasks of the SLA stages (Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward";
docs/sla.md): the Reward Transformer's reward channel and its adapter baselines, DPO, and the decoder benchmark.

* ``train_reward`` / ``train_reward_dpo`` — on the frozen policy (the base policy or the DPO-tuned one), the
  reward channel and one final-state adapter per configured depth, on the same training pairs with the same
  schedule, compared on the same held-out pairs (pair accuracy, token-level reward curve, AuTRC, with 95 %
  intervals over the held-out prompts): the paper's Figure 4 ablation.
* ``dpo`` — the base policy fine-tuned with DPO on the same training pairs (the shared
  :func:`foresight.pairs.split_pairs` split with ``reward.eval_fraction`` / ``reward.seed``; one pair per
  prompt unless ``dpo.pairs: all``), so the held-out pairs are unseen by both and "SLA on top of DPO" is a fair
  comparison. The held-out preference accuracy of DPO's implicit reward is reported before (policy =
  reference: every margin is 0, so 0.5) and after training, with its interval.
* ``benchmark_sla`` — the paper's decoder comparison (Table 1, Figure 3) on held-out prompts. For the base
  policy greedy, temperature, top-p, top-k, beam search and SLA, for the DPO policy greedy and SLA
  (``sla_benchmark.dpo_decoders``), each policy with its own trained reward channel. Quality is judged by the
  configured labeler (win/tie/loss against base greedy, win rate = win + tie/2, mean reward, accuracy where
  answers are known), plus the paper's extra rows "DPO + SLA vs DPO + greedy". SLA runs at the paper's setting
  (``sla``) and at ours (``sla_tuned``: the streaming setting of ``sla_benchmark.tuning_grid`` with the best win
  rate on training prompts nothing trained on, never on the held-out ones), plus ours with the other leaf score
  (the ablation). Speed is measured in the same run at batch 1, every decoder in turn prompt by prompt: tokens/s
  and per-token latency relative to greedy, and the reward channel's forward overhead. Every figure carries a 95 % interval (:mod:`foresight.statistics`)
  and ``*`` where it differs significantly from its reference.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from foresight import statistics
from foresight.benchmark import (
    cell,
    display_rows,
    interleaved_decoding,
    markdown_table,
    speed_row,
    synchronize,
    win_tie_loss,
)
from foresight.pairs import split_pairs
from foresight.plots import bar_plot, interval_bar, line_plot
from foresight.storage import atomic_path, read_table, write_table
from models.common.sequences import padding_id
from models.engine.decoding import generate_kwargs, hf_decode
from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
from models.engine.kv_cache import cache_kwargs, returned_cache
from models.labeling.answers import cut_by_length, is_correct
from models.labeling.labelers import build_labeler
from models.sla.config import SLASearch
from models.sla.dpo import fitting_pairs as fitting_dpo_pairs, pair_logps, preference_accuracy, train_dpo
from models.sla.reward_training import (
    LOGPROB,
    evaluate_reward_heads,
    fitting_pairs as fitting_reward_pairs,
    pair_wins,
    score_pairs,
    train_reward_heads,
)
from models.sla.reward_transformer import RewardHeadConfig, RewardTransformer
from models.sla.search import sla_generate, sla_generate_batch
from tasks.common import (
    StageResult,
    gpu_task,
    live_curves,
    load_stage_policy,
    markdown_artifact,
    read_prompts,
    reference_answers,
    stage_accelerator,
    stage_logger,
    table_artifact,
)

if TYPE_CHECKING:
    from foresight.config import Config


def plot_reward_curves(curves: dict[str, dict], path: Path) -> Path:
    """One token-level reward curve per head (Figure 4 of the SLA paper; ``curves[head]`` as in ``curves.json``),
    AuTRC and its 95 % interval in the legend."""
    series = {f"{name} (AuTRC {cell(c, 'autrc')})": ([100 * x for x in c["x"]], c["accuracy"])
              for name, c in curves.items()}
    return line_plot(series, "Token-level reward curve", "share of the response read (%)",
                     "held-out accuracy of\nR'(chosen prefix) > R'(rejected prefix)", path,
                     reference=(0.5, "chance"), ylim=(0, 1))


def plot_losses(histories: dict[str, dict[str, list[float]]], path: Path) -> Path:
    """Training loss per optimizer step of each head; ln 2 marks an untrained (indifferent) head."""
    series = {name: (range(1, len(h["loss"]) + 1), h["loss"]) for name, h in histories.items()}
    return line_plot(series, "Reward-head training", "optimizer step", "Bradley–Terry loss (eq. 17)", path,
                     reference=(math.log(2), "ln 2 (margin 0)"))


def with_intervals(evaluation: dict, prompt_ids: Sequence[str], per_pair: dict[str, str]) -> dict:
    """``evaluation`` with 95 % intervals for the figures that average per-pair values (``per_pair[figure]`` names
    the list, which is dropped), resampling prompts: the pairs of one prompt share its responses, so they are not
    independent (a cluster bootstrap). ``*_significant``: the interval excludes chance (0.5)."""
    result = {k: v for k, v in evaluation.items() if k not in per_pair.values()}
    for figure, values in per_pair.items():
        result |= statistics.interval_columns(
            figure, statistics.clustered_mean_interval(evaluation[values], prompt_ids), reference=0.5)
    return result | {"num_pairs": len(prompt_ids), "num_prompts": len(set(prompt_ids))}


def _interval_metrics(row: dict, column: str, key: str) -> dict:
    """``key``, ``key_low``, ``key_high`` (and ``key_significant``) from a row's ``column`` and its interval."""
    return {key + suffix: row[column + suffix] for suffix in ("", "_low", "_high", "_significant")
            if column + suffix in row}


def _metric_key(head_name: str) -> str:
    """``adapter-4`` → ``adapter4``: metric names without dashes (``pair_accuracy_adapter4``)."""
    return head_name.replace("-", "")


SPLIT_FILE = "split.json"
"""In a reward folder: the prompt ids of the pairs the heads trained on (DPO trains on the same split) and held out."""


@gpu_task("train-reward")
def train_reward_task(cfg: Config, policy_source: str, out_dir: Path) -> StageResult:
    """Train the reward channel and the adapter baselines on ``policy_source`` (``base`` or ``dpo``), jointly
    (one policy forward per batch feeds every head).

    Writes into ``out_dir``, all or nothing: one head folder per model (``channel/``, ``adapter-1/``, …,
    loadable with ``RewardTransformer.from_head``), ``curves.json`` (held-out metrics and the
    token-level reward curve of each head), ``history.json`` (training losses), ``split.json`` (the prompts
    trained on and held out), ``autrc.png``, ``loss.png``. Beside the heads, the policy's own mean token log-prob
    ranks the same held-out pairs (``pair_accuracy_logprob``): the baseline a reward head has to beat.

    Under ``accelerate launch`` every process runs this task: batches are split between them, each evaluates
    the (identical) trained heads, and only the main process writes.
    """
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
    # The policy stays frozen (only the heads learn, nothing back-propagates into it), so it runs in its decoding
    # dtype: the heads learn on the very states SLA decoding will feed them (bf16 on a CPU with bf16 units: 1.9 s a
    # step instead of 2.7 s in float32 on the 2-core CPU), with float32 master weights (models/common/training.py)
    policy = load_stage_policy(cfg, policy_source)
    accelerator = stage_accelerator(policy.device, gradient_accumulation_steps=cfg.reward.gradient_accumulation_steps)
    # pairs too long for reward.max_length are dropped whole, never truncated (models/common/sequences.py)
    split = _prompt_split(train_pairs, held_out)  # split_pairs' prompts: the benchmark never tunes on these
    (train_pairs, train_too_long), (held_out, eval_too_long) = (
        fitting_reward_pairs(policy.tokenizer, side, cfg.reward.max_length) for side in (train_pairs, held_out))
    if train_too_long or eval_too_long:
        logger.warning("dropped %d training and %d held-out pairs longer than reward.max_length %d tokens",
                       train_too_long, eval_too_long, cfg.reward.max_length)
    if train_pairs.empty or held_out.empty:
        raise ValueError(f"no {'training' if train_pairs.empty else 'held-out'} pair fits reward.max_length "
                         f"{cfg.reward.max_length} tokens: raise it to the longest prompt + response + end token")

    heads = {"channel": RewardHeadConfig(kind="channel", hidden_size=cfg.reward.hidden_size)}
    # §5.3's adapters are as wide as the policy: "4K" parameters for 1 layer and 50.3M for 4 layers on
    # Llama-3-8B are exactly d + 1 and 3·(d² + d) + d + 1 with d = 4096 (reward.hidden_size is the channel's)
    heads |= {f"adapter-{layers}": RewardHeadConfig(kind="adapter", hidden_size=policy.model.config.hidden_size,
                                                    adapter_layers=layers)
              for layers in cfg.reward.adapter_layers}
    logger.info("training %s on the %s policy (%s): %d train / %d held-out pairs", ", ".join(heads), policy_source,
                policy.device, len(train_pairs), len(held_out))

    metrics: dict = {"num_train_pairs": len(train_pairs), "num_eval_pairs": len(held_out),
                     "num_train_pairs_dropped_too_long": train_too_long,
                     "num_eval_pairs_dropped_too_long": eval_too_long}

    def on_step(step: int, num_steps: int, losses: dict[str, float]) -> None:
        if step % max(1, num_steps // 10) == 0 or step == num_steps:
            logger.info("step %d/%d, loss %s", step, num_steps, ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))

    train_started = time.perf_counter()
    with live_curves(cfg, {name: f"{_metric_key(name)}.loss" for name in heads}.get):  # each head's step loss
        models, histories = train_reward_heads(policy, train_pairs, cfg.reward, heads, accelerator, on_step)
    metrics["train_seconds"] = time.perf_counter() - train_started
    # all heads train together: the share of their elements that changed, as saved (models/common/training.py)
    metrics["weights_changed"] = next(iter(histories.values()))["weights_changed"][0]
    curves: dict[str, dict] = {}
    prompt_ids = held_out["prompt_id"].tolist()
    # every process evaluates (a small held-out set), all heads in one pass: all return the metrics
    evaluations = evaluate_reward_heads(models, policy.tokenizer, held_out, cfg.reward, logprobs=True)
    for name, model in models.items():
        curves[name] = evaluation = with_intervals(evaluations[name], prompt_ids,
                                                   {"pair_accuracy": "pair_correct", "autrc": "pair_autrc"})
        key = _metric_key(name)
        metrics |= {
            **_interval_metrics(evaluation, "pair_accuracy", f"pair_accuracy_{key}"),
            **_interval_metrics(evaluation, "autrc", f"autrc_{key}"),
            f"train_pair_accuracy_{key}": histories[name]["train_pair_accuracy"][-1],
            f"final_loss_{key}": histories[name]["loss"][-1],
            f"{key}_params": sum(p.numel() for p in model.head.parameters()),
        }
        logger.info("%s: held-out pair accuracy %s, AuTRC %s (95 %% intervals over %d pairs of %d prompts; "
                    "* = differs from chance); %d params", name, cell(evaluation, "pair_accuracy"),
                    cell(evaluation, "autrc"), evaluation["num_pairs"], evaluation["num_prompts"],
                    metrics[f"{key}_params"])
    # the ranker every head has to beat: the policy's own mean token log-prob, on the same held-out (on-policy) pairs
    logprob = with_intervals(evaluations[LOGPROB], prompt_ids, {"pair_accuracy": "pair_correct"})
    metrics |= _interval_metrics(logprob, "pair_accuracy", "pair_accuracy_logprob")
    logger.info("the policy's mean token log-prob as the ranker: held-out pair accuracy %s",
                cell(logprob, "pair_accuracy"))
    if accelerator.is_main_process:
        _write_reward_heads(Path(out_dir), models, curves, histories, split)
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    metrics["wall_seconds"] = time.perf_counter() - started
    # per head: the training loss by step, and the held-out token-level reward curve by point (AuTRC is its area)
    steps = {f"{_metric_key(name)}.{key}": history[key] for name, history in histories.items()
             for key in ("loss", "train_pair_accuracy")}
    trc = {f"{_metric_key(name)}.reward_curve": list(curve["accuracy"]) for name, curve in curves.items()}
    channel = "reward-channel" if policy_source == "base" else f"reward-channel-{policy_source}"
    return StageResult(metrics=metrics, curves=steps | trc, artifacts={"reward": Path(out_dir)},
                       models={channel: Path(out_dir) / "channel"})


def _prompt_split(train_pairs: pd.DataFrame, held_out: pd.DataFrame) -> dict[str, list[str]]:
    """The prompts the heads trained on and those held out (``split.json``: the SLA benchmark never tunes on the
    former)."""
    return {"train_prompt_ids": sorted(set(train_pairs["prompt_id"])),
            "held_out_prompt_ids": sorted(set(held_out["prompt_id"]))}


def _write_reward_heads(out_dir: Path, models: dict, curves: dict[str, dict],
                        histories: dict[str, dict[str, list[float]]], split: dict[str, list[str]]) -> None:
    """One head folder per model, the curves, the histories, the prompt split and the plots into ``out_dir``, whole
    or not at all."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for name, model in models.items():
            model.save_head(tmp / name)
        (tmp / SPLIT_FILE).write_text(json.dumps(split, indent=2) + "\n")
        (tmp / "curves.json").write_text(json.dumps(curves, indent=2) + "\n")
        (tmp / "history.json").write_text(json.dumps(histories, indent=2) + "\n")
        plot_reward_curves(curves, tmp / "autrc.png")
        plot_losses(histories, tmp / "loss.png")


# prints stay plain: ``datasets`` (TRL's preprocessing) hashes functions with dill, which reads their globals off a
# ``dis`` listing it prints into a swapped ``sys.stdout``; Prefect's print-to-log patch would log that listing
# instead (hundreds of bytecode lines per run) and hand dill nothing to read
@gpu_task("train-dpo", log_prints=False)
def dpo_task(cfg: Config) -> StageResult:
    """Train the DPO policy into ``paths.dpo_dir`` (atomically) and evaluate it on the held-out pairs."""
    logger = stage_logger()
    started = time.perf_counter()
    pairs_path = cfg.path(cfg.paths.pairs)
    pairs = read_table(pairs_path, "pairs")
    train_pairs, held_out = split_pairs(pairs, cfg.reward.eval_fraction, cfg.reward.seed)
    if cfg.dpo.pairs == "best_worst":  # one pair per prompt, the usual DPO data; the reward heads take them all
        if "best_worst" not in pairs.columns:
            raise ValueError(f"{pairs_path} has no best_worst column (written before validate.pairing existed): "
                             "re-run the validate stage, or set dpo.pairs: all")
        train_pairs = train_pairs[train_pairs["best_worst"].astype(bool)].reset_index(drop=True)
    policy = load_stage_policy(cfg, "base", training=True)
    logger.info("DPO on %d pairs (dpo.pairs: %s; %d held out) on %s, beta=%g", len(train_pairs), cfg.dpo.pairs,
                len(held_out), policy.device, cfg.dpo.beta)
    # the trainer's step logs under TRL's names (loss, learning_rate, grad_norm, rewards/…, logps/…): the curves
    with live_curves(cfg, lambda key: None if key == "epoch" else key) as steps:
        metrics = train_dpo(policy, train_pairs, cfg.dpo, cfg.path(cfg.paths.dpo_dir))

    # The saved folder is what later stages load, so that is what gets evaluated, on every held-out pair that fits
    # dpo.max_length whole (as the reward heads are); the untouched base policy is the reference.
    held_out, heldout_too_long = fitting_dpo_pairs(policy.tokenizer, held_out, cfg.dpo.max_length)
    if held_out.empty:
        raise ValueError(f"no held-out pair fits dpo.max_length {cfg.dpo.max_length} tokens: raise it to the longest "
                         "prompt + response + end token")
    if metrics["num_pairs_dropped_too_long"] or heldout_too_long:
        logger.warning("dropped %d training and %d held-out pairs longer than dpo.max_length %d tokens",
                       metrics["num_pairs_dropped_too_long"], heldout_too_long, cfg.dpo.max_length)
    tuned = load_stage_policy(cfg, "dpo", training=True)
    reference_logps, tuned_logps = (pair_logps(model, policy.tokenizer, held_out, cfg.dpo.max_length)
                                    for model in (policy.model, tuned.model))
    prompt_ids = held_out["prompt_id"].tolist()
    before, after = (with_intervals(preference_accuracy(logps, reference_logps, beta=cfg.dpo.beta), prompt_ids,
                                    {"accuracy": "pair_outcomes"}) for logps in (reference_logps, tuned_logps))
    metrics.update({
        "num_heldout": len(held_out),
        "num_heldout_dropped_too_long": heldout_too_long,
        "num_heldout_prompts": after["num_prompts"],
        **_interval_metrics(before, "accuracy", "heldout_accuracy_before"),
        "heldout_margin_before": before["margin"],
        **_interval_metrics(after, "accuracy", "heldout_accuracy_after"),
        "heldout_margin_after": after["margin"],
        "wall_seconds": time.perf_counter() - started,
    })
    logger.info("DPO loss %.4f → %.4f; held-out implicit-reward accuracy %s → %s (margin %.4f; 95 %% intervals "
                "over %d pairs of %d prompts, * = differs from 0.5, the untrained policy's tie)",
                metrics.get("loss_first", float("nan")), metrics.get("loss_last", float("nan")),
                cell(before, "accuracy"), cell(after, "accuracy"), after["margin"], len(held_out),
                after["num_prompts"])
    return StageResult(metrics=metrics, curves=steps.curves, models={"dpo-policy": cfg.path(cfg.paths.dpo_dir)})


TABLE_COLUMNS = ["policy", "decoder", "versus", "win", "tie", "loss", "win_rate", "mean_reward", "accuracy",
                 "truncated", "tokens_per_s", "ms_per_token", "latency_vs_reference"]
TUNING_COLUMNS = ["decoder", "depth", "width", "step", "streaming", "chosen", "win", "tie", "loss", "win_rate",
                  "accuracy", "truncated"]
OVERHEAD_COLUMNS = ["policy", "forward", "repeats", "policy_ms", "reward_transformer_ms", "overhead"]


def _load(cfg: Config, which: str):
    """(policy, reward transformer) for ``base`` or ``dpo``, each with the reward head trained on it."""
    policy = load_stage_policy(cfg, which)
    head = cfg.path(cfg.paths.reward_dir) / which / "channel"
    return policy, RewardTransformer.from_head(policy.model, head).eval()


@torch.inference_mode()
def forward_overhead(reward_model, input_ids: torch.Tensor, repeats: int, warm_up: int = 3,
                     prefill: bool = True) -> list[dict]:
    """The reward channel's cost on top of the policy's forward, measured as decoding pays it.

    Two forwards: the one-token decode step over a KV cache of the prompt (what greedy and SLA run for every
    token) and, if ``prefill``, the whole prompt's forward (once per prompt). Each is timed in ``repeats`` interleaved pairs (policy
    alone, policy + channel) after ``warm_up`` untimed pairs, the order alternating from pair to pair, so drifts
    of the machine's speed and whichever side runs first hit both alike; the overhead is
    mean(joint) / mean(policy) − 1 with its 95 % interval over the pairs (:func:`statistics.ratio_of_means`),
    ``overhead_significant`` when it excludes 0. Both ask for the last position's logits, the joint forward
    for the hidden states too, as in use. Every decode step starts from its own copy of the prompt's cache
    (made outside the timing), so all see the same cache length. CUDA runs kernels asynchronously, so each
    timing starts and ends with ``synchronize()`` (else it measures the launches, not the forward).
    """
    policy = reward_model.policy
    ids = input_ids.to(policy.device)
    prompt_cache = returned_cache(policy(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1))
    inputs = {"decode step": lambda model: {"input_ids": ids[:, -1:], "use_cache": True,
                                            **cache_kwargs(model, copy.deepcopy(prompt_cache))}}
    if prefill:
        inputs["prompt"] = lambda model: {"input_ids": ids}

    def seconds(model, kwargs: dict) -> float:
        synchronize()
        started = time.perf_counter()
        model(**kwargs, logits_to_keep=1)
        synchronize()
        return time.perf_counter() - started

    rows, sides = [], [("policy", policy), ("joint", reward_model)]
    for forward, make_inputs in inputs.items():
        times: dict[str, list[float]] = {"policy": [], "joint": []}
        for repeat in range(-warm_up, repeats):
            for side, model in sides if repeat % 2 == 0 else sides[::-1]:
                elapsed = seconds(model, make_inputs(model))
                if repeat >= 0:
                    times[side].append(elapsed)
        ratio = statistics.ratio_of_means(times["joint"], times["policy"])
        overhead = statistics.Interval(ratio.value - 1, ratio.low - 1, ratio.high - 1, ratio.n)
        rows.append({"forward": forward, "repeats": repeats, "policy_ms": 1000 * float(np.mean(times["policy"])),
                     "reward_transformer_ms": 1000 * float(np.mean(times["joint"])),
                     **statistics.interval_columns("overhead", overhead, reference=0.0)})
    return rows


def _decode_all(cfg: Config, loaded: tuple, which: str, questions: list[str], decoders: list[str],
                sla_settings: dict[str, SLASearch], untimed: frozenset[str] = frozenset(), timed: bool = True
                ) -> tuple[list[dict], dict]:
    """Every decoder on every question for one policy, ``which`` (``loaded``: its policy and reward transformer,
    :func:`_load`; chat template of its own tokenizer); returns output records and speed stats: a timer per decoder
    and the reward channel's overhead (with ``timed`` False: none, every prompt decoded in batches).

    Each (decoder, prompt) is decoded once. The first ``sla_benchmark.speed_prompts`` prompts are decoded at
    batch 1 by greedy and the other ``sla_benchmark.timed_decoders`` in turn, prompt by prompt
    (:func:`interleaved_decoding`), and timed: speed ratios pair a decoder's call with greedy's on the same
    prompt. The rest goes untimed, in batches (:func:`_decode_batched`). ``decoders``: the classical ones by name
    (greedy first), ``sla`` for ``sla_settings``; the SLA settings named in ``untimed`` (an ablation) are not timed.
    """
    b = cfg.sla_benchmark
    policy, reward_model = loaded
    eos = end_token_ids(policy)
    prompt_ids = _prompt_ids(cfg, policy, questions)
    names = [name for d in decoders for name in (sla_settings if d == "sla" else [d])]
    timed_names = [name for name in names if timed and (name == "greedy" or (
        name not in untimed and ("sla" if name in sla_settings else name) in b.timed_decoders))]
    speed_prompts = min(b.speed_prompts, len(prompt_ids)) if timed else 0
    # a setting under a second name (the tuned one may be the paper's) is decoded and timed once: the search is
    # deterministic, so its second row takes the first's outputs and timer
    first_named: dict[SLASearch, str] = {}
    aliases: dict[str, str] = {}
    for name in timed_names:
        if name in sla_settings:
            first = first_named.setdefault(sla_settings[name], name)
            if first != name:
                aliases[name] = first

    def decode(decoder: str, i: int, max_new_tokens: int) -> tuple[list[int], None]:
        if decoder in sla_settings:
            return sla_generate(reward_model, prompt_ids[i], sla_settings[decoder], max_new_tokens, eos)[0], None
        (tokens,) = _decode_batched(cfg, policy, reward_model, prompt_ids[i:i + 1], decoder, None, b.seed + i,
                                    max_new_tokens, batch_size=1)
        return tokens, None

    timers, timed = interleaved_decoding([name for name in timed_names if name not in aliases], range(speed_prompts),
                                         decode, b.max_new_tokens, f"{which} timed")
    timers |= {name: timers[first] for name, first in aliases.items()}
    outputs = {(r["decoder"], r["prompt_index"]): r["tokens"] for r in timed}
    outputs |= {(name, i): outputs[(first, i)] for name, first in aliases.items() for i in range(speed_prompts)}
    decoded: dict[tuple[SLASearch, int], str] = {}  # (SLA setting, first prompt) → the name it was decoded under
    for name in names:
        start = speed_prompts if name in timed_names else 0  # the first prompt not decoded yet
        setting = sla_settings.get(name)
        if (setting, start) in decoded:  # the tuned setting may be the paper's: the search is deterministic
            outputs |= {(name, i): outputs[(decoded[(setting, start)], i)] for i in range(start, len(prompt_ids))}
            continue
        batched = _decode_batched(cfg, policy, reward_model, prompt_ids[start:], name, setting, b.seed + start,
                                  b.max_new_tokens, desc=f"{which} {name}")
        outputs |= {(name, start + i): tokens for i, tokens in enumerate(batched)}
        if setting is not None:
            decoded[(setting, start)] = name
    records = [{"policy": which, "decoder": name, "prompt_index": i,
                "timed": name in timed_names and i < speed_prompts,
                **_output_columns(policy.tokenizer, outputs[(name, i)], eos, b.max_new_tokens)}
               for name in names for i in range(len(prompt_ids))]
    # the prefill's overhead on the base policy only: both share the architecture, and it costs 4× the decode step's
    overhead = forward_overhead(reward_model, prompt_ids[0], b.overhead_repeats, prefill=which == "base") if timed \
        else []
    return records, {"timers": timers, "overhead": overhead}


def _prompt_ids(cfg: Config, policy, questions: list[str]) -> list[torch.Tensor]:
    """The questions in the policy's chat template, (1, T_p) token ids each."""
    return [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, questions, cfg.prompts.system_prompt)]


def _output_columns(tokenizer, tokens: list[int], eos: set[int], max_new_tokens: int) -> dict:
    """An output record's ``new_tokens``, ``truncated`` (cut at ``max_new_tokens`` before an end token) and the decoded
    ``response``."""
    return {"new_tokens": len(tokens), "truncated": cut_by_length(tokens, eos, max_new_tokens),
            "response": tokenizer.decode(tokens, skip_special_tokens=True).strip()}


def _decode_batched(cfg: Config, policy, reward_model, prompt_ids: list[torch.Tensor], name: str,
                    setting: SLASearch | None, seed: int, max_new_tokens: int, batch_size: int | None = None,
                    desc: str | None = None) -> list[list[int]]:
    """The prompts decoded ``batch_size`` (default ``sla_benchmark.batch_size``) at a time: by the classical decoder
    ``name`` (beam search holds ``num_beams`` rows per prompt; a sampling decoder seeds batch j with ``seed + j``),
    or by SLA with ``setting``, the batch's trees searched in lockstep (:func:`models.sla.search.sla_generate_batch`:
    k^d rows per prompt). ``desc``: show a progress bar of SLA's batches."""
    b = cfg.sla_benchmark
    batch_size = batch_size or b.batch_size
    eos = end_token_ids(policy)
    if not prompt_ids:
        return []
    if setting is None:
        return hf_decode(policy, [ids[0].tolist() for ids in prompt_ids],
                         generate_kwargs(name, b), max_new_tokens, eos,
                         batch_size=batch_size, seed=seed)
    responses: list[list[int]] = []
    with tqdm(total=len(prompt_ids), desc=desc, unit="prompt", disable=desc is None) as progress:
        for start in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[start:start + batch_size]
            responses += sla_generate_batch(reward_model, batch, setting, max_new_tokens, eos,
                                            padding_id(policy.tokenizer))
            progress.update(len(batch))
    return responses


def setting_name(setting: SLASearch) -> str:
    """``sla_d2_k2_n10``: an SLA setting's decoder name in sweeps and the tuning table."""
    return f"sla_d{setting.depth}_k{setting.width}_n{setting.step}"


def _sla_settings(cfg: Config) -> dict[str, SLASearch]:
    """The paper's setting (``sla``) plus the optional sweep (Figure 3: vary one of d, k, n at a time)."""
    main = cfg.sla
    settings = {"sla": main} if "sla" in cfg.sla_benchmark.decoders else {}
    for field, values in (("depth", cfg.sla_benchmark.sweep_depth), ("width", cfg.sla_benchmark.sweep_width),
                          ("step", cfg.sla_benchmark.sweep_step)):
        for value in values:
            variant = main.model_copy(update={field: value})
            settings[setting_name(variant)] = variant
    return settings


def tuning_split(train: pd.DataFrame, held_out: pd.DataFrame, trained_on: set[str], count: int) -> pd.DataFrame:
    """The SLA tuning prompts: the first ``count`` training prompts that nothing trained on (not in ``trained_on``, the
    prompts of the reward heads' and DPO's training pairs) and that share no question with the ``held_out`` prompts."""
    unseen = ~train["prompt_id"].isin(trained_on) & ~train["question"].isin(set(held_out["question"]))
    return train[unseen].head(count).reset_index(drop=True)


def choose_setting(rows: list[dict], settings: dict[str, SLASearch], max_step: int) -> str:
    """The name of the best streaming setting on the tuning split: of the ``settings`` with step n ≤ ``max_step``, the
    highest win rate against greedy (``rows``: one per decoder, as :func:`_table` gives them), then the highest
    accuracy (unknown answers count as equal); ties go to the first in grid order."""
    eligible = [r for r in rows if r["decoder"] in settings and settings[r["decoder"]].step <= max_step]
    if not eligible:
        raise ValueError(f"no SLA setting with step ≤ {max_step} to choose from")
    return max(eligible, key=lambda r: (r["win_rate"], np.nan_to_num(r.get("accuracy", np.nan), nan=0.0)))["decoder"]


def _tune(cfg: Config, loaded: tuple, held_out: pd.DataFrame) -> tuple[SLASearch, list[dict], pd.DataFrame]:
    """Decode (``loaded``: the base policy and its reward transformer) the tuning split (:func:`tuning_split`) with base greedy and every ``sla_benchmark.tuning_grid`` setting
    (untimed, batched); return the chosen setting (:func:`choose_setting`), the tuning table (one row per decoder
    with its win rate against greedy and accuracy, 95 % intervals over the tuning prompts, d, k, n, whether it
    could be chosen, ``streaming``, and whether it was, ``chosen``) and the scored tuning outputs."""
    b = cfg.sla_benchmark
    split_path = cfg.path(cfg.paths.reward_dir) / "base" / SPLIT_FILE
    if not split_path.is_file():
        raise FileNotFoundError(f"{split_path} is missing (written before SLA tuning existed): re-run train_reward, "
                                "or set sla_benchmark.tuning_prompts: 0")
    split = json.loads(split_path.read_text())
    prompts = tuning_split(read_prompts(cfg, "train"), held_out, set(split["train_prompt_ids"]), b.tuning_prompts)
    if prompts.empty:
        raise ValueError("no tuning prompts: every training prompt was trained on; raise prompts.num_train")
    grid = {setting_name(s): s for s in (cfg.sla.model_copy(update={"depth": d, "width": k, "step": n})
                                         for d, k, n in b.tuning_grid)}
    policy, reward_model = loaded
    eos = end_token_ids(policy)
    prompt_ids = _prompt_ids(cfg, policy, prompts["question"].tolist())
    records = [{"policy": "base", "decoder": name, "prompt_index": i,
                **_output_columns(policy.tokenizer, tokens, eos, b.max_new_tokens)}
               for name, setting in {"greedy": None, **grid}.items()
               for i, tokens in enumerate(_decode_batched(cfg, policy, reward_model, prompt_ids, name, setting, b.seed,
                                                          b.max_new_tokens, desc=f"tuning {name}"))]
    outputs = _scored(pd.DataFrame(records), prompts, cfg)
    rows = _table(outputs, {"base": {"timers": {}}})
    chosen = choose_setting(rows, grid, b.tuning_max_step)
    for row in rows:
        setting = grid.get(row["decoder"])
        row |= {"num_prompts": len(prompts), "depth": setting and setting.depth, "width": setting and setting.width,
                "step": setting and setting.step, "streaming": bool(setting) and setting.step <= b.tuning_max_step,
                "chosen": row["decoder"] == chosen}
    return grid[chosen], rows, outputs


def _quality(group: pd.DataFrame, versus: pd.DataFrame) -> dict:
    """Win/tie/loss and win rate against ``versus`` (the same prompts, in the same order), mean reward and
    accuracy, each with its 95 % interval over the prompts; ``*_significant`` where the paired difference from
    ``versus`` excludes 0 (the win rate's: where it excludes 0.5); the share of outputs cut at the token limit."""
    scores, reference = group["score"].to_numpy(float), versus["score"].to_numpy(float)
    row = {**win_tie_loss(scores, reference), **statistics.interval_columns("mean_reward",
                                                                             statistics.mean_interval(scores)),
           "mean_reward_significant": statistics.paired_difference(scores, reference).excludes(0.0),
           "truncated": float(group["truncated"].mean())}
    if not (group["correct"].notna().all() and versus["correct"].notna().all()):
        return row | {"accuracy": float("nan")}  # answers unknown (a reward-model labeler on open prompts)
    correct, reference_correct = group["correct"].to_numpy(float), versus["correct"].to_numpy(float)
    return row | statistics.interval_columns("accuracy", statistics.mean_interval(correct)) | {
        "accuracy_significant": statistics.paired_difference(correct, reference_correct).excludes(0.0)}


def _table(outputs: pd.DataFrame, speed: dict) -> list[dict]:
    """Table 1: each (policy, decoder) against base greedy, plus each DPO + SLA decoder against DPO + greedy. Speed
    ratios are to greedy on the same policy."""
    by = {key: group.sort_values("prompt_index") for key, group in outputs.groupby(["policy", "decoder"], sort=False)}
    rows = []
    comparisons = [(p, d, ("base", "greedy")) for (p, d) in by]
    if ("dpo", "greedy") in by:
        comparisons += [("dpo", d, ("dpo", "greedy")) for (p, d) in by if p == "dpo" and d.startswith("sla")]
    for policy, decoder, versus in comparisons:
        row = {"policy": policy, "decoder": decoder, "versus": "+".join(versus), **_quality(by[(policy, decoder)],
                                                                                             by[versus])}
        timers = speed[policy]["timers"]
        if decoder in timers:
            row.update(speed_row(timers[decoder], timers["greedy"]))
        rows.append(row)
    return rows


TUNED = "sla_tuned"
"""Decoder name of SLA at the setting chosen on the tuning split (ours); ``sla`` is the paper's setting."""


def _tuned_settings(tuned: SLASearch, ablation: bool) -> dict[str, SLASearch]:
    """``sla_tuned`` and, with ``ablation``, the same setting with the other leaf scoring (``sla_tuned_last`` when
    the leaf score is the mean, else ``sla_tuned_mean``)."""
    settings = {TUNED: tuned}
    if ablation:
        other = "last" if tuned.leaf_score == "mean" else "mean"
        settings[f"{TUNED}_{other}"] = tuned.model_copy(update={"leaf_score": other})
    return settings


@gpu_task("benchmark-sla")
def benchmark_sla_task(cfg: Config) -> StageResult:
    """Tune SLA's setting on training prompts nothing trained on, then decode the held-out prompts with every decoder
    for the base policy and with ``sla_benchmark.dpo_decoders`` for the DPO policy (SLA at the paper's setting and
    at the tuned one); score; compare, with 95 % intervals."""
    logger = stage_logger()
    started = time.perf_counter()
    b = cfg.sla_benchmark
    held_out = read_prompts(cfg, "eval").head(b.num_prompts)
    if held_out.empty:
        raise ValueError("no held-out prompts: set prompts.num_eval > 0")
    questions = held_out["question"].tolist()
    settings = _sla_settings(cfg)
    sweep = [name for name in settings if name != "sla"]
    tuning_rows, tuning_outputs, tuned = [], None, {}
    # the base policy serves the tuning, its own decoding and the on-policy ranking: loaded once, kept while the DPO
    # policy decodes (foresight/memory.py counts both)
    base = _load(cfg, "base")
    if "sla" in b.decoders and b.tuning_prompts > 0:
        tuning_started = time.perf_counter()
        chosen, tuning_rows, tuning_outputs = _tune(cfg, base, held_out)
        tuned = _tuned_settings(chosen, b.leaf_score_ablation)
        logger.info("SLA tuning on %d training prompts (%.0f s), chosen %s:\n%s", tuning_rows[0]["num_prompts"],
                    time.perf_counter() - tuning_started, setting_name(chosen),
                    markdown_table(tuning_rows, TUNING_COLUMNS))
    records, speed = [], {}
    for which in ("base", "dpo"):
        decoders = ["greedy", *(d for d in b.decoders if d != "greedy" and (which == "base" or d in b.dpo_decoders))]
        logger.info("decoding %d held-out prompts with the %s policy: %s", len(questions), which, ", ".join(decoders))
        policy_settings = settings | tuned if which == "base" else {
            k: v for k, v in (settings | tuned).items() if k in ("sla", TUNED)}
        policy_records, speed[which] = _decode_all(cfg, base if which == "base" else _load(cfg, which), which,
                                                   questions, decoders, policy_settings,
                                                   untimed=frozenset(tuned) - {TUNED},
                                                   timed=which == "base" or b.dpo_timed)
        records += policy_records
    outputs = _scored(pd.DataFrame(records), held_out, cfg)
    ranking = _onpolicy_ranking(cfg, base, outputs, questions)
    logger.info("on-policy ranking of the base decoders' (correct, incorrect) outputs: %s", json.dumps(ranking))
    rows = _table(outputs[~outputs["decoder"].isin(sweep)], speed)
    sweep_rows = _table(outputs[(outputs["policy"] == "base") & ~outputs["decoder"].isin(list(tuned))], speed) \
        if sweep else []
    out_dir = _write_benchmark(cfg, outputs, rows, sweep_rows, tuning_rows, tuning_outputs, speed)
    metrics = _metrics(rows, speed) | _tuning_metrics(tuning_rows, tuned.get(TUNED)) | ranking
    metrics["benchmark_seconds"] = time.perf_counter() - started
    logger.info("\n%s", markdown_table(rows, TABLE_COLUMNS))
    logger.info("reward channel overhead:\n%s", markdown_table(_overhead_rows(speed), OVERHEAD_COLUMNS))
    table_artifact(key="sla-benchmark", table=display_rows(rows, TABLE_COLUMNS),
                   description="Decoders against greedy (the SLA paper's Table 1), 95 % intervals, * = significant")
    markdown_artifact(key="sla-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                      description="SLA benchmark report")
    return StageResult(metrics=metrics, tables={"sla_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def onpolicy_pairs(outputs: pd.DataFrame, prompts: list[str]) -> pd.DataFrame:
    """Every (correct, incorrect) pair of distinct responses the base policy's decoders gave one held-out prompt:
    the candidates a search has to choose between (``prompts``: the templated prompt of each prompt index)."""
    base = outputs[(outputs["policy"] == "base") & outputs["correct"].notna()].drop_duplicates(["prompt_index",
                                                                                               "response"])
    rows = [{"prompt_id": right["prompt_id"], "prompt": prompts[right["prompt_index"]], "chosen": right["response"],
             "rejected": wrong["response"]}
            for _, group in base.groupby("prompt_index")
            for _, right in group[group["correct"].astype(bool)].iterrows()
            for _, wrong in group[~group["correct"].astype(bool)].iterrows()]
    return pd.DataFrame(rows, columns=["prompt_id", "prompt", "chosen", "rejected"])


def _onpolicy_ranking(cfg: Config, base: tuple, outputs: pd.DataFrame, questions: list[str]) -> dict:
    """How often the reward channel ranks the correct one of the base decoders' (correct, incorrect) outputs first
    (by eq. 17's mean token reward), against the policy's own mean token log-prob as the ranker: the choice SLA's
    search faces, measured on the benchmark's outputs (a diagnostic: it chooses nothing). Intervals resample
    prompts. ``onpolicy_*``; none without known answers."""
    policy, reward_model = base
    pairs = onpolicy_pairs(outputs, chat_prompts(policy.tokenizer, questions, cfg.prompts.system_prompt))
    if pairs.empty:
        return {"onpolicy_pairs": 0}
    metrics = {"onpolicy_pairs": len(pairs), "onpolicy_prompts": pairs["prompt_id"].nunique()}
    # whole sequences (no max_length): the benchmark's own outputs, at most its max_new_tokens each
    scored = score_pairs(reward_model, policy.tokenizer, pairs, None, logprobs=True)  # both from one forward
    for ranker, scores in (("channel", scored.rewards), ("logprob", scored.logprobs)):
        interval = statistics.clustered_mean_interval(pair_wins(scores), pairs["prompt_id"])
        metrics |= statistics.interval_columns(f"onpolicy_accuracy_{ranker}", interval, reference=0.5)
    return metrics


def _scored(outputs: pd.DataFrame, held_out: pd.DataFrame, cfg: Config) -> pd.DataFrame:
    """The decoded outputs with their prompt id, question, known answer, the labeler's score and correctness."""
    answers = reference_answers(held_out)
    outputs["prompt_id"] = [held_out["prompt_id"].iloc[i] for i in outputs["prompt_index"]]
    outputs["question"] = [held_out["question"].iloc[i] for i in outputs["prompt_index"]]
    outputs["answer"] = [answers[i] for i in outputs["prompt_index"]]
    labeler = build_labeler(cfg.label)
    cut = outputs["truncated"].tolist()  # credited only for a marked answer (models/labeling/answers.py)
    outputs["score"] = labeler.score(outputs["question"].tolist(), outputs["response"].tolist(),
                                     outputs["answer"].tolist(), truncated=cut)
    outputs["correct"] = pd.array([is_correct(r, a, c) for r, a, c in zip(outputs["response"], outputs["answer"], cut)],
                                  dtype="boolean")
    return outputs


def _write_benchmark(cfg: Config, outputs: pd.DataFrame, rows: list[dict], sweep_rows: list[dict],
                     tuning_rows: list[dict], tuning_outputs: pd.DataFrame | None, speed: dict) -> Path:
    """Outputs, tables, plots and report into ``benchmarks_dir/sla``, whole or not at all; returns the folder."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "sla"
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_table(outputs, tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        write_table(pd.DataFrame(_overhead_rows(speed)), tmp / "overhead.csv")
        if tuning_outputs is not None:
            write_table(pd.DataFrame(tuning_rows), tmp / "tuning.csv")
            write_table(tuning_outputs, tmp / "tuning_outputs.parquet")
        bar_plot({p: {r["decoder"]: interval_bar(r, "win_rate") for r in rows
                      if r["policy"] == p and r["versus"] == "base+greedy"} for p in ("base", "dpo")},
                 "Win rate against base greedy (win + tie/2)", "win rate", tmp / "win_rate.png", reference_line=0.5)
        bar_plot({p: {r["decoder"]: interval_bar(r, "latency_vs_reference") for r in rows
                      if r["policy"] == p and r["versus"] == "base+greedy" and "latency_vs_reference" in r}
                  for p in ("base", "dpo")}, "Per-token latency relative to greedy (batch 1)", "× greedy",
                 tmp / "latency.png", reference_line=1.0)
        if sweep_rows:
            bar_plot({"base": {r["decoder"]: interval_bar(r, "win_rate") for r in sweep_rows
                               if r["decoder"].startswith("sla")}},
                     "SLA settings (Figure 3): win rate against greedy", "win rate", tmp / "sweep.png", 0.5)
        (tmp / "report.md").write_text(_report(rows, sweep_rows, tuning_rows, speed,
                                               outputs["prompt_index"].nunique(), cfg))
    return out_dir


def _overhead_rows(speed: dict) -> list[dict]:
    """The reward channel's overhead, one row per (policy, timed forward)."""
    return [{"policy": which, **row} for which, s in speed.items() for row in s["overhead"]]


def _metrics(rows: list[dict], speed: dict) -> dict:
    """Flat stage metrics: each row's quality and latency figures with their intervals, and the overheads."""
    metrics = {}
    for r in rows:
        key = f"{r['policy']}_{r['decoder']}" + ("_vs_dpo_greedy" if r["versus"] == "dpo+greedy" else "")
        for column in ("win_rate", "mean_reward", "accuracy"):
            metrics |= _interval_metrics(r, column, f"{key}.{column}")
        metrics[f"{key}.truncated"] = r["truncated"]
        if "latency_vs_reference" in r:
            metrics |= _interval_metrics(r, "latency_vs_reference", f"{key}.latency_vs_greedy")
    for which, s in speed.items():
        for row in s["overhead"]:
            suffix = "" if row["forward"] == "decode step" else "_" + row["forward"]
            metrics |= _interval_metrics(row, "overhead", f"{which}.reward_channel_overhead{suffix}")
        if "greedy" in s["timers"]:
            metrics[f"{which}.greedy_tokens_per_s"] = s["timers"]["greedy"].tokens_per_s
    return metrics


def _tuning_metrics(tuning_rows: list[dict], tuned: SLASearch | None) -> dict:
    """The tuning table as flat metrics (``tuning_<decoder>.win_rate`` / ``.accuracy`` with their intervals) and the
    chosen setting (``sla_tuned.depth`` / ``.width`` / ``.step``); nothing without tuning."""
    if tuned is None:
        return {}
    metrics = {"tuning.num_prompts": tuning_rows[0]["num_prompts"], "sla_tuned.depth": tuned.depth,
               "sla_tuned.width": tuned.width, "sla_tuned.step": tuned.step}
    for r in tuning_rows:
        for column in ("win_rate", "accuracy"):
            metrics |= _interval_metrics(r, column, f"tuning_{r['decoder']}.{column}")
    return metrics


def _report(rows: list[dict], sweep_rows: list[dict], tuning_rows: list[dict], speed: dict, num_prompts: int,
            cfg: Config) -> str:
    """report.md: the table, the tuning table, the overhead, the sweep, and what the intervals and ``*`` mean."""
    s, b = cfg.sla, cfg.sla_benchmark
    overhead = speed["base"]["overhead"][0]
    chosen = next((r for r in tuning_rows if r["chosen"]), None)
    lines = [
        "# SLA benchmark (the shape of the SLA paper's Table 1)",
        (f"\nLabeler `{cfg.label.labeler}`, at most {b.max_new_tokens} new tokens. `sla`: the paper's setting "
         f"SLA(d={s.depth}, k={s.width}, n={s.step}), leaf score `{s.leaf_score}`"
         + (f"; `{TUNED}` (ours): SLA(d={chosen['depth']}, k={chosen['width']}, n={chosen['step']}), chosen on "
            f"{chosen['num_prompts']} training prompts nothing trained on (below); `{TUNED}_<leaf score>`: the same "
            "setting with the other leaf score (the ablation)" if chosen else "")
         + ". Win rate = win + tie/2 against the row's reference (`versus`); `truncated`: the share of outputs cut "
         "at the token limit.\n"),
        ("Figures come with their 95 % confidence intervals, `value [low, high]` (percentile bootstrap, scipy). "
         f"Quality (win/tie/loss, win rate, mean reward, accuracy) rests on {num_prompts} held-out prompts; speed "
         f"(tokens/s, ms/token, latency relative to greedy on the same policy) on the first "
         f"{speed['base']['timers']['greedy'].calls}, decoded at batch 1 by greedy and the timed decoders "
         f"({', '.join(b.timed_decoders)}) in turn, prompt by prompt, their intervals resampling the prompts in "
         "pairs (rows without speed were decoded in batches, untimed); the reward channel's overhead on "
         f"{overhead['repeats']} interleaved pairs of forwards. `*` marks a figure that differs significantly from "
         "the row's reference: the win rate's interval excludes 0.5; the paired difference in mean reward or "
         "accuracy from the reference decoder excludes 0; the latency ratio's interval excludes 1; the overhead's "
         "excludes 0.\n"),
        markdown_table(rows, TABLE_COLUMNS),
        "\n## Reward channel overhead\n",
        ("The policy alone against the policy + reward channel, on the first prompt: the one-token decode step on "
         "a KV cache of the prompt (what decoding runs per token) and, on the base policy, the whole prompt's "
         "forward (prefill); mean times; overhead = mean(joint) / mean(policy) − 1.\n"),
        markdown_table(_overhead_rows(speed), OVERHEAD_COLUMNS),
    ]
    if tuning_rows:
        lines += ["\n## SLA tuning (base policy, against base greedy, on the tuning prompts)\n",
                  (f"{chosen['num_prompts']} training prompts that neither the reward channel nor DPO trained on and "
                   "that no held-out prompt shares; `sla_tuned` is the `streaming` setting "
                   f"(n ≤ {b.tuning_max_step}) with the highest win rate here (then accuracy; ties to the first in the "
                   "grid). The held-out prompts play no part in the choice.\n"),
                  markdown_table(tuning_rows, TUNING_COLUMNS)]
    if sweep_rows:
        lines += ["\n## SLA sweep (base policy, against base greedy)\n",
                  markdown_table([r for r in sweep_rows if r["decoder"].startswith("sla")], TABLE_COLUMNS)]
    return "\n".join(lines) + "\n"
