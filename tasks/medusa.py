"""Prefect tasks of the Medusa stages: Medusa-1 heads, RLMedusa's t + 2 head, and the speed benchmark.

Thin wrappers around :mod:`models.medusa.training`, :mod:`models.medusa.rlmedusa` and :mod:`models.engine.speculative`:
they read the data, split it by prompt, log progress, and write each output folder atomically.

* ``train_medusa`` — the policy's greedy responses to the training prompts (or the generated samples),
  one frozen pass over them (kept in ``distilled/`` for the RL stage, its hidden states read back from disk
  as training needs them), then Medusa-1 training of K heads; held-out top-1/top-k accuracy per head.
* ``train_rlmedusa`` — the reward model r(e, h) (MSE on the base model's t + 2 probabilities), then head 1
  by REINFORCE on r − β·KL; held-out accuracy at t + 2 of the RL head against the supervised head.
* ``benchmark_medusa`` — HF greedy, HF prompt-lookup, Medusa (supervised heads) and Medusa-RL (head 1
  from RLMedusa) at batch 1: τ, tokens/s, speedup over greedy in the same run, identical-output share.

The two training tasks may run in every process of ``accelerate launch`` (docs/gpu.md): each process trains
on its share of every batch, only the main process writes (the distilled cache, then the heads), and all wait
for each other after the writes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from foresight.benchmark import interleaved_decoding, markdown_table, speed_row
from foresight.config import Config, component
from foresight.plots import bar_plot, line_plot
from foresight.storage import atomic_path, read_table, write_json, write_table
from tasks.data import (
    StageResult,
    gpu_task,
    load_stage_policy,
    markdown_artifact,
    read_prompts,
    split_responses,
    stage_accelerator,
    stage_logger,
    table_artifact,
)

SPLIT_FILE = "split.safetensors"  # in distilled/: the sample rows of the training and held-out prompts


def _medusa_dir(cfg: Config) -> Path:
    return cfg.path(cfg.paths.medusa_dir)


def _distillation_data(cfg: Config, policy) -> pd.DataFrame:
    """The responses Medusa learns from (``medusa.data``): the policy's greedy responses to the training
    prompts, or the first ``medusa.samples_per_prompt`` generated samples per prompt."""
    from models.medusa.training import greedy_responses

    m = cfg.medusa
    if m.data == "greedy":
        prompts = read_prompts(cfg, "train")
        if prompts.empty:
            raise ValueError("no training prompts to distil from: set prompts.num_train > 0")
        return greedy_responses(policy, prompts, m.max_new_tokens, m.distill_batch_size, cfg.prompts.system_prompt)
    samples = read_table(cfg.path(cfg.paths.samples), "generated samples")
    if samples.empty:
        raise ValueError(f"{cfg.path(cfg.paths.samples)} has no samples to distil from: run the generate stage")
    return samples[samples["sample_index"] < m.samples_per_prompt].reset_index(drop=True)


def _accuracy_metrics(prefix: str, accuracy: dict[str, list[float]]) -> dict[str, float]:
    return {f"{prefix}{name}_head{k + 1}": value for name, values in accuracy.items() if name != "rank_accuracy"
            for k, value in enumerate(values)}


@gpu_task("train-medusa")
def train_medusa_task(cfg: Config) -> StageResult:
    """Self-distil (greedy responses or generated samples), train Medusa-1 heads, evaluate them on held-out prompts.

    Writes ``distilled/`` (the responses, the frozen pass's cache — hidden states, targets and RL candidates —
    and the train/held-out split) and ``supervised/`` (heads, ``evaluation.json``, ``history.json``,
    ``loss.png``).
    """
    from models.medusa.config import MedusaTraining
    from models.medusa.training import evaluate_heads, train_medusa_heads

    logger = stage_logger()
    started = time.perf_counter()
    m = cfg.medusa
    training = component(MedusaTraining, m)
    policy = load_stage_policy(cfg, "base")
    accelerator = stage_accelerator(policy, m.mixed_precision)
    distill_started = time.perf_counter()
    if accelerator.is_main_process:  # one pass, one cache on disk: every process then reads it from there
        _distil(cfg, policy, training, _medusa_dir(cfg) / "distilled")
    accelerator.wait_for_everyone()
    data, train_rows, eval_rows = load_distilled(cfg)
    distill_seconds = time.perf_counter() - distill_started
    train, held_out = data.subset(train_rows), data.subset(eval_rows)
    logger.info("%d training / %d held-out positions; training %d heads", len(train.hidden), len(held_out.hidden),
                m.num_heads)

    def on_step(step: int, num_steps: int, losses: dict[str, float]) -> None:
        if step % max(1, num_steps // 10) == 0 or step == num_steps:
            logger.info("step %d/%d, loss %.4f", step, num_steps, losses["loss"])

    train_started = time.perf_counter()
    heads, history = train_medusa_heads(policy, train, training, accelerator, on_step)
    train_seconds = time.perf_counter() - train_started
    lm_head = policy.model.get_output_embeddings()
    accuracy = evaluate_heads(heads, lm_head, held_out, m.eval_top_k)
    logger.info("held-out top-1 per head: %s, top-%d: %s", accuracy["top1"], m.eval_top_k, accuracy[f"top{m.eval_top_k}"])

    out = _medusa_dir(cfg) / "supervised"
    if accelerator.is_main_process:
        with atomic_path(out) as tmp:
            heads.save(tmp)
            write_json({"held_out": accuracy, "num_train_positions": len(train.hidden),
                        "num_eval_positions": len(held_out.hidden)}, tmp / "evaluation.json")
            (tmp / "history.json").write_text(json.dumps(history) + "\n")
            steps = list(range(1, len(history["loss"]) + 1))
            line_plot({f"head {k + 1}": (steps, history[f"ce_head{k + 1}"]) for k in range(m.num_heads)},
                      "Medusa-1 training: cross-entropy per head", "step", "cross-entropy", tmp / "loss.png")
    accelerator.wait_for_everyone()
    metrics = {"num_responses": len(train_rows) + len(eval_rows), "num_train_positions": len(train.hidden),
               "num_eval_positions": len(held_out.hidden), "distill_seconds": distill_seconds,
               "train_seconds": train_seconds, "final_loss": history["loss"][-1],
               **_accuracy_metrics("", accuracy), "wall_seconds": time.perf_counter() - started}
    return StageResult(metrics=metrics, artifacts={"medusa_supervised": out})


def _distil(cfg: Config, policy, training, folder: Path) -> None:
    """The responses to learn from, their split by prompt, and the frozen pass over them, written to ``folder``."""
    from models.medusa.config import RLMedusaCandidates
    from models.medusa.training import self_distill

    logger = stage_logger()
    m = cfg.medusa
    logger.info("self-distillation data: %s", "greedy responses to the training prompts" if m.data == "greedy"
                else "the generated samples")
    responses = _distillation_data(cfg, policy)
    train_rows, eval_rows = split_responses(responses, m.eval_fraction, m.seed)
    logger.info("self-distillation pass over %d responses (%d prompts held out)", len(responses),
                responses.iloc[eval_rows.tolist()]["prompt_id"].nunique())
    with atomic_path(folder) as tmp:
        self_distill(policy, responses, training, component(RLMedusaCandidates, cfg.rlmedusa), tmp)
        save_file({"train_samples": train_rows, "eval_samples": eval_rows}, tmp / SPLIT_FILE)
        write_table(responses, tmp / "responses.parquet")


def load_distilled(cfg: Config):
    """The ``train_medusa`` stage's frozen-pass cache (hidden states memory-mapped) and its train / held-out
    sample split."""
    from models.medusa.training import load_distilled as load_cache

    folder = _medusa_dir(cfg) / "distilled"
    if not (folder / SPLIT_FILE).is_file():
        raise FileNotFoundError(f"{folder / SPLIT_FILE} is missing: run the train_medusa stage first")
    split = load_file(folder / SPLIT_FILE)
    return load_cache(folder), split["train_samples"], split["eval_samples"]


@gpu_task("train-rlmedusa")
def train_rlmedusa_task(cfg: Config) -> StageResult:
    """Fit r(e, h), train head 1 by REINFORCE, compare it with the supervised head 1 at t + 2.

    Writes ``rl/``: per ``rlmedusa.inits`` entry a folder of heads to decode with (the supervised heads
    with head 1 replaced), the reward model, ``evaluation.json`` (held-out accuracy of every head, and of
    head 1 at t + 2 for supervised, each RL head and its start), ``history.json`` and ``rl.png``.
    """
    from models.medusa.config import RLMedusaTraining
    from models.medusa.heads import MedusaHeads
    from models.medusa.rlmedusa import evaluate_reward_model, fit_reward_model, train_rl_head
    from models.medusa.training import evaluate_heads

    logger = stage_logger()
    started = time.perf_counter()
    r = cfg.rlmedusa
    training = component(RLMedusaTraining, r)
    data, train_rows, eval_rows = load_distilled(cfg)
    train, held_out = data.subset(train_rows), data.subset(eval_rows)
    if len(train.rl_rows) == 0:
        raise ValueError("no RL trajectory states: every training response is shorter than 3 tokens")
    policy = load_stage_policy(cfg, "base")
    lm_head = policy.model.get_output_embeddings()
    embedding = policy.model.get_input_embeddings()
    supervised = MedusaHeads.load(_medusa_dir(cfg) / "supervised", lm_head)

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embedding(tokens.to(embedding.weight.device))

    accelerator = stage_accelerator(policy)
    logger.info("fitting r(e, h) on %d states × %d candidates", len(train.rl_rows), train.rl_candidates.shape[1])
    reward_model, reward_losses = fit_reward_model(train.rl_states(), embed, train.rl_candidates, train.rl_probs,
                                                   training, accelerator)
    reward_eval = evaluate_reward_model(reward_model, held_out.rl_states(), embed, held_out.rl_candidates,
                                        held_out.rl_probs)
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
        rl_heads[init], histories[init] = train_rl_head(start, lm_head, reward_model, embed, train.rl_states(),
                                                        training, accelerator, on_step)
        accuracy[f"rl_{init}"] = evaluate_heads(rl_heads[init], lm_head, held_out, cfg.medusa.eval_top_k)
        accuracy[f"start_{init}"] = (accuracy["supervised"] if start is supervised
                                     else evaluate_heads(start, lm_head, held_out, cfg.medusa.eval_top_k))
    # head 1 predicts t + 2: its accuracies are the first entry of each list
    t2 = {name: {metric: values[0] for metric, values in a.items() if metric != "rank_accuracy"}
          for name, a in accuracy.items()}
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
            line_plot({f"{what}, start {init}": (list(range(1, len(histories[init][key]) + 1)), histories[init][key])
                       for init in r.inits for what, key in (("mean r(e, h) of sampled tokens", "reward"),
                                                             ("KL to start", "kl"))},
                      "RLMedusa: head 1 policy gradient", "step", "value", tmp / "rl.png")
    accelerator.wait_for_everyone()
    metrics = {"reward_model_mse": reward_eval["mse"], "reward_model_top1_ranked_first": reward_eval["top1_ranked_first"],
               **{f"rl_{init}_final_reward": histories[init]["reward"][-1] for init in r.inits},
               **{f"rl_{init}_final_kl": histories[init]["kl"][-1] for init in r.inits},
               **{f"{name}_t2_{metric}": value for name, d in t2.items() for metric, value in d.items()},
               "rl_beats_supervised_top1": float(winner != "supervised"), "wall_seconds": time.perf_counter() - started}
    return StageResult(metrics=metrics, artifacts={"medusa_rl": out})


SPEED_COLUMNS = ["prompt_set", "decoder", "lossless", "tau", "tokens_per_s", "ms_per_token", "speedup_vs_reference",
                 "identical_to_greedy", "prompts"]


def _prompt_sets(cfg: Config) -> dict[str, list[str]]:
    """``held_out`` (the first ``medusa_benchmark.num_prompts`` of the eval split) plus one set per prompt file."""
    from foresight.prompts import file_prompts

    s = cfg.medusa_benchmark
    sets = {"held_out": read_prompts(cfg, "eval")["question"].head(s.num_prompts).tolist()}
    for file_cfg in s.prompt_files:
        sets[Path(file_cfg.path).stem] = file_prompts(file_cfg, cfg.root)["question"].head(s.num_prompts).tolist()
    for name, questions in sets.items():
        if not questions:
            raise ValueError(f"prompt set {name!r} is empty")
    return sets


def candidate_tree(cfg: Config):
    """The configured tree, or (``auto``) Medusa's sparse tree from the supervised heads' held-out accuracy
    per rank. Every Medusa decoder uses the same tree, so they differ only in their heads."""
    from models.engine.speculative import build_tree, sparse_tree

    s = cfg.medusa_benchmark
    if s.tree != "auto":
        return build_tree(s.tree)
    evaluation = _medusa_dir(cfg) / "supervised" / "evaluation.json"
    if not evaluation.is_file():
        raise FileNotFoundError(f"{evaluation} is missing: run the train_medusa stage (speculative.tree: auto reads it)")
    rank_accuracy = json.loads(evaluation.read_text())["held_out"]["rank_accuracy"]
    return build_tree(sparse_tree(rank_accuracy, s.tree_size))


@gpu_task("benchmark-medusa")
def benchmark_medusa_task(cfg: Config) -> StageResult:
    """Every speculative decoder against HF greedy at batch 1, prompt by prompt, on each prompt set."""
    from models.engine.generation import chat_prompts, encode_prompt

    logger = stage_logger()
    started = time.perf_counter()
    policy = load_stage_policy(cfg, "base")
    tree = candidate_tree(cfg)
    decoders = _medusa_decoders(cfg, policy, tree)
    records, rows = [], []
    for set_name, questions in _prompt_sets(cfg).items():
        prompt_ids = [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, questions,
                                                                      cfg.prompts.system_prompt)]
        timers, decoded = interleaved_decoding(list(decoders), prompt_ids,
                                               lambda decoder, ids, n: decoders[decoder](ids, n),
                                               cfg.medusa_benchmark.max_new_tokens, f"speculative decoding ({set_name})")
        set_records = [{"prompt_set": set_name, "prompt_index": r["prompt_index"], "decoder": r["decoder"],
                        "tokens": r["tokens"], "new_tokens": len(r["tokens"]),
                        "forwards": r["stats"].forwards if r["stats"] else None,
                        "response": policy.tokenizer.decode(r["tokens"], skip_special_tokens=True)} for r in decoded]
        set_rows = _speed_rows(cfg, set_name, set_records, timers, len(prompt_ids))
        logger.info("\n%s", markdown_table(set_rows, SPEED_COLUMNS))
        records += set_records
        rows += set_rows
    return _medusa_report(cfg, records, rows, tree, time.perf_counter() - started)


def _medusa_decoders(cfg: Config, policy, tree) -> dict[str, Callable]:
    """Name → ``decode(ids, max_new_tokens) → (tokens, stats or None)``: HF greedy (the reference), prompt lookup,
    and one Medusa drafter per trained set of heads, all on ``tree`` with the configured verification."""
    from models.engine.config import TypicalAcceptance
    from models.engine.decoding import GREEDY, hf_decode
    from models.engine.generation import end_token_ids
    from models.engine.speculative import TreeVerifier, speculative_generate
    from models.medusa.heads import MedusaDrafter, MedusaHeads

    s = cfg.medusa_benchmark
    eos = end_token_ids(policy)
    acceptance = (None if s.acceptance == "greedy"
                  else TypicalAcceptance(posterior_threshold=s.typical_threshold, posterior_alpha=s.typical_alpha))
    verifier = TreeVerifier(acceptance)
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
        return lambda ids, max_new_tokens: speculative_generate(policy.model, drafter, verifier, ids, max_new_tokens, eos)

    return {name: hf(kwargs) for name, kwargs in hf_kwargs.items()} | {
        name: speculative(drafter) for name, drafter in drafters.items()}


def _speed_rows(cfg: Config, set_name: str, records: list[dict], timers: dict, num_prompts: int) -> list[dict]:
    """One row per decoder of a prompt set: τ, speed against HF greedy, and the share of outputs equal to greedy's."""
    outputs = pd.DataFrame(records)
    reference = outputs[outputs["decoder"] == "greedy"].set_index("prompt_index")["tokens"]
    rows = []
    for decoder, mine in outputs.groupby("decoder", sort=False):
        tokens = mine.set_index("prompt_index")["tokens"]
        identical = float(sum(tokens[i] == reference[i] for i in reference.index) / len(reference))
        # greedy makes one forward per token, the prefill included; prompt lookup does not expose its forwards
        forwards = (mine["forwards"].sum() if mine["forwards"].notna().all()
                    else mine["new_tokens"].sum() if decoder == "greedy" else 0)
        lossless = decoder in ("greedy", "prompt_lookup") or cfg.medusa_benchmark.acceptance == "greedy"
        rows.append({"prompt_set": set_name, "decoder": decoder, "lossless": lossless,
                     "tau": float(timers[decoder].tokens / forwards) if forwards else float("nan"),
                     **speed_row(timers[decoder], timers["greedy"]), "identical_to_greedy": identical,
                     "prompts": num_prompts})
    return rows


