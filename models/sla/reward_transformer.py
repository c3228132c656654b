"""Reward Transformer: a reward channel inside the policy that scores every prefix (SLA paper, §4.2–4.3;
docs/sla.md).

Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward".

The policy is any Hugging Face decoder LM that returns per-layer hidden states. Beside it runs a
narrow *reward channel* (hidden size 256 by default) with no attention of its own: at every layer it
reads the policy's hidden state and updates its own, position by position. One forward therefore
gives the next-token logits *and* a reward for every prefix, and with a KV cache the channel only
has to process the new tokens: it carries no cache.

Which variant of eq. 14. The paper writes a post-norm FFN over the concatenation,
``h_r^{j+1} = Norm(h_r^j + FFN([h_p^j ; h_r^j]))``; the authors' released code is pre-norm with a
single projection, which is what we implement (docs/sla.md):

    h_r^0     = SiLU(W_0 · RMSNorm(h_p^0))                         h_p^0 = token embeddings   [d → r]
    h_r^{j+1} = h_r^j + SiLU(W_{j+1} · RMSNorm([h_p^j ; h_r^j]))   for each decoder layer j   [(d+r) → r]
    R'        = w · [h_p^final ; h_r^L]                            final-normed policy state   [(d+r) → 1]

Pre-norm residual updates keep the channel's scale stable over 30+ layers without a norm on the
residual stream, and the reference checkpoints were trained this way, so numbers stay comparable.
``h_p^j`` is the *input* of decoder layer j exactly as the policy computes it in training (the
reference inference engine read states after in-place fused norms, scoring different states than it
trained on; here training and decoding share one code path).

Adapter baselines (§5.3): :class:`FinalStateAdapter`, an MLP on the final hidden state only
(1 layer = a linear probe, 4 layers = a deep MLP), with the same interface.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.engine.kv_cache import cache_kwargs, returned_cache

WEIGHTS = "reward_head.safetensors"
CONFIG = "reward_head.json"


@dataclass
class RewardOutput:
    """Policy logits and per-prefix rewards of one forward."""

    logits: torch.Tensor | None  # (B, T', V): next-token logits at the last T' positions (all T by default)
    rewards: torch.Tensor  # (B, T): R'(x_{≤t}), the predicted final reward of each prefix
    cache: object | None = None  # the policy's KV cache (the reward channel needs none)


@dataclass
class RewardHeadConfig:
    """Architecture of a token-level reward head."""

    kind: str = "channel"
    """``channel`` (the Reward Transformer) or ``adapter`` (MLP on the final hidden state)."""
    hidden_size: int = 256
    """Width of the reward channel / of the adapter's hidden layers."""
    adapter_layers: int = 1
    """Layers of the adapter MLP (1 = linear probe); unused by the channel."""


class RewardChannel(nn.Module):
    """The reward channel of eq. 14 (reference-code variant): reads all policy layers, keeps its own state."""

    def __init__(self, policy_hidden: int, num_layers: int, hidden_size: int = 256, eps: float = 1e-6):
        super().__init__()
        self.input_norm = nn.RMSNorm(policy_hidden, eps=eps)
        self.input_proj = nn.Linear(policy_hidden, hidden_size)
        # one pre-norm projection per decoder layer: distinct modules, not [m] * n
        self.layer_norms = nn.ModuleList(nn.RMSNorm(policy_hidden + hidden_size, eps=eps) for _ in range(num_layers))
        self.layer_projs = nn.ModuleList(nn.Linear(policy_hidden + hidden_size, hidden_size) for _ in range(num_layers))
        self.head = nn.Linear(policy_hidden + hidden_size, 1, bias=False)

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``hidden_states``: HF's tuple of L+1 tensors (B, T, d): layer inputs h_p^0..h_p^{L-1}, then the
        final-normed state. Returns rewards (B, T)."""
        *layer_inputs, final = hidden_states
        h_r = F.silu(self.input_proj(_normed(self.input_norm, layer_inputs[0])))  # (B, T, r)
        for h_p, norm, proj in zip(layer_inputs, self.layer_norms, self.layer_projs, strict=True):
            h_r = h_r + F.silu(proj(_normed(norm, torch.cat([h_p, h_r], dim=-1))))
        return self.head(torch.cat([final, h_r], dim=-1)).squeeze(-1)  # (B, T)


def _normed(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` computed in the norm weight's dtype. Training runs the head's float32 master weights under bf16
    autocast (models/common/training.py), and CPU autocast has no float32 rule for ``rms_norm`` (it has for the
    matmuls): the bf16 policy states would meet float32 weights, which ``torch.rms_norm`` handles only unfused,
    warning "Mismatch dtype between input and weight". Upcast, the norm runs fused in float32 as autocast runs a
    float32 op; the projection after it casts back to bf16. At inference weights and states share the policy's dtype:
    nothing changes."""
    return norm(x.to(norm.weight.dtype))


