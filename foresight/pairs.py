"""Preference pairs from scored samples (the input of reward-channel training and DPO).

Per prompt: chosen = the highest-scoring sample, rejected = the lowest. A prompt whose best and worst
scores differ by no more than ``min_score_gap`` (all equal, a single sample, all right or all wrong
under the verifiable labeler) carries no preference and is dropped and counted. Ties for best or
worst are broken by sample index, so the result is deterministic.
"""

from __future__ import annotations

import random

import pandas as pd

SAMPLE_COLUMNS = [
    "sample_id", "prompt_id", "sample_index", "question", "prompt", "response", "answer",
    "prompt_tokens", "response_tokens", "finish_reason",
    "temperature", "top_p", "top_k", "max_new_tokens", "seed", "model",
]
SCORE_COLUMNS = SAMPLE_COLUMNS + ["score", "correct", "extracted_answer", "labeler"]
PAIR_COLUMNS = [
    "prompt_id", "question", "prompt", "answer", "chosen", "rejected", "chosen_score", "rejected_score",
    "score_gap", "chosen_sample_id", "rejected_sample_id",
]


def make_pairs(scores: pd.DataFrame, min_score_gap: float = 0.0) -> tuple[pd.DataFrame, dict]:
    """One (chosen, rejected) pair per prompt with a score spread; returns the pairs and their counts."""
    rows = []
    dropped = {"single_sample": 0, "no_spread": 0}
    ordered = scores.sort_values(["prompt_id", "sample_index"], kind="stable")
    for prompt_id, group in ordered.groupby("prompt_id", sort=True):
        if len(group) < 2:
            dropped["single_sample"] += 1
            continue
        # idxmax/idxmin return the first occurrence: ties go to the lowest sample index.
        best, worst = group.loc[group["score"].idxmax()], group.loc[group["score"].idxmin()]
        gap = float(best["score"] - worst["score"])
        if gap <= min_score_gap:
            dropped["no_spread"] += 1
            continue
        rows.append({
            "prompt_id": prompt_id, "question": best["question"], "prompt": best["prompt"], "answer": best["answer"],
            "chosen": best["response"], "rejected": worst["response"],
            "chosen_score": float(best["score"]), "rejected_score": float(worst["score"]), "score_gap": gap,
            "chosen_sample_id": best["sample_id"], "rejected_sample_id": worst["sample_id"],
        })
    num_prompts = int(scores["prompt_id"].nunique())
    stats = {
        "num_prompts": num_prompts,
        "num_pairs": len(rows),
        "dropped_single_sample": dropped["single_sample"],
        "dropped_no_spread": dropped["no_spread"],
        "pair_yield": len(rows) / num_prompts if num_prompts else 0.0,
    }
    return pd.DataFrame(rows, columns=PAIR_COLUMNS), stats


def split_pairs(pairs: pd.DataFrame, eval_fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic (train, held-out) split by prompt; every stage that trains on pairs uses this one.

    At least one pair lands on each side when there are two or more.
    """
    ids = sorted(pairs["prompt_id"].unique())
    random.Random(seed).shuffle(ids)
    num_eval = min(max(1, round(len(ids) * eval_fraction)), len(ids) - 1) if len(ids) > 1 else 0
    held_out = set(ids[:num_eval])
    mask = pairs["prompt_id"].isin(held_out)
    return pairs[~mask].reset_index(drop=True), pairs[mask].reset_index(drop=True)
