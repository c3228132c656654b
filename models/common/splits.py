"""Deterministic splits by prompt, shared by every stage that holds out data (no prompt on both sides)."""

from __future__ import annotations

import pandas as pd
import torch


def split_by_prompt(samples: pd.DataFrame, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample rows for training and for evaluation, split by prompt (no prompt on both sides)."""
    prompts = sorted(samples["prompt_id"].unique())
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    num_eval = max(1, round(eval_fraction * len(prompts))) if len(prompts) > 1 else 0
    eval_prompts = {prompts[i] for i in order[:num_eval]}
    is_eval = torch.tensor(samples["prompt_id"].isin(eval_prompts).to_numpy())
    rows = torch.arange(len(samples))
    return rows[~is_eval], rows[is_eval]
