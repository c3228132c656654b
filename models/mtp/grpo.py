"""GRPO's pieces as small pure functions: group advantages, the clipped ratio loss, the k3 KL, token log-probs.

Shao et al. 2024 (DeepSeekMath, §4.1 GRPO) as TRL's ``GRPOTrainer`` and verl implement it, with DAPO's
asymmetric clip (Yu et al. 2025, ε_low 0.2 / ε_high 0.28) and token-mean aggregation — the RL algorithm of
MTP-RL's experiments (§4; docs/mtp.md). The training step that combines them with the MTP
loss lives in :mod:`models.mtp.rl`; why a compact trainer instead of TRL's is said there.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """A = (r − mean of its group) / (std of its group + ε) for rewards (N·G,) laid out group by group.

    The std is the unbiased one (as ``torch.std`` and TRL compute it); a group whose rewards are all equal
    gets advantage 0 everywhere — it carries no signal.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # (N, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    return ((grouped - mean) / (std + eps)).view(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool: the groups whose rewards are all equal (TRL's ``is_std_zero``), rewards (N·G,) laid out group by
    group. Their advantages are all 0: they give GRPO no gradient."""
    grouped = rewards.view(-1, group_size)  # (N, G)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def clipped_policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                        completion_mask: torch.Tensor, epsilon_low: float = 0.2, epsilon_high: float = 0.28
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A), ρ = exp(logp − logp_old).

    ``logps``/``old_logps``/``completion_mask`` (B, T), ``advantages`` (B,). Returns the per-token loss (B, T)
    (zero outside the completion) and where the clip was active (B, T) bool.
    """
    ratio = torch.exp(logps - old_logps)
    a = advantages[:, None]
    unclipped, clipped = ratio * a, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * a
    per_token = -torch.minimum(unclipped, clipped)
    mask = completion_mask.bool()
    return per_token * mask, (clipped < unclipped) & mask


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref) per token: exp(r) − r − 1 with r = logp_ref − logp (≥ 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float | None = None
               ) -> torch.Tensor:
    """Σ values over the masked tokens of the whole batch / their count (DAPO's token-level aggregation:
    long completions weigh by their length, unlike a mean of per-sequence means).

    ``num_tokens``: the count to divide by when the batch is one process's share of a global batch (the global
    count, so the shares of all processes sum to the global token mean); default: this batch's own count.
    """
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return (values * mask).sum() / count


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, completion_mask: torch.Tensor,
              epsilon_low: float = 0.2, epsilon_high: float = 0.28, ref_logps: torch.Tensor | None = None,
              kl_beta: float = 0.0, num_tokens: torch.Tensor | float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean clipped loss, plus β·k3 KL to a reference when ``kl_beta`` > 0. Returns it and its parts.
    ``num_tokens``: as :func:`token_mean` (the global completion-token count when the batch is split)."""
    per_token, clipped = clipped_policy_loss(logps, old_logps, advantages, completion_mask, epsilon_low, epsilon_high)
    loss = token_mean(per_token, completion_mask, num_tokens)
    stats = {"policy_loss": loss.item(),
             "clip_fraction": token_mean(clipped.float(), completion_mask, num_tokens).item()}
    if kl_beta > 0:
        if ref_logps is None:
            raise ValueError("kl_beta > 0 needs the reference model's log-probs")
        kl = token_mean(k3_kl(logps, ref_logps), completion_mask, num_tokens)
        loss = loss + kl_beta * kl
        stats["kl"] = kl.item()
    return loss, stats


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, first: int = 0
                ) -> torch.Tensor:
    """log π(t_{i+1} | t_{≤i}) at every position: ids (B, T) → (B, T), 0 before ``first`` and at the last position.

    ``logits`` (B, T − first, V): those of positions ``first`` … T − 1 only (a forward with ``logits_to_keep =
    T − first`` skips the prompt's). Divided by the sampling temperature first, as TRL does: the ratio compares
    the distributions the completions were actually drawn from. One sequence at a time, as logsumexp − the
    picked logit: a float32 log-softmax of the whole batch would be a second (B, T, V) tensor (~16 GB for 32
    sequences of 1,000 tokens over Llama-3's 128k vocabulary).
    """
    targets = input_ids[:, first + 1 :]  # (B, T − first − 1): the token each kept position predicts
    picked = torch.stack([_picked_logps(row[:-1], row_targets, temperature)
                          for row, row_targets in zip(logits, targets, strict=True)])  # (B, T − first − 1)
    return torch.nn.functional.pad(picked, (first, 1))


def _picked_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at ``targets``: logits (N, V), targets (N,) → (N,), in float32."""
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
