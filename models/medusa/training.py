"""Self-distilled data and Medusa-1 training of the heads on a frozen backbone (Medusa §2.2.1, §2.3.2;
docs/medusa.md).

The data are the policy's own responses: by default its greedy responses to the training prompts
(:func:`greedy_responses`), which is the text the heads will draft for when verification is greedy;
or the generate stage's samples. One frozen forward over them (:func:`self_distill`) gives everything
the head stages need, so the backbone runs once:

* for Medusa-1 — the final hidden state h_t of every response position and, per head k, the target
  token t + k + 1: the sampled token, or the backbone's greedy choice at that position given the
  sampled prefix (``targets: greedy``: exactly what greedy verification will check);
* for RLMedusa (its paper's "Training methodology and data collection") — along each response's first
  ``trajectory_tokens`` tokens, 9 candidate tokens per step (top-1, 3 of the top-50, 5 random;
  :func:`sample_candidates`) and the base model's probability of each as the token two steps ahead, p₁(x_{t+2} | x_{≤t+1}).

Training (:func:`train_medusa_heads`) then touches only the heads: batches of positions, the loss of
:func:`models.medusa.heads.medusa_loss`, AdamW with a cosine schedule, in the shared loop of
:mod:`models.common.training`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import pandas as pd
import torch
from torch.utils.data import TensorDataset
from tqdm.auto import tqdm

from models.common.sequences import padding_id, right_pad, tokenize_sequence
from models.common.training import train
from models.engine.policy import Policy
from models.medusa.config import MedusaTraining, RLMedusaCandidates
from models.medusa.heads import IGNORE_INDEX, MedusaHeads, heads_for, medusa_loss

if TYPE_CHECKING:
    from accelerate import Accelerator



@dataclass
class DistilledStates:
    """What one frozen pass over the responses yields (all on CPU)."""

    hidden: torch.Tensor  # (M, H) final hidden state at each response position t (predicting t + 1)
    targets: torch.Tensor  # (M, K) head k's target token t + k + 1, IGNORE_INDEX past the response
    sample: torch.Tensor  # (M,) row of the samples table each position comes from
    rl_rows: torch.Tensor  # (R,) rows of ``hidden`` that are RLMedusa trajectory states
    rl_candidates: torch.Tensor  # (R, C) candidate tokens for position t + 2
    rl_probs: torch.Tensor  # (R, C) p₁(candidate = x_{t+2} | x_{≤t+1})

    def subset(self, samples: torch.Tensor) -> DistilledStates:
        """The positions (and trajectory states) of the given sample rows."""
        keep = torch.isin(self.sample, samples)
        new_index = torch.cumsum(keep.long(), 0) - 1
        rl_keep = keep[self.rl_rows]
        return DistilledStates(self.hidden[keep], self.targets[keep], self.sample[keep],
                               new_index[self.rl_rows[rl_keep]], self.rl_candidates[rl_keep], self.rl_probs[rl_keep])


def greedy_responses(policy: Policy, prompts: pd.DataFrame, max_new_tokens: int, batch_size: int,
                     system_prompt: str | None = None) -> pd.DataFrame:
    """The policy's greedy response to each prompt (``prompt_id``, ``question``), batched, in the shape of the
    samples table that :func:`self_distill` reads (one sample per prompt)."""
    from models.engine.decoding import GREEDY, hf_decode
    from models.engine.generation import chat_prompts, end_token_ids

    tok, eos = policy.tokenizer, end_token_ids(policy)
    texts = chat_prompts(tok, prompts["question"].tolist(), system_prompt)
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    outputs = []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc="greedy responses", unit="batch"):
        outputs += hf_decode(policy, prompt_ids[start : start + batch_size], GREEDY, max_new_tokens,
                             eos, batch_size=batch_size)
    return pd.DataFrame({
        "prompt_id": prompts["prompt_id"].tolist(), "sample_index": 0, "prompt": texts,
        "response": [tok.decode(o, skip_special_tokens=True) for o in outputs],
        "finish_reason": ["eos" if o and o[-1] in eos else "length" for o in outputs],
    })


def sample_candidates(probs: torch.Tensor, generator: torch.Generator, num_top: int = 3, top_pool: int = 50,
                      num_random: int = 5) -> torch.Tensor:
    """RLMedusa's candidate mix per row of ``probs`` (R, V): the top-1 token, ``num_top`` distinct tokens
    drawn from ranks 2..``top_pool``, and ``num_random`` distinct tokens drawn uniformly from the rest of
    the vocabulary. Returns (R, 1 + num_top + num_random) token ids, all distinct within a row."""
    rows, vocab = probs.shape
    ranked = probs.topk(top_pool, dim=-1).indices  # (R, top_pool)
    pick = torch.rand(rows, top_pool - 1, generator=generator).argsort(dim=-1)[:, :num_top] + 1  # (R, num_top)
    chosen = torch.cat([ranked[:, :1], ranked.gather(1, pick)], dim=1)  # (R, 1 + num_top)
    scores = torch.rand(rows, vocab, generator=generator)
    scores.scatter_(1, chosen, -1.0)  # never re-draw a chosen token
    return torch.cat([chosen, scores.topk(num_random, dim=-1).indices], dim=1)


def _head_targets(next_tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(n,) tokens y_{t+1} at response positions t → (n, K) with y_{t+k+1} for head k, IGNORE_INDEX past the end."""
    n = len(next_tokens)
    targets = torch.full((n, num_heads), IGNORE_INDEX, dtype=torch.long)
    for k in range(1, num_heads + 1):
        if n > k:
            targets[: n - k, k - 1] = next_tokens[k:]
    return targets


