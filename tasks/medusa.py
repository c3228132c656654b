"""Prefect tasks of the Medusa stages: Medusa-1 heads, RLMedusa's t + 2 head, and the speed benchmark.

Thin wrappers around :mod:`models.medusa.training`, :mod:`models.medusa.rlmedusa` and :mod:`models.engine.speculative`:
they read the data, split it by prompt, log progress, and write each output folder atomically.

* ``train_medusa`` — one frozen pass over the ``distill`` stage's responses (:mod:`tasks.distill`: the policy's
  greedy responses to the training prompts, or the generated samples, and to training instructions of the general
  set), kept in ``distilled/`` for the RL stage, its hidden states read back from disk as training needs them; then
  Medusa-1 training of K heads; held-out top-1/top-k accuracy per head (the ``distill`` stage's split).
* ``train_rlmedusa`` — the trajectory states and their candidates over that pass's states
  (:func:`models.medusa.rlmedusa.trajectory_candidates`), the reward model r(e, h) (MSE on the base model's t + 2
  probabilities), then head 1 by REINFORCE on r − β·KL; held-out accuracy at t + 2 of the RL head against the
  supervised head.
* ``benchmark_medusa`` — HF greedy, HF prompt-lookup, Medusa (supervised heads) and Medusa-RL (head 1
  from RLMedusa) at batch 1 on each prompt set (task, general, files): speedup over greedy in the same run, τ and
  the share of outputs identical to greedy, each with a 95 % interval over prompts (:mod:`foresight.statistics`),
  and, for every output that differs from greedy's, the policy's logit margin where it first differs.

The two training tasks may run in every process of ``accelerate launch`` (docs/gpu.md): each process trains
on its share of every batch, only the main process writes (the distilled cache, then the heads), and all wait
for each other after the writes.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from foresight import statistics
from foresight.benchmark import (
    batch_speed_curve,
    curve_bars,
    display_rows,
    interleaved_decoding,
    markdown_table,
    speed_row,
)
from foresight.plots import bar_plot, interval_bar, line_panels, line_plot
from foresight.prompts import file_prompts, general_instructions
from foresight.storage import atomic_path, write_json, write_table
from models.engine.batched import BatchGreedy, HeadsDrafter, batched_speculative_generate, unsupported_layers
from models.engine.decoding import GREEDY, hf_decode
from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
from models.engine.policy import load_policy
from models.engine.speculative import AdaptiveDrafting, TreeVerifier, build_tree, likeliest_paths, speculative_generate
from models.medusa.heads import IGNORE_INDEX, MedusaDrafter, MedusaHeads
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
from tasks.common import (
    StageResult,
    drop_long_prompt_sets,
    gpu_task,
    live_curves,
    load_stage_policy,
    markdown_artifact,
    read_prompts,
    stage_accelerator,
    stage_logger,
    table_artifact,
)
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


SPEED_COLUMNS = ["prompt_set", "decoder", "batch", "tau", "speedup_vs_reference", "tokens_per_s", "identical_to_greedy",
                 "plain_share", "prompts", "speed_prompts"]
DIVERGENCE_COLUMNS = ["prompt_set", "decoder", "prompt_index", "position", "greedy_text", "decoder_text", "margin",
                      "top2_margin", "argmax", "float32_margin", "float32_choice"]


def _prompt_sets(cfg: Config) -> dict[str, list[str]]:
    """``held_out`` (the first ``medusa_benchmark.num_prompts`` of the eval split), ``general`` (the first
    ``medusa_benchmark.general_prompts`` held-out instructions of the general set; none when 0) and one set per
    prompt file: ``num_prompts`` rows drawn across the whole file with ``medusa_benchmark.seed``, in the drawn order
    (a file sorted by category gives every category its share, the timed first ``speed_prompts`` included; the
    eval split and the general set's held-out part are seeded permutations already)."""
    s = cfg.medusa_benchmark
    sets = {"held_out": read_prompts(cfg, "eval")["question"].head(s.num_prompts).tolist()}
    if s.general_prompts:
        sets["general"] = general_instructions("eval", s.general_prompts)["question"].tolist()
    for file_cfg in s.prompt_files:
        questions = file_prompts(file_cfg, cfg.root)["question"].tolist()
        # seeded as the splits are drawn (foresight.prompts.load_prompts): the same rows on every machine
        drawn = random.Random(s.seed).sample(range(len(questions)), min(s.num_prompts, len(questions)))
        sets[Path(file_cfg.path).stem] = [questions[i] for i in drawn]
    for name, questions in sets.items():
        if not questions:
            raise ValueError(f"prompt set {name!r} is empty")
    return sets


def benchmark_prompt_sets(cfg: Config, tokenizer) -> tuple[dict[str, list[str]], dict[str, int]]:
    """:func:`_prompt_sets` without the prompts over the prompt limit in the policy's chat template (the rule
    ``prepare_prompts`` applies to the splits: :func:`tasks.common.drop_long_prompt_sets`), and the metrics
    ``dropped_long_prompts.<set>``. The general set and prompt files never passed ``prepare_prompts``: an over-long
    prompt there would decode past the policy's context."""
    sets = {name: pd.DataFrame({"question": questions}) for name, questions in _prompt_sets(cfg).items()}
    kept, dropped = drop_long_prompt_sets(cfg, tokenizer, sets, cfg.medusa_benchmark.max_new_tokens)
    return {name: table["question"].tolist() for name, table in kept.items()}, dropped


def candidate_tree(cfg: Config):
    """The configured tree, or (``auto``) the ``tree_size`` paths the supervised heads' held-out drafts had
    accepted most often (:func:`models.engine.speculative.likeliest_paths`, measured by ``train_medusa``). Every
    Medusa decoder uses the same tree, so they differ only in their heads."""
    s = cfg.medusa_benchmark
    if s.tree != "auto":
        return build_tree(s.tree)
    evaluation = _medusa_dir(cfg) / "supervised" / "evaluation.json"
    if not evaluation.is_file():
        raise FileNotFoundError(f"{evaluation} is missing: run the train_medusa stage (speculative.tree: auto reads it)")
    paths = [entry["path"] for entry in json.loads(evaluation.read_text())["path_acceptance"][: s.tree_size]]
    if not paths:  # no held-out draft was ever right: the smallest tree, and adaptive drafting will mostly skip it
        stage_logger().warning("the heads' held-out drafts were never accepted: drafting one token per cycle")
        paths = [[0]]
    return build_tree(paths)


@gpu_task("benchmark-medusa")
def benchmark_medusa_task(cfg: Config) -> StageResult:
    """Every speculative decoder against HF greedy, on each prompt set: at batch 1 on its first ``speed_prompts``
    prompts (speed, every decoder interleaved prompt by prompt; τ; identity), and — each Medusa decoder, under
    greedy verification — batched on all of them (``<decoder>_batched``: τ and identity over the whole set, in
    batches of ``batch_size``, untimed); and the policy's logit margin at every divergence.

    Identity is judged against HF greedy decoding the whole set in left-padded batches of ``batch_size``. In half
    precision that reference rounds differently from greedy at batch 1 too; the greedy row's own identity share
    (its timed, batch-1 outputs against it) measures by how much."""
    logger = stage_logger()
    started = time.perf_counter()
    s = cfg.medusa_benchmark
    policy = load_stage_policy(cfg, "base")
    tree = candidate_tree(cfg)
    decoders, drafters = _medusa_decoders(cfg, policy, tree)
    batched = _batched_drafters(cfg, policy, drafters)
    checks = _DivergenceChecks(cfg, policy)
    eos = end_token_ids(policy)
    records, rows, divergences, curve = [], [], [], []
    sets, dropped = benchmark_prompt_sets(cfg, policy.tokenizer)
    unknown = sorted(set(s.curve_sets) - set(sets))
    if unknown:
        raise ValueError(f"medusa_benchmark.curve_sets names {unknown}, not a benchmarked prompt set ({sorted(sets)})")
    for set_name, questions in sets.items():
        prompt_ids = [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, questions,
                                                                      cfg.prompts.system_prompt)]
        reference = hf_decode(policy, [ids[0].tolist() for ids in prompt_ids], GREEDY, s.max_new_tokens, eos,
                              batch_size=s.batch_size)
        timers, decoded = interleaved_decoding(list(decoders), prompt_ids[: s.speed_prompts],
                                               lambda decoder, ids, n: decoders[decoder](ids, n), s.max_new_tokens,
                                               f"speculative decoding, timed ({set_name})")
        for record in decoded:
            record["batch"] = 1
        decoded += _batched_decoding(cfg, policy, batched, [ids[0].tolist() for ids in prompt_ids], eos, set_name)
        set_records = [{"prompt_set": set_name, "prompt_index": r["prompt_index"], "decoder": r["decoder"],
                        "batch": r["batch"], "tokens": r["tokens"], "new_tokens": len(r["tokens"]),
                        "forwards": r["stats"].forwards if r["stats"] else None,
                        "plain_forwards": r["stats"].plain_forwards if r["stats"] else None,
                        "response": policy.tokenizer.decode(r["tokens"], skip_special_tokens=True)} for r in decoded]
        set_rows = _speed_rows(set_name, set_records, timers, reference)
        set_divergences = checks(set_name, set_records, prompt_ids, reference)
        logger.info("\n%s\n%d outputs differ from greedy's", markdown_table(set_rows, SPEED_COLUMNS),
                    len(set_divergences))
        records += set_records
        rows += set_rows
        divergences += set_divergences
        if set_name in s.curve_sets and s.curve_batch_sizes and batched:
            set_curve = _speed_curve(cfg, policy, batched, [ids[0].tolist() for ids in prompt_ids], eos, set_name)
            logger.info("\n%s", markdown_table(set_curve, CURVE_COLUMNS))
            curve += set_curve
    result = _medusa_report(cfg, records, rows, divergences, curve, tree, str(policy.model.dtype),
                            time.perf_counter() - started)
    result.metrics |= dropped
    return result


