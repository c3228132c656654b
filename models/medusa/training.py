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

The hidden states are the bulk of it (8 KiB per position for an 8B model in bf16, millions of positions on
real data): the pass streams them to a file on disk in the policy's dtype, and training reads them back
through a memory map (:class:`HiddenStates`), a batch of rows at a time, so they never have to fit in RAM.

Training (:func:`train_medusa_heads`) then touches only the heads: batches of positions, the loss of
:func:`models.medusa.heads.medusa_loss`, AdamW with a cosine schedule, in the shared loop of
:mod:`models.common.training`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from models.common.sequences import fits, padding_id, right_pad, sft_sequences
from models.common.training import train
from models.engine.policy import Policy
from models.medusa.config import MedusaTraining, RLMedusaCandidates
from models.medusa.heads import IGNORE_INDEX, MedusaHeads, heads_for, medusa_loss

if TYPE_CHECKING:
    from accelerate import Accelerator

HIDDEN_FILE = "hidden.bin"  # the (M, H) hidden states, row-major raw bytes in the policy's dtype
INDEX_FILE = "states.safetensors"  # everything else the pass yields (small), and the hidden states' dtype and width
INDEX_FIELDS = ("targets", "sample", "rl_rows", "rl_candidates", "rl_probs")


class HiddenStates:
    """Rows of the frozen pass's final hidden states, (len, H), read on demand.

    ``table`` holds every position's state (M, H) — memory-mapped from :data:`HIDDEN_FILE` by :meth:`open`, so
    indexing reads just the rows asked for from disk — and ``rows`` says which of them are this set's (a
    subset is a new view: nothing is read). Indexing works as on a tensor: ``states[i]``, ``states[a:b]``,
    ``states[index_tensor]``; the result is a tensor in RAM in the cache's dtype.
    """

    def __init__(self, table: torch.Tensor, rows: torch.Tensor | None = None):
        self.table = table  # (M, H)
        self.rows = torch.arange(len(table)) if rows is None else rows  # (len,)

    @classmethod
    def open(cls, path: Path, dtype: torch.dtype, hidden_size: int) -> HiddenStates:
        """Memory-map a file of (M, hidden_size) ``dtype`` rows (read-only; pages load when a row is read)."""
        count = Path(path).stat().st_size // (hidden_size * dtype.itemsize)
        table = torch.from_file(str(path), shared=False, size=count * hidden_size, dtype=dtype)
        return cls(table.view(count, hidden_size))  # (M, H)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), self.table.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    def __getitem__(self, index) -> torch.Tensor:
        return self.table[self.rows[index]]

    def subset(self, index: torch.Tensor) -> HiddenStates:
        """The rows ``index`` (positions, or a boolean mask) of this set, as a view."""
        return HiddenStates(self.table, self.rows[index])


class StateDataset(Dataset):
    """Item i = (hidden state i, row i of each of ``columns``); the state is read from the cache per item.
    ``hidden``: :class:`HiddenStates` or a tensor (N, H)."""

    def __init__(self, hidden: HiddenStates | torch.Tensor, *columns: torch.Tensor):
        if any(len(column) != len(hidden) for column in columns):
            raise ValueError("every column needs one row per hidden state")
        self.hidden, self.columns = hidden, columns

    def __len__(self) -> int:
        return len(self.hidden)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return (self.hidden[i], *(column[i] for column in self.columns))


@dataclass
class DistilledStates:
    """What one frozen pass over the responses yields: the hidden states on disk (:class:`HiddenStates`), the
    rest in RAM on the CPU."""

    hidden: HiddenStates  # (M, H) final hidden state at each response position t (predicting t + 1)
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
        return DistilledStates(self.hidden.subset(keep), self.targets[keep], self.sample[keep],
                               new_index[self.rl_rows[rl_keep]], self.rl_candidates[rl_keep], self.rl_probs[rl_keep])

    def rl_states(self) -> HiddenStates:
        """The trajectory states (R, H), as a view."""
        return self.hidden.subset(self.rl_rows)


def load_distilled(folder: Path) -> DistilledStates:
    """The cache :func:`self_distill` wrote to ``folder``; the hidden states stay on disk (memory-mapped)."""
    folder = Path(folder)
    with safe_open(folder / INDEX_FILE, framework="pt") as index:
        meta = index.metadata()
        tensors = {name: index.get_tensor(name) for name in INDEX_FIELDS}
    hidden = HiddenStates.open(folder / HIDDEN_FILE, getattr(torch, meta["hidden_dtype"]), int(meta["hidden_size"]))
    if len(hidden) != len(tensors["targets"]):
        raise ValueError(f"{folder / HIDDEN_FILE} holds {len(hidden)} states for {len(tensors['targets'])} positions: "
                         "the cache is incomplete, run the train_medusa stage again")
    return DistilledStates(hidden, **tensors)


