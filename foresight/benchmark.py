"""Benchmark machinery shared by the decoder comparisons (the SLA, Medusa and COrAL benchmarks; the MTP-RL report).

- :func:`win_tie_loss`: per-prompt comparison of a decoder's rewards with a reference decoder's,
  summarised as the SLA paper does: win rate = win + tie / 2.
- :class:`DecodeTimer` / :func:`speed_row`: tokens/s and per-token latency measured in the same run,
  as ratios to the reference decoder. On a GPU, kernels run asynchronously: every timer waits for them
  (:func:`synchronize`) before reading the clock, or it would time their launches.
- :func:`interleaved_decoding`: every decoder on every prompt at batch 1, prompt-major, timed.
- :func:`markdown_table`: the human-readable report table (plots: :mod:`foresight.plots`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm


def win_tie_loss(rewards: Sequence[float], reference: Sequence[float], tolerance: float = 1e-9) -> dict:
    """Share of prompts where ``rewards`` beat, tie or lose to ``reference``; ``win_rate`` = win + tie/2."""
    if len(rewards) != len(reference) or not rewards:
        raise ValueError(f"need two equally long, non-empty reward lists (got {len(rewards)} and {len(reference)})")
    wins = sum(r > ref + tolerance for r, ref in zip(rewards, reference))
    losses = sum(r < ref - tolerance for r, ref in zip(rewards, reference))
    n = len(rewards)
    ties = n - wins - losses
    return {"win": wins / n, "tie": ties / n, "loss": losses / n, "win_rate": (wins + ties / 2) / n}


def synchronize() -> None:
    """Wait for every queued CUDA kernel (a no-op when CUDA was never used in this process)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class DecodeTimer:
    """Accumulates wall time and generated tokens of batch-1 decoding calls."""

    seconds: float = 0.0
    tokens: int = 0
    calls: int = 0
    _started: float = field(default=0.0, repr=False)

    def __enter__(self) -> DecodeTimer:
        synchronize()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize()
        self.seconds += time.perf_counter() - self._started
        self.calls += 1

    def add_tokens(self, count: int) -> None:
        self.tokens += count

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.seconds / self.tokens if self.tokens else float("nan")


def speed_row(timer: DecodeTimer, reference: DecodeTimer) -> dict:
    """Speed of a decoder and its ratios to the reference (latency ratio > 1 = slower per token)."""
    return {
        "tokens_per_s": timer.tokens_per_s,
        "ms_per_token": timer.ms_per_token,
        "latency_vs_reference": timer.ms_per_token / reference.ms_per_token,
        "speedup_vs_reference": timer.tokens_per_s / reference.tokens_per_s,
    }


def interleaved_decoding(decoders: Sequence[str], prompts: Sequence[Any],
                         decode: Callable[[str, Any, int], tuple[list[int], Any]], max_new_tokens: int, desc: str,
                         warm_up_tokens: int = 8) -> tuple[dict[str, DecodeTimer], list[dict]]:
    """Decode every prompt with every decoder, ``decode(decoder, prompt, max_new_tokens) → (tokens, stats)``,
    and time each decoder. One short warm-up call per decoder first (first calls pay one-off allocation
    costs); then prompt-major order, so slow drifts of the machine's speed affect every decoder alike.
    Returns the timers and one record per (prompt, decoder): ``prompt_index``, ``decoder``, ``tokens``, ``stats``.
    """
    for decoder in decoders:
        decode(decoder, prompts[0], warm_up_tokens)
    timers = {decoder: DecodeTimer() for decoder in decoders}
    records = []
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        for decoder in decoders:
            with timers[decoder]:
                tokens, stats = decode(decoder, prompt, max_new_tokens)
            timers[decoder].add_tokens(len(tokens))
            records.append({"prompt_index": i, "decoder": decoder, "tokens": tokens, "stats": stats})
    return timers, records


def _cell(value) -> str:
    if isinstance(value, float):
        return "–" if value != value else f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub-markdown table of ``rows`` (floats to 3 significant digits, NaN as –)."""
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