def _speed_curve(cfg: Config, policy, drafters: dict, prompts: list[list[int]], eos: set[int], set_name: str
                 ) -> list[dict]:
    """Speed against batch size on one prompt set (:func:`foresight.benchmark.batch_speed_curve`): HF batched greedy
    (the reference) and each Medusa drafter in the batched tree engine, greedy-verified, adaptive as configured
    with one decision state per drafter and batch size (a cycle's cost in plain steps grows with the batch)."""
    s = cfg.medusa_benchmark
    states: dict[tuple[str, int], AdaptiveDrafting | None] = {}

    def decode(decoder: str, batch: list[list[int]], max_new_tokens: int):
        if decoder == "greedy":
            return hf_decode(policy, batch, GREEDY, max_new_tokens, eos, batch_size=len(batch)), None
        if (decoder, len(batch)) not in states:
            states[decoder, len(batch)] = AdaptiveDrafting(s.adaptation) if s.adaptive else None
        state, drafter = states[decoder, len(batch)], drafters[decoder]
        return batched_speculative_generate(policy.model, HeadsDrafter(drafter.tree, drafter.draft_logits),
                                            BatchGreedy(), batch, max_new_tokens, eos, state)

    rows = batch_speed_curve(["greedy", *drafters], prompts, decode, "greedy", s.curve_batch_sizes,
                             s.curve_batches, s.max_new_tokens, f"speed curve ({set_name})")
    return [{"prompt_set": set_name, **row} for row in rows]