def too_long_responses(folder: Path) -> int:
    """How many responses :func:`self_distill` left out of the cache in ``folder`` as longer than ``max_length``."""
    with safe_open(Path(folder) / INDEX_FILE, framework="pt") as index:
        return int(index.metadata()["too_long"])


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
    the vocabulary. Returns (R, 1 + num_top + num_random) token ids on ``probs``' device, all distinct
    within a row. The random numbers come from ``generator`` on its own device (a CPU generator gives the
    same candidates whichever device ``probs`` lives on)."""
    rows, vocab = probs.shape
    draw = partial(torch.rand, generator=generator, device=generator.device)
    ranked = probs.topk(top_pool, dim=-1).indices  # (R, top_pool)
    pick = draw(rows, top_pool - 1).argsort(dim=-1)[:, :num_top].to(probs.device) + 1  # (R, num_top)
    chosen = torch.cat([ranked[:, :1], ranked.gather(1, pick)], dim=1)  # (R, 1 + num_top)
    scores = draw(rows, vocab).to(probs.device)  # (R, V)
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


def _response_positions(ids: list[int], mask: list[int]) -> torch.Tensor:
    """Positions t = first−1 .. len−2, which predict the response tokens t + 1 = first .. len−1."""
    first = mask.index(1) if 1 in mask else len(ids)
    return torch.arange(first - 1, len(ids) - 1)


def _autocast(policy: Policy, cfg: MedusaTraining) -> AbstractContextManager:
    """bfloat16 autocast on the policy's device under ``mixed_precision: bf16``, else nothing."""
    return torch.autocast(policy.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")


@torch.no_grad()
def self_distill(policy: Policy, samples: pd.DataFrame, cfg: MedusaTraining, rl_cfg: RLMedusaCandidates,
                 folder: Path) -> DistilledStates:
    """One frozen forward per batch of (prompt + response) sequences (see the module docstring); the cache
    goes to ``folder`` and comes back as :func:`load_distilled` reads it.

    Only the final hidden states come out of the backbone; the LM head then runs per sequence on its
    response positions alone (at most ``max_length`` rows × V at a time, instead of the whole batch's
    logits), and only the RL trajectory's few rows ever become float32 probabilities. The states are
    written in the policy's dtype as each batch finishes, so RAM holds one batch of them at a time.

    Under ``mixed_precision: bf16`` the pass runs in bfloat16 autocast (~2.5× faster on a CPU with bf16
    units); the heads then learn from states a rounding away from those they see when decoding.

    A response whose whole sequence is longer than ``cfg.max_length`` gets no positions (dropped, never truncated:
    models/common/sequences.py's length rule); :func:`too_long_responses` reads their count from the cache.
    """
    tok, model = policy.tokenizer, policy.model
    lm_head = model.get_output_embeddings()
    generator = torch.Generator().manual_seed(cfg.seed)  # on the CPU: the same RL candidates on any device
    sequences = sft_sequences(tok, samples)
    kept = [i for i, sequence in enumerate(sequences) if fits(sequence, cfg.max_length)]  # rows of ``samples``
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in INDEX_FIELDS}
    rows_so_far = 0
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / HIDDEN_FILE, "wb") as cache:
        for start in tqdm(range(0, len(kept), cfg.distill_batch_size), desc="self-distillation pass", unit="batch"):
            chunk_rows = kept[start : start + cfg.distill_batch_size]
            chunk = [sequences[i] for i in chunk_rows]
            batch = right_pad(chunk, padding_id(tok))  # (B, T) each
            with _autocast(policy, cfg):
                hidden = model.base_model(input_ids=batch["input_ids"].to(policy.device),
                                          attention_mask=batch["attention_mask"].to(policy.device)
                                          ).last_hidden_state  # (B, T, H): the states the LM head reads
            for row, (sample_row, (ids, mask)) in enumerate(zip(chunk_rows, chunk, strict=True)):
                positions = _response_positions(ids, mask)
                if len(positions) == 0:
                    continue
                states = hidden[row, positions.to(policy.device)]  # (n, H)
                with _autocast(policy, cfg):
                    logits = lm_head(states)  # (n, V)
                sampled = torch.tensor(ids)[positions + 1]
                next_tokens = logits.argmax(-1).cpu() if cfg.targets == "greedy" else sampled
                cache.write(states.to(lm_head.weight.dtype).cpu().contiguous().view(torch.uint8).numpy())
                parts["targets"].append(_head_targets(next_tokens, cfg.num_heads))
                parts["sample"].append(torch.full((len(positions),), sample_row))
                # trajectory states: t + 2 must still be a response token, so p(x_{t+2} | x_{≤t+1}) is logits[t + 1]
                steps = min(rl_cfg.trajectory_tokens, len(positions) - 1)
                if steps > 0:
                    probs = torch.softmax(logits[1 : steps + 1].float(), dim=-1)  # (steps, V)
                    candidates = sample_candidates(probs, generator, rl_cfg.top_candidates, rl_cfg.top_pool,
                                                   rl_cfg.random_candidates)
                    parts["rl_rows"].append(rows_so_far + torch.arange(steps))
                    parts["rl_candidates"].append(candidates.cpu())
                    parts["rl_probs"].append(probs.gather(1, candidates).cpu())
                rows_so_far += len(positions)
    if not parts["targets"]:
        raise ValueError(f"no response tokens to learn from: every sample's response is empty or longer than "
                         f"medusa.max_length {cfg.max_length} tokens ({len(sequences) - len(kept)} of {len(sequences)})")
    save_file({name: torch.cat(values) for name, values in parts.items()}, folder / INDEX_FILE,
              metadata={"hidden_dtype": str(lm_head.weight.dtype).removeprefix("torch."),
                        "hidden_size": str(lm_head.weight.shape[1]), "too_long": str(len(sequences) - len(kept))})
    return load_distilled(folder)


