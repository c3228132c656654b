"""Prefect task of the ``distill`` stage: the self-distillation data every drafter learns from.

Medusa's heads (Medusa §2.3.2, self-distillation), RLMedusa, COrAL and the MTP module all learn from the policy's
own responses (docs/medusa.md, docs/pipeline.md): by default its greedy responses to the training prompts (and, for
Medusa's heads alone, to further prompts of their source), or the generate stage's samples; and either way its
greedy responses to training instructions of the general set (:func:`foresight.prompts.general_instructions`) and
to instructions it writes itself from them (Self-Instruct §2.2: :mod:`foresight.self_instruct`). The
stage writes them once, with their one train / held-out split by prompt, so that no method's knobs change another
method's data and every drafter is measured on the same held-out sequences. The frozen pass over them is
Medusa's (``train_medusa``); the readers are :mod:`tasks.distilled`'s ``shared_distilled_responses``, ``sft_responses``
and ``drafter_split``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pandas as pd
from safetensors.torch import save_file

from foresight.prompts import further_prompts, general_instructions
from foresight.self_instruct import self_instruct_prompts
from foresight.storage import atomic_path, read_table, write_json, write_table
from models.engine.decoding import greedy_responses
from tasks.common import StageResult, drop_long_prompt_sets, gpu_task, load_stage_policy, read_prompts, stage_logger
from tasks.distilled import DISTILLED_SPLIT_FILE, split_distilled

if TYPE_CHECKING:
    from foresight.config import Config

RESPONSES_FILE = "responses.parquet"
"""In ``${paths.distill_dir}``: the responses, one row per (prompt, sample), with ``prompt_set`` (``task`` /
``general``), ``further_prompt`` and ``self_instruct``."""
DROPPED_PROMPTS_FILE = "dropped_long_prompts.json"
"""In ``${paths.distill_dir}``: the prompts left out of the distillation as over the prompt limit, per prompt set
(``dropped_long_prompts.further`` / ``.general`` / ``.self_instruct``: :func:`tasks.common.drop_long_prompt_sets`)."""


def _distillation_data(cfg: Config, policy) -> tuple[pd.DataFrame, dict[str, int]]:
    """The responses the drafters learn from (``distill.data``): the policy's greedy responses to
    ``distill.task_prompts`` task prompts (the training prompts, then further prompts of their source), or the first
    ``distill.samples_per_prompt`` generated samples per prompt; then, either way, its greedy responses to the first
    ``distill.general_prompts`` training instructions of the general set (same chat template, same
    ``max_new_tokens``), and to ``distill.self_instruct_prompts`` instructions the policy wrote itself from the
    training instructions (:func:`foresight.self_instruct.self_instruct_prompts`), so that the heads also learn to
    draft open-ended text. Column ``prompt_set`` says which (``task`` / ``general``: the written instructions are
    ``general``), column ``further_prompt`` marks the responses to further prompts (Medusa's heads' alone:
    :func:`tasks.distilled.shared_distilled_responses`), column ``self_instruct`` those to written instructions.

    The further prompts and the general and written instructions come from outside the splits ``prepare_prompts``
    checked: the ones longer than the prompt limit are dropped (:func:`tasks.common.drop_long_prompt_sets`), and
    counted in the metrics returned beside the responses (``dropped_long_prompts.further`` / ``.general`` /
    ``.self_instruct``)."""
    d = cfg.distill
    general = general_instructions("train", d.general_prompts)
    # every training instruction seeds the writing, never a held-out one (the benchmarks' general set)
    written = self_instruct_prompts(policy, general_instructions("train"), general_instructions("eval"),
                                    d.self_instruct_prompts, d.self_instruct, cfg.prompts.system_prompt)
    instructions = {"general": general, "self_instruct": written}

    def greedy(prompts: pd.DataFrame) -> pd.DataFrame:
        return greedy_responses(policy, prompts, d.max_new_tokens, d.batch_size, cfg.prompts.system_prompt)

    if d.data == "greedy":
        prompts = read_prompts(cfg, "train")
        if prompts.empty:
            raise ValueError("no training prompts to distil from: set prompts.num_train > 0")
        further = prompts.iloc[:0]
        if d.task_prompts > len(prompts):
            taken = pd.concat([prompts, read_prompts(cfg, "eval")], ignore_index=True)
            further = further_prompts(cfg.prompts, cfg.root, d.task_prompts - len(prompts), taken)
        kept, dropped = drop_long_prompt_sets(cfg, policy.tokenizer, {"further": further, **instructions},
                                              d.max_new_tokens)
        further, general, written = kept["further"], kept["general"], kept["self_instruct"]
        if d.task_prompts > len(prompts):
            stage_logger().info("%d training prompts and %d further prompts of the %s source", len(prompts),
                                len(further), cfg.prompts.source)
        responses = greedy(pd.concat([prompts, further, general, written], ignore_index=True))
        tasks, instructions = len(prompts) + len(further), len(general) + len(written)
        return responses.assign(prompt_set=["task"] * tasks + ["general"] * instructions,
                                further_prompt=[False] * len(prompts) + [True] * len(further) + [False] * instructions,
                                self_instruct=[False] * (tasks + len(general)) + [True] * len(written)), dropped
    samples = read_table(cfg.path(cfg.paths.samples), "generated samples")
    if samples.empty:
        raise ValueError(f"{cfg.path(cfg.paths.samples)} has no samples to distil from: run the generate stage")
    samples = samples[samples["sample_index"] < d.samples_per_prompt].assign(prompt_set="task", further_prompt=False,
                                                                             self_instruct=False)
    kept, dropped = drop_long_prompt_sets(cfg, policy.tokenizer, instructions, d.max_new_tokens)
    general = pd.concat([kept["general"], kept["self_instruct"]], ignore_index=True)
    if general.empty:
        return samples.reset_index(drop=True), dropped
    return pd.concat([samples, greedy(general).assign(prompt_set="general", further_prompt=False,
                                                      self_instruct=[False] * len(kept["general"])
                                                      + [True] * len(kept["self_instruct"]))],
                     ignore_index=True), dropped


@gpu_task("distill")
def distill_task(cfg: Config) -> StageResult:
    """The policy's responses to learn from and their split by prompt (:func:`tasks.distilled.split_distilled`).

    Writes ``${paths.distill_dir}``: :data:`RESPONSES_FILE`, the split (:data:`tasks.distilled.DISTILLED_SPLIT_FILE`:
    ``train_samples`` / ``eval_samples``, rows of the responses) and :data:`DROPPED_PROMPTS_FILE`.
    """
    logger = stage_logger()
    started = time.perf_counter()
    d = cfg.distill
    policy = load_stage_policy(cfg, "base")
    logger.info("self-distillation data: %s, and greedy responses to %d instructions of the general set and %d the "
                "policy writes", "greedy responses to the training prompts" if d.data == "greedy"
                else "the generated samples", d.general_prompts, d.self_instruct_prompts)
    responses, dropped = _distillation_data(cfg, policy)
    distill_seconds = time.perf_counter() - started
    train_rows, eval_rows = split_distilled(responses, d.eval_fraction, d.seed)
    logger.info("%d responses (%d prompts held out)", len(responses),
                responses.iloc[eval_rows.tolist()]["prompt_id"].nunique())
    out = cfg.path(cfg.paths.distill_dir)
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        write_table(responses, tmp / RESPONSES_FILE)
        save_file({"train_samples": train_rows, "eval_samples": eval_rows}, tmp / DISTILLED_SPLIT_FILE)
        write_json(dropped, tmp / DROPPED_PROMPTS_FILE)
    prompt_sets = responses["prompt_set"]
    metrics = {"num_responses": len(responses), **dropped,
               **{f"num_{name}_responses": int((prompt_sets == name).sum()) for name in sorted(set(prompt_sets))},
               "num_further_responses": int(responses["further_prompt"].sum()),
               "num_self_instruct_responses": int(responses["self_instruct"].sum()),
               "num_train_responses": len(train_rows), "num_eval_responses": len(eval_rows),
               "distill_seconds": distill_seconds, "wall_seconds": time.perf_counter() - started}
    return StageResult(metrics=metrics, tables={"responses": out / RESPONSES_FILE})
