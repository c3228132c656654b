"""Self-distilled data and Medusa-1 training of the heads on a frozen backbone (Medusa §2.2.1, §2.3.2;
docs/medusa.md).

The data are the policy's own responses (the ``distill`` stage): by default its greedy responses to the training
prompts (:func:`models.engine.decoding.greedy_responses`), which is the text the heads will draft for when
verification is greedy; or the generate stage's samples. One frozen forward over them (:func:`self_distill`) gives
everything the head stages need, so the backbone runs once: the final hidden state h_t of every response position
and, per head k, the target token t + k + 1: the sampled token, or the backbone's greedy choice at that position
given the sampled prefix (``targets: greedy``: exactly what greedy verification will check). RLMedusa draws its
candidates over these states (:func:`models.medusa.rlmedusa.trajectory_candidates`: the LM head again, on the
cached states).

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

from models.common.config import MixedPrecision
from models.common.sequences import fits, padding_id, right_pad, sft_sequences
from models.common.training import train
from models.engine.policy import Policy
from models.medusa.config import MedusaTraining
from models.medusa.heads import IGNORE_INDEX, MedusaHeads, heads_for, medusa_loss

if TYPE_CHECKING:
    from accelerate import Accelerator

HIDDEN_FILE = "hidden.bin"  # the (M, H) hidden states, row-major raw bytes in the policy's dtype
INDEX_FILE = "states.safetensors"  # everything else the pass yields (small), and the hidden states' dtype and width
INDEX_FIELDS = ("targets", "sample")


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

    def subset(self, samples: torch.Tensor) -> DistilledStates:
        """The positions of the given sample rows."""
        keep = torch.isin(self.sample, samples)
        return DistilledStates(self.hidden.subset(keep), self.targets[keep], self.sample[keep])


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


def pass_autocast(device: torch.device, mixed_precision: MixedPrecision) -> AbstractContextManager:
    """bfloat16 autocast on ``device`` under ``mixed_precision: bf16``, else nothing: the frozen pass's, and that
    of every later forward of the LM head over its states that must give the pass's logits bit for bit."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16")


@torch.no_grad()
def self_distill(policy: Policy, samples: pd.DataFrame, cfg: MedusaTraining, folder: Path) -> DistilledStates:
    """One frozen forward per batch of (prompt + response) sequences (see the module docstring); the cache
    goes to ``folder`` and comes back as :func:`load_distilled` reads it.

    Only the final hidden states come out of the backbone; the LM head then runs per sequence on its
    response positions alone (at most ``max_length`` rows × V at a time, instead of the whole batch's
    logits). The states are written in the policy's dtype as each batch finishes, so RAM holds one batch of them
    at a time; they are the very states the LM head read here (their dtype is the policy's), so RLMedusa's
    :func:`models.medusa.rlmedusa.trajectory_candidates` gets this pass's logits back from them bit for bit.

    Under ``mixed_precision: bf16`` the pass runs in bfloat16 autocast (~2.5× faster on a CPU with bf16
    units); the heads then learn from states a rounding away from those they see when decoding.

    A response whose whole sequence is longer than ``cfg.max_length`` gets no positions (dropped, never truncated:
    models/common/sequences.py's length rule); :func:`too_long_responses` reads their count from the cache.
    """
    tok, model = policy.tokenizer, policy.model
    lm_head = model.get_output_embeddings()
    sequences = sft_sequences(tok, samples)
    kept = [i for i, sequence in enumerate(sequences) if fits(sequence, cfg.max_length)]  # rows of ``samples``
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in INDEX_FIELDS}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / HIDDEN_FILE, "wb") as cache:
        for start in tqdm(range(0, len(kept), cfg.distill_batch_size), desc="self-distillation pass", unit="batch"):
            chunk_rows = kept[start : start + cfg.distill_batch_size]
            chunk = [sequences[i] for i in chunk_rows]
            batch = right_pad(chunk, padding_id(tok))  # (B, T) each
            with pass_autocast(policy.device, cfg.mixed_precision):
                hidden = model.base_model(input_ids=batch["input_ids"].to(policy.device),
                                          attention_mask=batch["attention_mask"].to(policy.device)
                                          ).last_hidden_state  # (B, T, H): the states the LM head reads
            for row, (sample_row, (ids, mask)) in enumerate(zip(chunk_rows, chunk, strict=True)):
                positions = _response_positions(ids, mask)
                if len(positions) == 0:
                    continue
                states = hidden[row, positions.to(policy.device)]  # (n, H)
                with pass_autocast(policy.device, cfg.mixed_precision):
                    logits = lm_head(states)  # (n, V)
                sampled = torch.tensor(ids)[positions + 1]
                next_tokens = logits.argmax(-1).cpu() if cfg.targets == "greedy" else sampled
                cache.write(states.to(lm_head.weight.dtype).cpu().contiguous().view(torch.uint8).numpy())
                parts["targets"].append(_head_targets(next_tokens, cfg.num_heads))
                parts["sample"].append(torch.full((len(positions),), sample_row))
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

    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu",
                                             gradient_accumulation_steps=cfg.gradient_accumulation_steps)
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
                 desc="Medusa heads", on_step=on_step, count_changes="Medusa heads", loop=cfg)


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