class FinalStateAdapter(nn.Module):
    """Adapter baseline: an MLP on the final hidden state alone (1 layer = linear probe)."""

    def __init__(self, policy_hidden: int, num_layers: int = 1, hidden_size: int = 256):
        super().__init__()
        layers: list[nn.Module] = []
        width = policy_hidden
        for _ in range(num_layers - 1):
            layers += [nn.Linear(width, hidden_size), nn.SiLU()]
            width = hidden_size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.mlp(hidden_states[-1]).squeeze(-1)  # (B, T)


def build_reward_head(cfg: RewardHeadConfig, policy_config) -> nn.Module:
    """The head described by ``cfg`` for a policy with this Hugging Face config."""
    if cfg.kind == "channel":
        return RewardChannel(policy_config.hidden_size, policy_config.num_hidden_layers, cfg.hidden_size,
                             eps=getattr(policy_config, "rms_norm_eps", 1e-6))
    if cfg.kind == "adapter":
        return FinalStateAdapter(policy_config.hidden_size, cfg.adapter_layers, cfg.hidden_size)
    raise ValueError(f"unknown reward head kind {cfg.kind!r} (channel or adapter)")


class RewardTransformer(nn.Module):
    """A causal LM plus a token-level reward head, by composition (no fork of the modeling code).

    The policy is frozen by default: its forward then runs without autograd and only the head trains.
    """

    def __init__(self, policy: nn.Module, head_config: RewardHeadConfig | None = None, freeze_policy: bool = True,
                 head: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.head_config = head_config or RewardHeadConfig()
        # ``head``: an already built head (e.g. trained jointly with others); else one from ``head_config``
        self.head = head if head is not None else build_reward_head(self.head_config, policy.config)
        self.head.to(device=policy.device, dtype=next(policy.parameters()).dtype)
        self.freeze_policy = freeze_policy
        if freeze_policy:
            policy.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                cache=None, position_ids: torch.Tensor | None = None,
                use_cache: bool = False, logits_to_keep: int = 0,
                hidden_states: tuple[torch.Tensor, ...] | None = None) -> RewardOutput:
        """Logits and rewards for the given tokens; with a KV ``cache`` only the new tokens are
        processed and scored (the channel is position-wise, so their rewards equal a full forward's).
        ``hidden_states``: the frozen policy's own (HF's L + 1 tensors) of the tokens, computed before: only the
        head runs, and no logits come back (training on cached states runs through here, so that under DDP the
        prepared wrapper's forward still runs).

        ``logits_to_keep``: logits of the last that many positions only (0 = all, Hugging Face's convention).
        Rewards need the hidden states alone, and the (B, T, V) logits of a 128k vocabulary are the largest
        tensor of the forward (8 × 512 × 128k in bf16 = 1 GB per training batch at 8B): training, scoring
        and SLA ask for 1. Rewards come out in the head's compute dtype (the policy's, also under training's
        autocast over float32 master weights); callers cast them to float32 before reducing them.
        """
        if hidden_states is not None:
            return RewardOutput(logits=None, rewards=self.head(hidden_states))
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_policy):
            out = self.policy(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(self.policy, cache),
                              position_ids=position_ids, use_cache=use_cache, output_hidden_states=True,
                              logits_to_keep=logits_to_keep)
        rewards = self.head(out.hidden_states)
        return RewardOutput(logits=out.logits, rewards=rewards, cache=returned_cache(out))

    def save_head(self, folder: Path) -> None:
        """Write only the head (the policy is saved elsewhere): safetensors + its config."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, str(folder / WEIGHTS))
        (folder / CONFIG).write_text(json.dumps(asdict(self.head_config), indent=2))

    @classmethod
    def from_head(cls, policy: nn.Module, folder: Path) -> RewardTransformer:
        """Attach a head saved by :meth:`save_head` to ``policy``."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / WEIGHTS).is_file():
            raise FileNotFoundError(f"no reward head in {folder}: run the reward training stage first")
        model = cls(policy, RewardHeadConfig(**json.loads((folder / CONFIG).read_text())))
        model.head.load_state_dict(load_file(str(folder / WEIGHTS), device=str(policy.device)))
        return model


def mean_response_reward(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(1/T) Σ_t R'(τ_t) over the response tokens of each sequence (eq. 17's sequence score). (B,)"""
    mask = response_mask.to(rewards.dtype)
    return (rewards * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def bradley_terry_loss(chosen_rewards: torch.Tensor, chosen_mask: torch.Tensor,
                       rejected_rewards: torch.Tensor, rejected_mask: torch.Tensor) -> torch.Tensor:
    """Eq. 17: −log σ(mean token reward of the chosen response − that of the rejected one), batch mean."""
    margin = mean_response_reward(chosen_rewards, chosen_mask) - mean_response_reward(rejected_rewards, rejected_mask)
    return -F.logsigmoid(margin).mean()