def _medusa_decoders(cfg: Config, policy, tree) -> tuple[dict[str, Callable], dict]:
    """Name → ``decode(ids, max_new_tokens) → (tokens, stats or None)``: HF greedy (batch 1, the speed reference),
    prompt lookup, and one Medusa drafter per trained set of heads, all on ``tree`` with the configured
    verification, adaptive or not (``medusa_benchmark.adaptive``); and the Medusa drafters by name."""
    s = cfg.medusa_benchmark
    eos = end_token_ids(policy)
    # the section is-a TypicalAcceptance: its typical_* knobs are the rule
    verifier = TreeVerifier(None if s.acceptance == "greedy" else s)
    adaptation = s.adaptation if s.adaptive else None
    hf_kwargs = {"greedy": GREEDY}
    if "prompt_lookup" in s.decoders:
        hf_kwargs["prompt_lookup"] = {**GREEDY, "prompt_lookup_num_tokens": s.prompt_lookup_tokens}
    folders = {"medusa_supervised": Path("supervised")} if "medusa_supervised" in s.decoders else {}
    if "medusa_rl" in s.decoders:
        folders |= {f"medusa_rl_{init}": Path("rl") / init for init in cfg.rlmedusa.inits}
    lm_head = policy.model.get_output_embeddings()
    drafters = {name: MedusaDrafter(policy.model, MedusaHeads.load(_medusa_dir(cfg) / folder, lm_head), tree,
                                    getattr(torch, s.draft_dtype))
                for name, folder in folders.items()}

    def hf(kwargs):
        return lambda ids, max_new_tokens: (
            hf_decode(policy, [ids[0].tolist()], kwargs, max_new_tokens, eos, batch_size=1)[0], None)

    def speculative(drafter):
        # one drafting state per decoder, carried from prompt to prompt as a server would
        drafting = AdaptiveDrafting(adaptation) if adaptation is not None else None
        return lambda ids, max_new_tokens: speculative_generate(policy.model, drafter, verifier, ids, max_new_tokens,
                                                                eos, adaptation=drafting)

    return ({name: hf(kwargs) for name, kwargs in hf_kwargs.items()}
            | {name: speculative(drafter) for name, drafter in drafters.items()}, drafters)


