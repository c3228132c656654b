"""Confidence intervals of the benchmarks (foresight/statistics.py): hand-worked cases, a direct
``scipy.stats.bootstrap`` call and an independent numpy bootstrap as references, and the coverage of the
intervals on data whose true mean is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from foresight import statistics
from foresight.statistics import (
    Interval,
    bootstrap,
    clustered_mean_interval,
    interval_columns,
    mean_interval,
    outcomes,
    paired_difference,
    ratio_of_means,
    speedup,
    win_rate,
)


def test_constant_data_has_a_zero_width_interval_and_one_unit_an_undefined_one():
    assert mean_interval([0.5] * 7) == Interval(0.5, 0.5, 0.5, 7)
    one = mean_interval([3.0])
    assert one.value == 3.0 and one.n == 1 and math.isnan(one.low) and math.isnan(one.high)
    assert not one.excludes(0.0)  # an undefined interval is never significant
    with pytest.raises(ValueError, match="no units"):
        mean_interval([])
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0, 2.0], [1.0])


def test_excludes_and_interval_columns():
    interval = Interval(0.7, 0.55, 0.85, 40)
    assert interval.excludes(0.5) and interval.excludes(0.9) and not interval.excludes(0.6)
    assert not interval.excludes(0.55)  # a bound that touches the reference is not a difference
    assert interval_columns("win_rate", interval, reference=0.5) == {
        "win_rate": 0.7, "win_rate_low": 0.55, "win_rate_high": 0.85, "win_rate_significant": True}
    assert interval_columns("accuracy", interval) == {"accuracy": 0.7, "accuracy_low": 0.55, "accuracy_high": 0.85}
    assert str(interval) == "0.7 [0.55, 0.85]"


def test_win_tie_loss_outcomes_and_win_rate():
    assert outcomes([1.0, 0.0, 0.5, 0.2], [0.0, 0.0, 0.7, 0.2]).tolist() == [1.0, 0.5, 0.0, 0.5]
    assert outcomes([1.0], [1.0 + 1e-12]).tolist() == [0.5]  # within the tolerance: a tie
    assert win_rate([1.0, 0.0, 0.5, 0.2], [0.0, 0.0, 0.7, 0.2]).value == 0.5
    with pytest.raises(ValueError, match="equally long"):
        outcomes([1.0], [1.0, 2.0])
    # 10 wins of 10: every resample is 1 → [1, 1], significant; 6 wins and 4 losses: chance is inside
    assert win_rate([1.0] * 10, [0.0] * 10) == Interval(1.0, 1.0, 1.0, 10)
    mixed = win_rate([1.0] * 6 + [0.0] * 4, [0.5] * 10)
    assert mixed.value == 0.6 and mixed.low < 0.5 < mixed.high and not mixed.excludes(0.5)


def test_speedup_of_hand_made_timings():
    # every call of the decoder runs at 10 tok/s, every reference call at 5 tok/s: 2× in every resample
    exact = speedup([10, 20, 30], [1.0, 2.0, 3.0], [10, 20, 30], [2.0, 4.0, 6.0])
    assert (exact.value, exact.low, exact.high, exact.n) == (pytest.approx(2.0), pytest.approx(2.0),
                                                             pytest.approx(2.0), 3)
    assert exact.excludes(1.0)
    # two calls of 10 tokens: the decoder took 1 s and 3 s, the reference 2 s and 2 s → 20/4 over 20/4 = 1.
    # Resamples {1st, 1st} give (20/2)/(20/4) = 2, {2nd, 2nd} (20/6)/(20/4) = 2/3, mixed ones 1: probability
    # ¼, ¼ and ½, so the 2.5 % and 97.5 % percentiles are 2/3 and 2.
    spread = speedup([10, 10], [1.0, 3.0], [10, 10], [2.0, 2.0])
    assert (spread.value, spread.low, spread.high) == (pytest.approx(1.0), pytest.approx(2 / 3), pytest.approx(2.0))
    assert not spread.excludes(1.0)


def test_ratio_of_means_and_paired_difference_by_hand():
    assert ratio_of_means([3.0, 3.0, 3.0], [2.0, 2.0, 2.0]) == Interval(1.5, 1.5, 1.5, 3)
    # the joint forward is 10 % slower in every pair, whatever the pair's own speed: exactly 1.1
    policy = [40.0, 55.0, 47.0, 61.0]
    joint = [1.1 * t for t in policy]
    overhead = ratio_of_means(joint, policy)
    assert overhead.low == pytest.approx(1.1) and overhead.high == pytest.approx(1.1) and overhead.excludes(1.0)
    assert paired_difference([2.0, 5.0, 9.0], [1.0, 4.0, 8.0]) == Interval(1.0, 1.0, 1.0, 3)


def test_paired_ratio_difference_by_hand():
    """Two heads' hits on the same targets per sequence: (3 + 1 + 4) / 16 − (2 + 1 + 1) / 16 = 0.25; a head one hit
    better in every sequence of equal length is better by exactly 1 / length whatever the resample."""
    from foresight.statistics import paired_ratio_difference

    difference = paired_ratio_difference([3, 1, 4], [2, 1, 1], [4, 4, 8])
    assert difference.value == pytest.approx(0.25) and difference.n == 3
    assert 0.0 <= difference.low <= 0.25 <= difference.high
    constant = paired_ratio_difference([3, 5, 2, 4], [2, 4, 1, 3], [10, 10, 10, 10])
    assert constant.low == pytest.approx(0.1) and constant.high == pytest.approx(0.1) and constant.excludes(0.0)


def test_pairing_cancels_what_the_units_share():
    """A decoder 0.1 better on every prompt of a very mixed set: paired, that is significant; the two means'
    own intervals overlap widely (comparing them unpaired would see nothing)."""
    rng = np.random.default_rng(1)
    reference = rng.normal(0.0, 1.0, 40)
    values = reference + 0.1 + rng.normal(0.0, 0.02, 40)
    difference = paired_difference(values, reference)
    assert difference.value == pytest.approx(float(np.mean(values - reference)))
    assert 0.0 < difference.low < 0.1 < difference.high and difference.high - difference.low < 0.03
    alone, other = mean_interval(values), mean_interval(reference)
    assert alone.low < other.high and other.low < alone.high


def test_matches_a_direct_scipy_bootstrap_call():
    """The speedup statistic against ``scipy.stats.bootstrap`` called directly (paired resampling of the four
    per-call arrays, percentile method, same seed and resample count): the same interval."""
    rng = np.random.default_rng(2)
    tokens, reference_tokens = rng.integers(20, 64, 12), rng.integers(20, 64, 12)
    seconds, reference_seconds = tokens / rng.normal(30.0, 3.0, 12), reference_tokens / rng.normal(20.0, 2.0, 12)

    def ratio(t, s, rt, rs, axis):
        return (t.sum(axis) / s.sum(axis)) / (rt.sum(axis) / rs.sum(axis))

    direct = scipy.stats.bootstrap((tokens, seconds, reference_tokens, reference_seconds), ratio, paired=True,
                                   vectorized=True, n_resamples=statistics.RESAMPLES, method="percentile",
                                   confidence_level=0.95, rng=np.random.default_rng(7))
    ours = speedup(tokens, seconds, reference_tokens, reference_seconds, seed=7)
    assert ours.low == pytest.approx(direct.confidence_interval.low)
    assert ours.high == pytest.approx(direct.confidence_interval.high)
    assert ours.value == pytest.approx(ratio(tokens, seconds, reference_tokens, reference_seconds, None))
    assert ours.low < 1.5 < ours.high  # the true ratio of the rates, 30 / 20


def test_agrees_with_an_independent_numpy_bootstrap():
    """A percentile bootstrap written out with numpy (other random draws) gives the same bounds up to the
    Monte-Carlo error of 4000 resamples."""
    rng = np.random.default_rng(3)
    x, y = rng.exponential(2.0, 30), rng.exponential(1.0, 30)
    index = np.random.default_rng(11).integers(0, 30, (20000, 30))
    resampled = x[index].mean(1) / y[index].mean(1)
    low, high = np.percentile(resampled, [2.5, 97.5])
    ours = ratio_of_means(x, y)
    assert ours.value == pytest.approx(x.mean() / y.mean())
    assert ours.low == pytest.approx(low, abs=0.05 * (high - low))
    assert ours.high == pytest.approx(high, abs=0.05 * (high - low))


def test_a_large_normal_sample_gives_the_textbook_interval():
    """n = 4000 draws of N(5, 2²): the interval holds the true mean and is 2 · 1.96 · σ / √n wide (±10 %)."""
    sample = np.random.default_rng(4).normal(5.0, 2.0, 4000)
    interval = mean_interval(sample)
    assert interval.low < 5.0 < interval.high
    assert interval.high - interval.low == pytest.approx(2 * 1.96 * 2.0 / math.sqrt(4000), rel=0.1)


def test_coverage_is_near_95_percent():
    """300 samples of 40 Bernoulli(0.3) prompts (a benchmark's accuracy): the share of intervals that hold
    0.3 is near 95 % (percentile intervals run slightly short at n = 40; binomial sd of the share ≈ 1.3 %)."""
    rng = np.random.default_rng(5)
    covered = [mean_interval(rng.random(40) < 0.3, seed=i) for i in range(300)]
    share = np.mean([c.low <= 0.3 <= c.high for c in covered])
    assert 0.88 <= share <= 0.99


def test_clustered_mean_resamples_whole_clusters():
    """The pairs of one prompt move together: the value is the mean over pairs, the interval that of a
    bootstrap over prompts."""
    values = [1, 1, 1, 0, 0, 1]
    prompts = ["a", "a", "a", "b", "c", "c"]
    interval = clustered_mean_interval(values, prompts)
    assert interval.value == pytest.approx(4 / 6) and interval.n == 3
    # per prompt (sum, count): a (3, 3), b (0, 1), c (1, 2) → the same bootstrap as ratio_of_means over them
    assert interval == ratio_of_means([3.0, 0.0, 1.0], [3.0, 1.0, 2.0])
    # by hand: the smallest resample mean is {b, b, b} = 0, the largest {a, a, a} = 1; both lie in the tails
    assert 0.0 <= interval.low < 4 / 6 < interval.high <= 1.0
    # one pair per prompt: the plain bootstrap over pairs
    assert clustered_mean_interval([1, 0, 1, 1], ["p", "q", "r", "s"]) == ratio_of_means([1, 0, 1, 1], [1, 1, 1, 1])
    assert clustered_mean_interval([1.0, 1.0, 1.0], ["a", "a", "b"]) == Interval(1.0, 1.0, 1.0, 2)


def test_dependent_clusters_widen_the_interval():
    """Pairs that are copies of their prompt's verdict carry no more information than one pair per prompt:
    the clustered interval is as wide as the per-prompt one, the naive per-pair interval far too narrow."""
    per_prompt = np.random.default_rng(6).random(20) < 0.5
    copies = np.repeat(per_prompt, 10).astype(float)
    clusters = np.repeat(np.arange(20), 10)
    clustered, naive, prompts = (clustered_mean_interval(copies, clusters), mean_interval(copies),
                                 mean_interval(per_prompt.astype(float)))
    assert clustered.high - clustered.low == pytest.approx(prompts.high - prompts.low, rel=0.1)
    assert naive.high - naive.low < 0.5 * (clustered.high - clustered.low)


def test_bootstrap_is_seeded():
    data = np.random.default_rng(8).normal(size=25)
    assert bootstrap([data], np.mean, seed=3) == bootstrap([data], np.mean, seed=3)
    assert bootstrap([data], np.mean, seed=3) != bootstrap([data], np.mean, seed=4)