def train_medusa_heads(policy: Policy, data: DistilledStates, cfg: MedusaTraining,
                       accelerator: Accelerator | None = None,
                       on_step: Callable[[int, int, dict[str, float]], None] | None = None,
                       ) -> tuple[MedusaHeads, dict[str, list]]:
    """Medusa-1: fit fresh heads to ``data`` with the backbone frozen. Returns the heads (in the policy's
    dtype; the shared loop trains float32 master weights under autocast when that is a half dtype) and a
    history (``loss`` and per-head ``ce_head{k}`` per step, ``learning_rate``)."""
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

    return train(heads, StateDataset(data.hidden, data.targets), step, heads.parameters(),
                 partial(torch.optim.AdamW, lr=cfg.learning_rate, weight_decay=0.0), accelerator=accelerator,
                 epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed, warmup_ratio=cfg.warmup_ratio,
                 desc="Medusa heads", on_step=on_step, count_changes="Medusa heads")


@torch.no_grad()
def target_ranks(heads: MedusaHeads, lm_head, data: DistilledStates, ranks: int = 10, batch_size: int = 256
                 ) -> torch.Tensor:
    """(M, K): at each position of ``data``, the rank of head k's target among the head's top ``ranks`` tokens;
    ``ranks`` where it is not among them or where there is no target (past the response's end)."""
    found = []
    for start in range(0, len(data.hidden), batch_size):
        hidden = data.hidden[start : start + batch_size].to(lm_head.weight.device, lm_head.weight.dtype)
        targets = data.targets[start : start + batch_size].to(lm_head.weight.device)
        top = heads(hidden, lm_head).topk(ranks, dim=-1).indices  # (N, K, ranks)
        hit = top == targets[..., None]  # (N, K, ranks): one hit at most (IGNORE_INDEX is no token)
        found.append(torch.where(hit.any(dim=-1), hit.int().argmax(dim=-1), ranks).cpu())  # (N, K)
    return torch.cat(found)


def accuracy_by_rank(found: torch.Tensor, targets: torch.Tensor, top_k: int, ranks: int) -> dict[str, list]:
    """Accuracy per head from :func:`target_ranks`' ``found`` (M, K) and the ``targets`` (M, K): ``top1``,
    ``top{top_k}`` (K,), and ``rank_accuracy`` (K, ranks): how often the head's rank-r token is the target,
    over the positions where it has one."""
    valid = targets != IGNORE_INDEX  # (M, K)
    hits = F.one_hot(found, ranks + 1)[..., :ranks].sum(dim=0).float()  # (K, ranks)
    rank_accuracy = hits / valid.sum(dim=0).clamp(min=1)[:, None]  # (K, ranks)
    return {"top1": rank_accuracy[:, 0].tolist(), f"top{top_k}": rank_accuracy[:, :top_k].sum(1).tolist(),
            "rank_accuracy": rank_accuracy.tolist()}


def evaluate_heads(heads: MedusaHeads, lm_head, data: DistilledStates, top_k: int = 5, ranks: int = 10,
                   batch_size: int = 256) -> dict[str, list]:
    """Held-out accuracy per head (:func:`accuracy_by_rank`) over the top ``max(ranks, top_k)`` ranks."""
    ranks = max(ranks, top_k)
    return accuracy_by_rank(target_ranks(heads, lm_head, data, ranks, batch_size), data.targets, top_k, ranks)