def _batched_drafters(cfg: Config, policy, drafters: dict) -> dict:
    """The Medusa drafters to run batched as well (:mod:`models.engine.batched`): all of them under greedy
    verification on a full-attention policy; none otherwise (the batch-1 rows then cover the timed prompts only)."""
    unsupported = unsupported_layers(policy.model)
    if cfg.medusa_benchmark.acceptance != "greedy" or unsupported:
        stage_logger().warning("no batched Medusa rows: batched tree decoding verifies greedily on full-attention "
                               "models only (%s)", unsupported or f"acceptance {cfg.medusa_benchmark.acceptance}")
        return {}
    return drafters


def _batched_decoding(cfg: Config, policy, drafters: dict, prompts: list[list[int]], eos: set[int],
                      set_name: str) -> list[dict]:
    """Each drafter's outputs on every prompt, decoded in batches of ``medusa_benchmark.batch_size`` up to an end
    token in ``eos`` (one record per prompt, decoder ``<name>_batched``)."""
    s = cfg.medusa_benchmark
    records = []
    for name, drafter in drafters.items():
        for start in tqdm(range(0, len(prompts), s.batch_size), unit="batch",
                          desc=f"batched speculative decoding ({set_name}, {name})"):
            outputs, stats = batched_speculative_generate(
                policy.model, HeadsDrafter(drafter.tree, drafter.draft_logits), BatchGreedy(),
                prompts[start : start + s.batch_size], s.max_new_tokens, eos)
            records += [{"prompt_index": start + i, "decoder": f"{name}_batched", "batch": s.batch_size,
                         "tokens": tokens, "stats": row}
                        for i, (tokens, row) in enumerate(zip(outputs, stats, strict=True))]
    return records


