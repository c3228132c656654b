"""Preference pairs from scored samples (the input of reward-channel training and DPO).

Per prompt, with ``pairing: all`` (the default): every (chosen, rejected) pair of its samples whose scores differ
by more than ``min_score_gap`` — under the verifiable labeler, every (correct, incorrect) pair, so 2 right and 2
wrong answers give 4 pairs where best–worst gives 1, and the reward channel trains on all of them. With
``pairing: best_worst``: the highest-scoring sample against the lowest only. Either way the prompt's best–worst
pair is flagged (``best_worst``), so DPO can keep to one pair per prompt (``dpo.pairs``). ``max_pairs_per_prompt``
caps ``all``: continuous scores (a reward model's) are all distinct, so n samples give C(n, 2) pairs (every pair
one forward of each response per reward-training epoch); the cap keeps the widest score gaps, ties broken by the
chosen, then the rejected sample's index, which puts the best–worst pair first (its gap is the widest, and its
samples are the lowest-indexed best and worst), so it always stays. A prompt whose best
and worst scores differ by no more than ``min_score_gap`` (all equal, a single sample, all right or all wrong
under the verifiable labeler) carries no preference and is dropped and counted. Ties for best or worst are
broken by sample index, so the result is deterministic.
"""

from __future__ import annotations

import random
from typing import Literal

import pandas as pd

SAMPLE_COLUMNS = [
    "sample_id", "prompt_id", "sample_index", "question", "prompt", "response", "answer",
    "prompt_tokens", "response_tokens", "finish_reason",
    "temperature", "top_p", "top_k", "max_new_tokens", "seed", "model",
]
SCORE_COLUMNS = SAMPLE_COLUMNS + ["score", "correct", "extracted_answer", "labeler"]
PAIR_COLUMNS = [
    "prompt_id", "question", "prompt", "answer", "chosen", "rejected", "chosen_score", "rejected_score",
    "score_gap", "chosen_sample_id", "rejected_sample_id", "best_worst",
]

Pairing = Literal["all", "best_worst"]
"""Which pairs of a prompt's samples :func:`make_pairs` builds (``validate.pairing``)."""


def make_pairs(scores: pd.DataFrame, min_score_gap: float = 0.0, pairing: Pairing = "all",
               max_pairs_per_prompt: int | None = None) -> tuple[pd.DataFrame, dict]:
    """The (chosen, rejected) pairs of every prompt with a score spread; returns the pairs and their counts.

    Rows are grouped by prompt, chosen then rejected in sample order; exactly one row per paired prompt has
    ``best_worst`` true. ``pair_yield`` is the share of prompts that give at least one pair; ``num_pairs_uncapped``
    counts the pairs before ``max_pairs_per_prompt`` (None: no cap) kept the widest gaps of each prompt.
    """
    if max_pairs_per_prompt is not None and max_pairs_per_prompt < 1:
        raise ValueError(f"max_pairs_per_prompt must be at least 1 (or None: no cap), got {max_pairs_per_prompt}")
    rows = []
    dropped = {"single_sample": 0, "no_spread": 0}
    paired_prompts = uncapped = 0
    ordered = scores.sort_values(["prompt_id", "sample_index"], kind="stable").reset_index(drop=True)
    for prompt_id, group in ordered.groupby("prompt_id", sort=True):
        if len(group) < 2:
            dropped["single_sample"] += 1
            continue
        # idxmax/idxmin return the first occurrence: ties go to the lowest sample index.
        best, worst = group["score"].idxmax(), group["score"].idxmin()
        if float(group.loc[best, "score"] - group.loc[worst, "score"]) <= min_score_gap:
            dropped["no_spread"] += 1
            continue
        paired_prompts += 1
        candidates = [(best, worst)] if pairing == "best_worst" else [
            (i, j) for i in group.index for j in group.index
            if group.loc[i, "score"] - group.loc[j, "score"] > min_score_gap
        ]
        uncapped += len(candidates)
        if max_pairs_per_prompt is not None and len(candidates) > max_pairs_per_prompt:
            gap = {(i, j): group.loc[i, "score"] - group.loc[j, "score"] for i, j in candidates}
            kept = set(sorted(candidates, key=lambda ij: (-gap[ij], *ij))[:max_pairs_per_prompt])
            candidates = [pair for pair in candidates if pair in kept]  # still in sample order
        for i, j in candidates:
            chosen, rejected = group.loc[i], group.loc[j]
            rows.append({
                "prompt_id": prompt_id, "question": chosen["question"], "prompt": chosen["prompt"],
                "answer": chosen["answer"], "chosen": chosen["response"], "rejected": rejected["response"],
                "chosen_score": float(chosen["score"]), "rejected_score": float(rejected["score"]),
                "score_gap": float(chosen["score"] - rejected["score"]),
                "chosen_sample_id": chosen["sample_id"], "rejected_sample_id": rejected["sample_id"],
                "best_worst": (i, j) == (best, worst),
            })
    num_prompts = int(scores["prompt_id"].nunique())
    stats = {
        "num_prompts": num_prompts,
        "num_pairs": len(rows),
        "num_pairs_uncapped": uncapped,
        "dropped_single_sample": dropped["single_sample"],
        "dropped_no_spread": dropped["no_spread"],
        "pair_yield": paired_prompts / num_prompts if num_prompts else 0.0,
        "pairs_per_prompt": len(rows) / paired_prompts if paired_prompts else 0.0,
    }
    pairs = pd.DataFrame(rows, columns=PAIR_COLUMNS)
    return pairs.astype({"best_worst": bool}), stats


def split_pairs(pairs: pd.DataFrame, eval_fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic (train, held-out) split by prompt; every stage that trains on pairs uses this one.

    All pairs of a prompt land on the same side (its responses never leak from training into the held-out
    pairs). At least one prompt lands on each side when there are two or more.
    """
    ids = sorted(pairs["prompt_id"].unique())
    random.Random(seed).shuffle(ids)
    num_eval = min(max(1, round(len(ids) * eval_fraction)), len(ids) - 1) if len(ids) > 1 else 0
    held_out = set(ids[:num_eval])
    mask = pairs["prompt_id"].isin(held_out)
    return pairs[~mask].reset_index(drop=True), pairs[mask].reset_index(drop=True)
