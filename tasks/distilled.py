"""Readers of the ``distill`` stage's output: the policy's own responses that the drafters learn from and their one
held-out split, shared by Medusa's heads, COrAL and the MTP module (so that every drafter's accuracy and acceptance
are measured on the same held-out sequences; docs/medusa.md, "One held-out split for every drafter").

Used by the medusa, coral and mtp tasks only, and by the ``distill`` stage that writes them (:mod:`tasks.distill`: the
split).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from safetensors.torch import load_file

from foresight.storage import read_table
from models.common.splits import split_by_prompt

if TYPE_CHECKING:
    from foresight.config import Config


DISTILLED_SPLIT_FILE = "split.safetensors"
"""In the ``distill`` stage's folder: the rows of ``responses.parquet`` held out (``eval_samples``) and trained on
(``train_samples``); every drafter that learns from these responses uses this one split."""


def distilled_dir(cfg: Config) -> Path:
    """The ``distill`` stage's folder: the distilled responses and their split (``${paths.distill_dir}``)."""
    return cfg.path(cfg.paths.distill_dir)


def split_distilled(responses: pd.DataFrame, eval_fraction: float, seed: int):
    """Training and held-out rows of the distilled responses, split by prompt among the responses to the training
    prompts and the hand-written general instructions; the responses to further task prompts (the Medusa heads'
    alone) and to the instructions the policy wrote (``self_instruct``) all train. So the held-out sequences are
    the same for Medusa, COrAL and the MTP module (:func:`drafter_split`), and the same with or without written
    instructions: a drafter's acceptance is measured on the instructions people wrote."""
    always_train = responses["further_prompt"].to_numpy(bool) | responses["self_instruct"].to_numpy(bool)
    shared = responses.index[~always_train]
    train_shared, eval_rows = split_responses(responses.loc[shared], eval_fraction, seed)
    # copies: pandas' copy-on-write hands out read-only arrays, which torch.from_numpy warns about sharing
    further = torch.from_numpy(responses.index[always_train].to_numpy(copy=True))
    shared_rows = torch.from_numpy(shared.to_numpy(copy=True))
    train_rows = torch.cat([shared_rows[train_shared], further]).sort().values
    return train_rows, shared_rows[eval_rows]


def shared_distilled_responses(cfg: Config, key: str, further: bool = False) -> pd.DataFrame:
    """The responses of the ``distill`` stage that every drafter learns from — those to the training prompts and
    general instructions; those to further task prompts (``distill.task_prompts``, Medusa's heads') only with
    ``further`` — indexed by their row in its ``responses.parquet``. ``key`` names the setting that reads them."""
    path = distilled_dir(cfg) / "responses.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the distill stage ({key} reads it)")
    responses = read_table(path, "distilled responses")
    return responses if further else responses[~responses["further_prompt"]]


def sft_responses(cfg: Config, source: str, key: str, further: bool = False) -> pd.DataFrame:
    """Responses a stage fine-tunes on: ``distilled`` = the policy's own (greedy) responses to the training prompts
    and general instructions of the ``distill`` stage, with ``further`` also those to the further task
    prompts its heads learn from (:func:`shared_distilled_responses`; column ``distilled_row`` keeps their row
    there; further rows always train, :func:`split_distilled`); ``correct`` = the generated samples the labeler
    marked correct. ``key`` names the setting."""
    if source == "distilled":
        responses = (shared_distilled_responses(cfg, f"{key}: distilled", further).rename_axis("distilled_row")
                     .reset_index())
    else:
        scores = read_table(cfg.path(cfg.paths.scores), "scored samples")
        responses = scores[scores["correct"].fillna(False).astype(bool)].reset_index(drop=True)
        if responses.empty:
            raise ValueError(f"{cfg.path(cfg.paths.scores)} has no sample labeled correct: {key}: correct needs "
                             "prompts with known answers and a verifiable labeler")
    if responses.empty:
        raise ValueError(f"no responses to train on ({key}: {source})")
    return responses


def sampled_responses(cfg: Config, per_prompt: int, key: str) -> pd.DataFrame:
    """The ``generate`` stage's first ``per_prompt`` samples of each prompt (as the ``label`` stage scored them), as
    rows that join :func:`sft_responses`' distilled ones and always train (``distilled_row`` −1, ``prompt_set``
    ``task``): those of the prompts whose distilled responses the split holds out are left out, so that no held-out
    prompt's text is learnt from. ``key`` names the setting."""
    path = cfg.path(cfg.paths.scores)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the generate and label stages ({key} reads it)")
    samples = read_table(path, "scored samples")
    distilled = shared_distilled_responses(cfg, key)
    held_out = set(distilled.loc[distilled.index.isin(held_out_distilled_rows(cfg)), "prompt_id"])
    kept = samples[(samples["sample_index"] < per_prompt) & ~samples["prompt_id"].isin(held_out)]
    if kept.empty:
        raise ValueError(f"{path} has no sample of a training prompt to learn from ({key}: {per_prompt})")
    return kept[["prompt_id", "sample_index", "prompt", "response", "finish_reason"]].assign(
        prompt_set="task", further_prompt=False, self_instruct=False, distilled_row=-1).reset_index(drop=True)


def drafter_split(cfg: Config, responses: pd.DataFrame, eval_fraction: float, seed: int):
    """Row indices of training and held-out ``responses`` (from :func:`sft_responses`). Distilled responses take
    the ``distill`` stage's split (:data:`DISTILLED_SPLIT_FILE`), so that every drafter's accuracy and acceptance are
    measured on the same held-out sequences; ``eval_fraction`` and ``seed`` split other responses by prompt."""
    if "distilled_row" not in responses:
        return split_responses(responses, eval_fraction, seed)
    # a copy, as in split_distilled
    is_eval = torch.from_numpy(responses["distilled_row"].isin(held_out_distilled_rows(cfg)).to_numpy(copy=True))
    rows = torch.arange(len(responses))
    return rows[~is_eval], rows[is_eval]


def held_out_distilled_rows(cfg: Config):
    """The rows of the ``distill`` stage's ``responses.parquet`` its split holds out (:data:`DISTILLED_SPLIT_FILE`'s
    ``eval_samples``, a numpy array)."""
    path = distilled_dir(cfg) / DISTILLED_SPLIT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the distill stage first")
    return load_file(path)["eval_samples"].numpy()


def validation_split(responses: pd.DataFrame, train_rows, fraction: float, seed: int):
    """``train_rows`` split by prompt into rows to fit on and validation rows that decide when training stops
    (:class:`models.common.training.EarlyStopping`): the held-out rows that a stage reports its accuracy on never
    choose the epoch they are measured at."""
    fit, validation = split_responses(responses.iloc[train_rows.tolist()], fraction, seed)
    return train_rows[fit], train_rows[validation]


def split_responses(responses: pd.DataFrame, eval_fraction: float, seed: int):
    """Row indices of training and held-out responses, split by prompt; an error if either side is empty."""
    train_rows, eval_rows = split_by_prompt(responses, eval_fraction, seed)
    if len(train_rows) == 0 or len(eval_rows) == 0:
        raise ValueError(f"{len(responses)} responses from {responses['prompt_id'].nunique()} prompt(s) cannot be split "
                         "into training and held-out prompts: at least 2 prompts are needed")
    return train_rows, eval_rows