@torch.no_grad()
def self_distill(policy: Policy, samples: pd.DataFrame, cfg: MedusaTraining, rl_cfg: RLMedusaCandidates
                 ) -> DistilledStates:
    """One frozen forward per batch of (prompt + response) sequences; see the module docstring.

    Under ``mixed_precision: bf16`` the pass runs in bfloat16 autocast (~2.5× faster on a CPU with bf16
    units); the heads then learn from states a rounding away from those they see when decoding.
    """
    tok, model = policy.tokenizer, policy.model
    generator = torch.Generator().manual_seed(cfg.seed)
    sequences = [tokenize_sequence(tok, p, r, cfg.max_length, add_end=finish == "eos")
                 for p, r, finish in zip(samples["prompt"], samples["response"], samples["finish_reason"], strict=True)]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden", "targets", "sample", "rl_rows", "rl_cand", "rl_probs")}
    rows_so_far = 0
    for start in tqdm(range(0, len(sequences), cfg.distill_batch_size), desc="self-distillation pass", unit="batch"):
        chunk = sequences[start : start + cfg.distill_batch_size]
        batch = right_pad(chunk, padding_id(tok))  # (B, T) each
        with torch.autocast(policy.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"):
            out = model(input_ids=batch["input_ids"].to(policy.device),
                        attention_mask=batch["attention_mask"].to(policy.device), output_hidden_states=True)
        hidden, logits = out.hidden_states[-1].float().cpu(), out.logits.float().cpu()  # (B, T, H), (B, T, V)
        for row, (ids, mask) in enumerate(chunk):
            first = mask.index(1) if 1 in mask else len(ids)
            # positions t = first−1 .. len−2 predict the response tokens t + 1 = first .. len−1
            positions = torch.arange(first - 1, len(ids) - 1)
            if len(positions) == 0:
                continue
            sampled = torch.tensor(ids)[positions + 1]
            next_tokens = logits[row, positions].argmax(-1) if cfg.targets == "greedy" else sampled
            parts["hidden"].append(hidden[row, positions])
            parts["targets"].append(_head_targets(next_tokens, cfg.num_heads))
            parts["sample"].append(torch.full((len(positions),), start + row))
            # trajectory states: t + 2 must still be a response token, so p(x_{t+2} | x_{≤t+1}) is logits[t + 1]
            steps = min(rl_cfg.trajectory_tokens, len(positions) - 1)
            if steps > 0:
                probs = torch.softmax(logits[row, positions[1 : steps + 1]], dim=-1)  # (steps, V)
                candidates = sample_candidates(probs, generator, rl_cfg.top_candidates, rl_cfg.top_pool,
                                               rl_cfg.random_candidates)
                parts["rl_rows"].append(rows_so_far + torch.arange(steps))
                parts["rl_cand"].append(candidates)
                parts["rl_probs"].append(probs.gather(1, candidates))
            rows_so_far += len(positions)
    if not parts["hidden"]:
        raise ValueError("no response tokens to learn from: every sample's response is empty")
    return DistilledStates(torch.cat(parts["hidden"]), torch.cat(parts["targets"]), torch.cat(parts["sample"]),
                           torch.cat(parts["rl_rows"]), torch.cat(parts["rl_cand"]), torch.cat(parts["rl_probs"]))


def train_medusa_heads(policy: Policy, data: DistilledStates, cfg: MedusaTraining,
                       accelerator: Accelerator | None = None,
                       on_step: Callable[[int, int, dict[str, float]], None] | None = None,
                       ) -> tuple[MedusaHeads, dict[str, list]]:
    """Medusa-1: fit fresh heads to ``data`` with the backbone frozen. Returns the heads and a history
    (``loss`` and per-head ``ce_head{k}`` per step, ``learning_rate``)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)
    policy.model.requires_grad_(False)  # Medusa-1: the backbone (and its shared LM head) never gets a gradient
    lm_head = policy.model.get_output_embeddings()
    heads = heads_for(policy.model, cfg.num_heads, cfg.num_layers, cfg.untie)

    def step(heads: MedusaHeads, batch: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden, targets = batch
        logits = heads(hidden.to(lm_head.weight.dtype), lm_head)  # (N, K, V)
        loss, per_head = medusa_loss(logits, targets, cfg.loss_decay)
        return loss, {"loss": loss.detach(), **{f"ce_head{k + 1}": ce for k, ce in enumerate(per_head)}}

    return train(heads, TensorDataset(data.hidden, data.targets), step, heads.parameters(),
                 partial(torch.optim.AdamW, lr=cfg.learning_rate, weight_decay=0.0), accelerator=accelerator,
                 epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed, warmup_ratio=cfg.warmup_ratio,
                 desc="Medusa heads", on_step=on_step)


@torch.no_grad()
def evaluate_heads(heads: MedusaHeads, lm_head, data: DistilledStates, top_k: int = 5, ranks: int = 10,
                   batch_size: int = 256) -> dict[str, list]:
    """Held-out accuracy per head: ``top1``, ``top{top_k}`` (K,), and ``rank_accuracy`` (K, ranks): how often
    the head's rank-r token is the target (what :func:`models.engine.speculative.sparse_tree` builds a tree from)."""
    ranks = max(ranks, top_k)
    hits, counts = [], []
    for start in range(0, len(data.hidden), batch_size):
        hidden = data.hidden[start : start + batch_size].to(lm_head.weight.device, lm_head.weight.dtype)
        targets = data.targets[start : start + batch_size].to(lm_head.weight.device)
        top = heads(hidden, lm_head).topk(ranks, dim=-1).indices  # (N, K, ranks)
        valid = targets != IGNORE_INDEX  # (N, K)
        hits.append(((top == targets[..., None]) & valid[..., None]).float().sum(dim=0))  # (K, ranks)
        counts.append(valid.float().sum(dim=0))  # (K,)
    rank_accuracy = torch.stack(hits).sum(0) / torch.stack(counts).sum(0).clamp(min=1)[:, None]  # (K, ranks)
    return {"top1": rank_accuracy[:, 0].tolist(), f"top{top_k}": rank_accuracy[:, :top_k].sum(1).tolist(),
            "rank_accuracy": rank_accuracy.tolist()}