def _speed_rows(set_name: str, records: list[dict], timers: dict, reference: list[list[int]]) -> list[dict]:
    """One row per decoder of a prompt set: its batch size, τ (Σ tokens / Σ forwards, greedy = 1) and the share of
    outputs equal to ``reference`` (greedy's per prompt index), with intervals over the prompts it decoded; speed
    against HF greedy on the timed prompts (timed decoders only); the share of plain (non-draft) forwards where the
    decoder reports it."""
    outputs = pd.DataFrame(records)
    rows = []
    for decoder, mine in outputs.groupby("decoder", sort=False):
        mine = mine.set_index("prompt_index")
        identical = [float(mine["tokens"][i] == reference[i]) for i in mine.index]
        # greedy makes one forward per token, the prefill included; prompt lookup does not expose its forwards
        forwards = mine["new_tokens"] if decoder == "greedy" else mine["forwards"]
        # τ = Σ tokens / Σ forwards over the prompts, resampled together
        tau = (statistics.interval_columns("tau", statistics.ratio_of_sums(mine["new_tokens"].tolist(),
                                                                           forwards.tolist()), 1.0)
               if forwards.notna().all() else {"tau": float("nan")})
        plain = mine["plain_forwards"]
        timed = decoder in timers
        rows.append({"prompt_set": set_name, "decoder": decoder, "batch": int(mine["batch"].iloc[0]), **tau,
                     **(speed_row(timers[decoder], timers["greedy"]) if timed else {}),
                     **statistics.interval_columns("identical_to_greedy", statistics.mean_interval(identical)),
                     "plain_share": float(plain.sum() / forwards.sum()) if plain.notna().all() else float("nan"),
                     "prompts": len(mine), "speed_prompts": timers[decoder].calls if timed else 0})
    return rows


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """The first position where two outputs differ (the shorter one's length when one extends the other)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b),
                min(len(tokens), len(reference)))


@torch.no_grad()
def next_token_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits (V,) for the token after ``ids`` (1, L), in float32, from one forward without a cache."""
    return model(input_ids=ids.to(model.device), logits_to_keep=1).logits[0, -1].float()


def _choice(logits: torch.Tensor, greedy_token: int, token: int) -> str:
    """Whose token the argmax of ``logits`` is: ``greedy``'s, the ``decoder``'s, or an ``other`` one."""
    best = int(logits.argmax())
    return "greedy" if best == greedy_token else "decoder" if best == token else "other"


class _DivergenceChecks:
    """Why a decoder's output differs from HF greedy's (bf16: a multi-token forward, or a padded batch, rounds
    differently from a one-token one). For each such output: the first differing position, and the policy's
    logits there from one forward over the prompt and the common prefix, in the policy's dtype — ``margin`` =
    logit of greedy's token − logit of the decoder's (near 0: a near-tie that rounding decides), ``top2_margin`` =
    top-1 − top-2, ``argmax`` = whose token that forward prefers — and, when the policy is not float32 and
    ``float32_recheck`` is on, the same from a float32 copy of the policy (loaded once, at the first divergence)."""

    def __init__(self, cfg: Config, policy):
        self.cfg, self.policy = cfg, policy
        self.float32 = None

    def _float32_model(self):
        if self.float32 is None:
            spec = self.cfg.policy.model_copy(update={"dtype": "float32"})
            self.float32 = load_policy(spec, self.cfg.path(self.cfg.paths.policy_dir)).model
        return self.float32

    def __call__(self, set_name: str, records: list[dict], prompt_ids: list[torch.Tensor],
                 greedy: list[list[int]]) -> list[dict]:
        """One row per output of ``records`` (a prompt set's) that differs from ``greedy``'s (per prompt index)."""
        recheck = self.cfg.medusa_benchmark.float32_recheck and self.policy.model.dtype != torch.float32
        decode = self.policy.tokenizer.decode
        rows = []
        for r in records:
            reference = greedy[r["prompt_index"]]
            if r["tokens"] == reference:
                continue
            position = first_difference(r["tokens"], reference)
            row = {"prompt_set": set_name, "decoder": r["decoder"], "prompt_index": r["prompt_index"],
                   "position": position}
            if position < min(len(r["tokens"]), len(reference)):
                greedy_token, token = reference[position], r["tokens"][position]
                context = torch.cat([prompt_ids[r["prompt_index"]][0].cpu(),
                                     torch.tensor(reference[:position], dtype=torch.long)])[None]  # (1, L + position)
                logits = next_token_logits(self.policy.model, context)
                top2 = logits.topk(2).values
                row |= {"greedy_token": greedy_token, "decoder_token": token, "greedy_text": decode([greedy_token]),
                        "decoder_text": decode([token]), "margin": float(logits[greedy_token] - logits[token]),
                        "top2_margin": float(top2[0] - top2[1]), "argmax": _choice(logits, greedy_token, token)}
                if recheck:
                    exact = next_token_logits(self._float32_model(), context)
                    row |= {"float32_margin": float(exact[greedy_token] - exact[token]),
                            "float32_choice": _choice(exact, greedy_token, token)}
            rows.append(row)
        return rows


