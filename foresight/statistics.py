"""Uncertainty of every reported figure: 95 % confidence intervals by the bootstrap (``scipy.stats.bootstrap``).

A benchmark figure is a statistic of per-prompt (or per-pair, per-repeat) values; its interval comes from
resampling those units with replacement. Comparisons with a reference decoder are *paired*: the same prompts
are resampled together for the decoder and its reference, so what the prompts share cancels out.

- :func:`mean_interval`: a mean (accuracy, mean reward, pair accuracy) over units.
- :func:`paired_difference`: mean(values − reference) — does a decoder differ from its reference?
- :func:`win_rate`: the SLA paper's win rate (win = 1, tie = ½, loss = 0 per prompt) against 0.5.
- :func:`speedup`: (Σ tokens / Σ seconds) over the reference's, prompts resampled in pairs; against 1.
- :func:`ratio_of_means`: mean(x) / mean(y) of paired repeats (a forward with and without the reward channel).
- :func:`ratio_of_sums`: Σ x / Σ y over units (a per-token rate whose unit is the sequence, prompt or rollout).
- :func:`paired_ratio_difference`: Σ x / Σ t − Σ y / Σ t over units (two heads' accuracy on the same targets).
- :func:`clustered_mean_interval`: a mean over units that come in dependent clusters (the pairs of one prompt),
  resampling whole clusters.

Rows stay flat for CSV and MLflow: :func:`interval_columns` writes ``name``, ``name_low``, ``name_high`` and,
where a reference exists, ``name_significant`` (the interval excludes the reference's value);
:func:`foresight.benchmark.markdown_table` shows them as ``value [low, high]`` with ``*`` when significant.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 4000  # percentile intervals: their Monte-Carlo error at 4000 resamples is ~0.01 of the interval width


@dataclass(frozen=True)
class Interval:
    """A statistic with its 95 % confidence interval over ``n`` units (low = high = NaN when n < 2)."""

    value: float
    low: float
    high: float
    n: int

    def excludes(self, reference: float) -> bool:
        """True when the interval lies wholly above or below ``reference`` (a significant difference)."""
        return bool(self.low > reference or self.high < reference)

    def __str__(self) -> str:
        return f"{self.value:.3g} [{self.low:.3g}, {self.high:.3g}]"


def bootstrap(samples: Sequence[Sequence[float]], statistic: Callable[..., np.ndarray], seed: int = 0) -> Interval:
    """Paired percentile bootstrap of ``statistic(*samples, axis=-1)`` over the units (the samples' common index).

    ``statistic`` must be vectorised (numpy reductions along ``axis``). Constant data gives a zero-width interval,
    fewer than two units an undefined one (NaN bounds).
    """
    arrays = [np.asarray(s, dtype=float) for s in samples]
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ValueError(f"paired samples need equal lengths, got {sorted(lengths)}")
    (n,) = lengths
    if n == 0:
        raise ValueError("no units to estimate from")
    value = float(statistic(*arrays, axis=-1))
    if n < 2:
        return Interval(value, math.nan, math.nan, n)
    if all(np.all(a == a[0]) for a in arrays):
        return Interval(value, value, value, n)
    from scipy.stats import bootstrap as scipy_bootstrap

    with warnings.catch_warnings():  # a resample of near-constant data may be degenerate: percentiles still hold
        warnings.simplefilter("ignore")
        result = scipy_bootstrap(arrays, statistic, paired=True, vectorized=True, n_resamples=RESAMPLES,
                                 confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed))
    low, high = result.confidence_interval
    return Interval(value, float(low), float(high), n)


def _mean(x, axis):
    return np.mean(x, axis=axis)


def mean_interval(values: Sequence[float], seed: int = 0) -> Interval:
    """The mean of per-unit values (0/1 correctness, rewards) with its interval."""
    return bootstrap([values], _mean, seed)


def _mean_difference(x, y, axis):
    return np.mean(x - y, axis=axis)


def paired_difference(values: Sequence[float], reference: Sequence[float], seed: int = 0) -> Interval:
    """mean(values − reference) over paired units: significant when the interval excludes 0."""
    # both sides go to the bootstrap (not their difference): unequal lengths fail instead of broadcasting
    return bootstrap([values, reference], _mean_difference, seed)


def outcomes(rewards: Sequence[float], reference: Sequence[float], tolerance: float = 1e-9) -> np.ndarray:
    """Per prompt: 1 (win), ½ (tie, within ``tolerance``) or 0 (loss) of ``rewards`` against ``reference``."""
    rewards, reference = np.asarray(rewards, float), np.asarray(reference, float)
    if rewards.shape != reference.shape or rewards.size == 0:
        raise ValueError(f"need two equally long, non-empty reward lists (got {rewards.size} and {reference.size})")
    return np.where(rewards > reference + tolerance, 1.0, np.where(rewards < reference - tolerance, 0.0, 0.5))


def win_rate(rewards: Sequence[float], reference: Sequence[float], tolerance: float = 1e-9, seed: int = 0) -> Interval:
    """Win rate = win + tie/2 over prompts, with its interval (significant when it excludes 0.5)."""
    return bootstrap([outcomes(rewards, reference, tolerance)], _mean, seed)


def _speedup(tokens, seconds, reference_tokens, reference_seconds, axis):
    return (np.sum(tokens, axis) / np.sum(seconds, axis)) / (np.sum(reference_tokens, axis)
                                                              / np.sum(reference_seconds, axis))


def speedup(tokens: Sequence[int], seconds: Sequence[float], reference_tokens: Sequence[int],
            reference_seconds: Sequence[float], seed: int = 0) -> Interval:
    """Tokens/s of a decoder over its reference's, both summed over the same prompts (resampled in pairs)."""
    return bootstrap([tokens, seconds, reference_tokens, reference_seconds], _speedup, seed)


def _ratio_of_means(x, y, axis):
    return np.mean(x, axis) / np.mean(y, axis)


def ratio_of_means(values: Sequence[float], reference: Sequence[float], seed: int = 0) -> Interval:
    """mean(values) / mean(reference) over paired repeats (e.g. interleaved timings); significant when ≠ 1."""
    return bootstrap([values, reference], _ratio_of_means, seed)


def ratio_of_sums(values: Sequence[float], totals: Sequence[float], seed: int = 0) -> Interval:
    """Σ values / Σ totals over units (hits / targets per held-out sequence, tokens / forwards per prompt, accepted
    tokens / cycles per rollout), the units resampled; undefined (NaN, n = 0) when the totals sum to 0."""
    if not np.sum(np.asarray(totals, dtype=float)) > 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    return ratio_of_means(values, totals, seed)  # over the same units, mean / mean = sum / sum


def _ratio_difference(x, y, totals, axis):
    return (np.sum(x, axis) - np.sum(y, axis)) / np.sum(totals, axis)


def paired_ratio_difference(values: Sequence[float], reference: Sequence[float], totals: Sequence[float],
                            seed: int = 0) -> Interval:
    """Σ values / Σ totals − Σ reference / Σ totals over units resampled together (hits of two heads on the same
    held-out targets, per sequence): significant when the interval excludes 0."""
    return bootstrap([values, reference, totals], _ratio_difference, seed)


def clustered_mean_interval(values: Sequence[float], clusters: Sequence, seed: int = 0) -> Interval:
    """The mean of per-unit values whose units come in dependent clusters (e.g. the preference pairs of one
    prompt): whole clusters are resampled (a cluster bootstrap), the mean being Σ values / Σ units over the
    clusters drawn. The value is the plain mean over units; ``n`` counts clusters."""
    values = np.asarray(values, dtype=float)
    _, cluster = np.unique(np.asarray(clusters), return_inverse=True)
    return ratio_of_means(np.bincount(cluster, weights=values), np.bincount(cluster).astype(float), seed)


def interval_columns(name: str, interval: Interval, reference: float | None = None) -> dict:
    """``{name, name_low, name_high}`` (+ ``name_significant`` against ``reference``) for a flat table row."""
    columns = {name: interval.value, f"{name}_low": interval.low, f"{name}_high": interval.high}
    if reference is not None:
        columns[f"{name}_significant"] = interval.excludes(reference)
    return columns