def _medusa_report(cfg: Config, records: list[dict], rows: list[dict], tree, seconds: float) -> StageResult:
    """``benchmarks/medusa``: every output, the speed table, the speedup and τ plots, the report and the tree."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "medusa"
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(pd.DataFrame(records).drop(columns=["tokens"]), tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        sets = sorted({r["prompt_set"] for r in rows})
        bar_plot({p: {r["decoder"]: r["speedup_vs_reference"] for r in rows if r["prompt_set"] == p} for p in sets},
                 "Speedup over HF greedy (batch 1, same run)", "× greedy tokens/s", tmp / "speedup.png",
                 reference_line=1.0)
        bar_plot({p: {r["decoder"]: r["tau"] for r in rows if r["prompt_set"] == p and r["tau"] == r["tau"]}
                  for p in sets}, "Mean accepted length τ (tokens per forward)", "τ", tmp / "tau.png",
                 reference_line=1.0)
        (tmp / "report.md").write_text(_report(rows, tree, cfg))
        write_json({"choices": [list(c) for c in tree.choices]}, tmp / "tree.json")
    metrics = {f"{r['prompt_set']}.{r['decoder']}.{key}": r[key] for r in rows
               for key in ("tau", "tokens_per_s", "speedup_vs_reference", "identical_to_greedy")
               if r[key] == r[key]}
    metrics["wall_seconds"] = seconds
    table_artifact(key="medusa-benchmark", table=[{c: r[c] for c in SPEED_COLUMNS} for r in rows],
                          description="Speculative decoders against HF greedy at batch 1")
    markdown_artifact(key="medusa-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                             description="Medusa / RLMedusa benchmark report")
    return StageResult(metrics=metrics, tables={"medusa_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def _report(rows: list[dict], tree, cfg: Config) -> str:
    s = cfg.medusa_benchmark
    rl_eval_path = _medusa_dir(cfg) / "rl" / "evaluation.json"
    lines = [
        "# Speculative decoding benchmark (Medusa, RLMedusa)",
        f"\nBatch 1, max {s.max_new_tokens} new tokens, {s.acceptance} verification, a {tree.size}"
        f"-node tree (root included; {'sparse tree from held-out head accuracies' if s.tree == 'auto' else 'as configured'}"
        f", choices in `tree.json`). τ = generated tokens / model forwards (greedy = 1). Speedup = tokens/s over "
        "HF greedy with KV cache, measured prompt by prompt in the same run. `identical_to_greedy` = share of "
        "prompts whose output equals HF greedy's token for token.\n",
        markdown_table(rows, SPEED_COLUMNS),
    ]
    if rl_eval_path.is_file():
        t2 = json.loads(rl_eval_path.read_text())["t_plus_2"]
        lines += ["\n## Head 1 (predicts t + 2): supervised vs RLMedusa, held-out accuracy\n",
                  markdown_table([{"head": name, **values} for name, values in t2.items()])]
    return "\n".join(lines) + "\n"
