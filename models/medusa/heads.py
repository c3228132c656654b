"""Medusa decoding heads over a frozen causal LM, their loss, and their drafts for tree decoding.

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(§2.1.1 heads, §2.2.1 Medusa-1 training), as summarised in docs/medusa.md#medusa-heads.

Head k (k = 1..K) reads the final hidden state h_t of the backbone and predicts token t + k + 1 (the
backbone's own LM head predicts t + 1):

    p_k(· | h_t) = softmax( W_k · ResBlock_k(h_t) ),   ResBlock(x) = x + SiLU(A x + b)

A and b start at zero, so every head starts as the backbone's next-token head; W_k is the backbone's
LM head itself (shared, frozen: the default, and what a tied-embedding model such as SmolLM2 has) or,
with ``untie``, a trainable copy per head. Every head owns distinct modules (the reference code's
``[ResBlock()] * n`` shares one).

Medusa-1 loss (backbone frozen): Σ_k λ_k · CE(p_k(· | h_t), y_{t+k+1}) with λ_k = decay^(k−1) (0.8 in
the paper). The targets come from self-distillation: the policy's own responses, where y is either the
sampled token or the backbone's greedy choice at that position (the token greedy verification checks).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from models.common.files import atomic_path
from models.engine.speculative import Tree, TreeDrafter

IGNORE_INDEX = -100


class ResBlock(nn.Module):
    """x + SiLU(A x + b), zero-initialised so that the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


@dataclass(frozen=True)
class MedusaHeadsConfig:
    """Shape of a set of heads (saved next to their weights)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4  # K: head k predicts token t + k + 1
    num_layers: int = 1  # residual blocks per head
    untie: bool = False  # each head gets its own trainable vocabulary projection (a copy of the LM head)


class MedusaHeads(nn.Module):
    """K independent heads. ``forward(hidden (..., H), lm_head)`` → logits (..., K, V); index k−1 is head k.

    Only the heads' own parameters live here (saved and trained); the backbone's LM head is passed in
    when the projections are shared, so it is never copied into the heads' checkpoint.
    """

    def __init__(self, config: MedusaHeadsConfig, lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads))
        self.projections = None
        if config.untie:
            if lm_head is None:
                raise ValueError("untied heads start from the backbone's LM head: pass lm_head")
            self.projections = nn.ModuleList(copy.deepcopy(lm_head).requires_grad_(True)
                                             for _ in range(config.num_heads))

    def states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each head's residual output: (..., H) → (..., K, H)."""
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, only: int | None = None) -> torch.Tensor:
        """Logits (..., K, V) of every head, or (..., V) of head index ``only`` (0-based) alone."""
        if only is not None:
            projection = lm_head if self.projections is None else self.projections[only]
            return projection(self.blocks[only](hidden))  # (..., V)
        states = self.states(hidden)  # (..., K, H)
        if self.projections is None:
            return lm_head(states)  # (..., K, V): one matmul for all heads
        return torch.stack([proj(states[..., k, :]) for k, proj in enumerate(self.projections)], dim=-2)

    def with_fresh_head(self, k: int, lm_head: nn.Module) -> MedusaHeads:
        """A copy whose head index ``k`` starts over: zero residual blocks (= the backbone's next-token head)."""
        fresh = copy.deepcopy(self)
        weight = lm_head.weight
        fresh.blocks[k] = nn.Sequential(*(ResBlock(self.config.hidden_size) for _ in range(self.config.num_layers))
                                        ).to(device=weight.device, dtype=weight.dtype)
        if fresh.projections is not None:
            fresh.projections[k] = copy.deepcopy(lm_head).requires_grad_(True)
        return fresh

    def save(self, folder: Path) -> None:
        """``heads.safetensors`` + ``heads.json``, written atomically."""
        with atomic_path(Path(folder)) as tmp:
            tmp.mkdir(parents=True)
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                      tmp / "heads.safetensors")
            (tmp / "heads.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path, lm_head: nn.Module) -> MedusaHeads:
        """The heads saved in ``folder``, on ``lm_head``'s device and in its dtype (the policy's): they read the
        backbone's hidden states, which live there."""
        folder = Path(folder)
        if not (folder / "heads.json").is_file():
            raise FileNotFoundError(f"no Medusa heads in {folder} (heads.json missing): run the train_medusa stage")
        config = MedusaHeadsConfig(**json.loads((folder / "heads.json").read_text()))
        weight = lm_head.weight
        heads = cls(config, lm_head if config.untie else None).to(device=weight.device, dtype=weight.dtype)
        heads.load_state_dict(load_file(folder / "heads.safetensors", device=str(weight.device)))
        return heads


def heads_for(model, num_heads: int, num_layers: int = 1, untie: bool = False) -> MedusaHeads:
    """Fresh heads shaped for a Hugging Face causal LM, on its device and dtype."""
    lm_head = model.get_output_embeddings()
    config = MedusaHeadsConfig(hidden_size=model.config.hidden_size, vocab_size=lm_head.out_features,
                               num_heads=num_heads, num_layers=num_layers, untie=untie)
    return MedusaHeads(config, lm_head).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, decay: float = 0.8
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k decay^(k−1) · CE_k. ``head_logits`` (N, K, V), ``targets`` (N, K) with IGNORE_INDEX where
    position t + k + 1 does not exist. Returns (weighted total, per-head mean CE (K,))."""
    n, k, v = head_logits.shape
    ce = F.cross_entropy(head_logits.reshape(n * k, v).float(), targets.reshape(n * k),
                         ignore_index=IGNORE_INDEX, reduction="none").view(n, k)  # (N, K)
    valid = (targets != IGNORE_INDEX).float()
    per_head = (ce * valid).sum(dim=0) / valid.sum(dim=0).clamp(min=1)  # (K,)
    weights = decay ** torch.arange(k, device=per_head.device, dtype=per_head.dtype)
    return (weights * per_head).sum(), per_head.detach()


class MedusaDrafter(TreeDrafter):
    """Medusa's drafter for the speculative loop (:class:`models.engine.speculative.TreeDrafter`): ``tree``
    filled from the heads' logits for the K positions after the root, read from the last accepted token's
    hidden state. The heads' copy lives on the model's device.

    ``dtype``: the precision the drafts are computed in (a copy of the heads and of the LM head). Under
    greedy verification drafts only decide what gets *checked*, never what is output, so a cheaper
    precision costs nothing in output and, on a CPU with bf16 units, saves most of the drafter's time
    (it reads the whole vocabulary projection once per step).
    """

    def __init__(self, model, heads: MedusaHeads, tree: Tree, dtype: torch.dtype | None = None):
        lm_head = model.get_output_embeddings()
        dtype = dtype or lm_head.weight.dtype
        self.lm_head = copy.deepcopy(lm_head).to(dtype) if dtype != lm_head.weight.dtype else lm_head
        self.heads = copy.deepcopy(heads).to(device=lm_head.weight.device, dtype=dtype).eval()
        self.dtype = dtype
        super().__init__(tree, self.logits)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """The heads' draft logits (K, V) from a final hidden state (H,)."""
        return self.heads(hidden.to(self.dtype), self.lm_head)