DIVERGENCE_FIELDS = ["prompt_set", "decoder", "prompt_index", "position", "greedy_token", "decoder_token",
                     "greedy_text", "decoder_text", "margin", "top2_margin", "argmax", "float32_margin",
                     "float32_choice"]
METRIC_COLUMNS = ("tau", "speedup_vs_reference", "tokens_per_s", "identical_to_greedy", "plain_share")
CURVE_COLUMNS = ["prompt_set", "batch", "decoder", "speedup_vs_reference", "tokens_per_s", "tokens_per_forward",
                 "plain_share", "identical_to_reference", "batches"]
CURVE_METRICS = ("speedup_vs_reference", "tokens_per_s", "tokens_per_forward", "plain_share", "identical_to_reference")


def _medusa_report(cfg: Config, records: list[dict], rows: list[dict], divergences: list[dict], curve: list[dict],
                   tree, dtype: str, seconds: float) -> StageResult:
    """``benchmarks/medusa``: every output, the speed table, the divergences from greedy, the speed curve over batch
    sizes, the speedup, τ and curve plots (with their intervals), the report and the tree."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "medusa"
    divergence_table = pd.DataFrame(divergences, columns=DIVERGENCE_FIELDS)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(pd.DataFrame(records).drop(columns=["tokens"]), tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        write_table(divergence_table, tmp / "divergences.parquet")
        sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
        bar_plot({p: {r["decoder"]: interval_bar(r, "speedup_vs_reference") for r in rows
                      if r["prompt_set"] == p and "speedup_vs_reference" in r} for p in sets},
                 "Speedup over HF greedy (batch 1, same run)", "× greedy tokens/s", tmp / "speedup.png",
                 reference_line=1.0)
        bar_plot({p: {r["decoder"]: interval_bar(r, "tau") for r in rows
                      if r["prompt_set"] == p and r["tau"] == r["tau"]} for p in sets},
                 "Mean accepted length τ (tokens per forward)", "τ", tmp / "tau.png", reference_line=1.0)
        if curve:
            write_table(pd.DataFrame(curve), tmp / "speed_curve.csv")
            bar_plot(curve_bars(curve, lambda r: f"{r['prompt_set']} {r['decoder']}"),
                     "Batched Medusa over HF batched greedy, by batch size (same run)", "× greedy tokens/s",
                     tmp / "speed_curve.png", reference_line=1.0)
        (tmp / "report.md").write_text(_report(rows, divergence_table, curve, tree, dtype, cfg))
        write_json({"choices": [list(c) for c in tree.choices]}, tmp / "tree.json")
    metrics = {f"{r['prompt_set']}.{r['decoder']}.{column}": r[column] for r in rows
               for key in METRIC_COLUMNS for column in (key, f"{key}_low", f"{key}_high")
               if column in r and r[column] == r[column]}
    metrics |= {f"{r['prompt_set']}.{r['decoder']}.batch{r['batch']}.{column}": r[column] for r in curve
                for key in CURVE_METRICS for column in (key, f"{key}_low", f"{key}_high") if column in r}
    metrics["divergences"] = len(divergence_table)
    if divergence_table["float32_choice"].notna().any():
        metrics["divergences_float32_greedy_share"] = float((divergence_table["float32_choice"] == "greedy").mean())
    metrics["wall_seconds"] = seconds
    table_artifact(key="medusa-benchmark", table=display_rows(rows, SPEED_COLUMNS),
                   description="Speculative decoders against HF greedy: speed at batch 1, τ and identity at batch 1 "
                               "and batched (95 % intervals, * = significant)")
    markdown_artifact(key="medusa-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                      description="Medusa / RLMedusa benchmark report")
    return StageResult(metrics=metrics, tables={"medusa_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def _report(rows: list[dict], divergences: pd.DataFrame, curve: list[dict], tree, dtype: str, cfg: Config) -> str:
    s = cfg.medusa_benchmark
    rl_eval_path = _medusa_dir(cfg) / "rl" / "evaluation.json"
    lines = [
        "# Speculative decoding benchmark (Medusa, RLMedusa)",
        (f"\nPolicy in {dtype.removeprefix('torch.')}, max {s.max_new_tokens} new tokens, {s.acceptance} "
         f"verification, a {tree.size}-node tree (root included; "
         f"{'the paths held-out drafts were accepted on most often' if s.tree == 'auto' else 'as configured'}, "
         "choices in `tree.json`). Rows at `batch` 1 decode the first `speed_prompts` prompts one at a time, timed; "
         "`<decoder>_batched` rows decode every prompt of the set in batches of "
         f"{s.batch_size} with the batched tree engine (untimed; every step drafts). τ = generated tokens / model "
         "forwards (greedy = 1), and `identical_to_greedy` = share of prompts whose output equals HF greedy's token "
         f"for token (greedy decoding the set in left-padded batches of {s.batch_size}; the `greedy` row is HF greedy "
         "at batch 1 against it: what batching alone changes in this dtype), both over `prompts` prompts. Speedup "
         "= tokens/s over HF greedy with KV cache at batch 1, every decoder interleaved prompt by prompt. "
         "`plain_share` = share of forwards that verified no draft (adaptive mode). Brackets: "
         "95 % bootstrap intervals over prompts (paired with greedy's for the speedup); * = the interval "
         "excludes 1.\n"),
    ]
    for name in dict.fromkeys(r["prompt_set"] for r in rows):
        lines += [f"\n## Prompt set `{name}`\n", markdown_table([r for r in rows if r["prompt_set"] == name],
                                                                 SPEED_COLUMNS)]
    if curve:
        lines += [
            "\n## Speed against batch size\n",
            (f"Each prompt set's prompts in batches of {', '.join(map(str, s.curve_batch_sizes))} ({s.curve_batches} "
             "timed batches per size, every decoder on the same batch in turn): HF batched greedy (left-padded, the "
             "reference) against each Medusa decoder in the batched tree engine (greedy-verified"
             f"{', adaptive with one decision state per batch size' if s.adaptive else ', every step drafting'}). "
             "Speedup = tokens/s over the reference's with its 95 % interval over the batches (* = excludes 1); "
             "`tokens_per_forward` = generated tokens / batch forwards per row; `identical_to_reference` = share of "
             "rows equal to HF batched greedy's output, token for token (half precision rounds a batch's rows "
             "differently at each batch size). A bigger batch makes a tree forward cost more plain batch steps, so "
             "drafting pays less as the batch grows; the adaptive rule measures that cost at each size.\n"),
            markdown_table(curve, CURVE_COLUMNS),
        ]
    lines.append("\n## Outputs that differ from greedy\n")
    if divergences.empty:
        lines.append("None: every output equals HF greedy's token for token.")
    else:
        lines += [
            ("At the first differing position, one forward of the policy over prompt + common prefix, in its dtype: "
             "`margin` = logit of greedy's token − logit of the decoder's (≈ 0: a near-tie that rounding decides), "
             "`top2_margin` = top-1 − top-2 logit, `argmax` = whose token that forward picks; `float32_*`: the same "
             "from a float32 copy of the policy.\n"),
            markdown_table(divergences.to_dict("records"), DIVERGENCE_COLUMNS),
        ]
    if rl_eval_path.is_file():
        t2 = json.loads(rl_eval_path.read_text())["t_plus_2"]
        lines += ["\n## Head 1 (predicts t + 2): supervised vs RLMedusa, held-out accuracy\n",
                  markdown_table([{"head": name, **values} for name, values in t2.items()])]
    return "\n".join(lines) + "\n"
