"""Preference pairs: chosen = best, rejected = worst; prompts without a spread are dropped and counted."""

import pandas as pd

from foresight.pairs import PAIR_COLUMNS, make_pairs


def scores_frame(rows):
    """rows: (prompt_id, sample_index, score)."""
    return pd.DataFrame([
        {"sample_id": f"{p}/{i}", "prompt_id": p, "sample_index": i, "question": f"Q {p}", "prompt": f"<{p}>",
         "response": f"r {p} {i}", "answer": "1", "score": s}
        for p, i, s in rows
    ])


def test_best_and_worst_are_paired():
    pairs, stats = make_pairs(scores_frame([("a", 0, 0.1), ("a", 1, 0.9), ("a", 2, -0.5), ("b", 0, 2.0), ("b", 1, 1.0)]))
    assert list(pairs.columns) == PAIR_COLUMNS
    a = pairs.set_index("prompt_id").loc["a"]
    assert (a.chosen, a.rejected, a.chosen_score, a.rejected_score) == ("r a 1", "r a 2", 0.9, -0.5)
    assert a.score_gap == 0.9 - (-0.5) and a.chosen_sample_id == "a/1"
    assert stats == {"num_prompts": 2, "num_pairs": 2, "dropped_single_sample": 0, "dropped_no_spread": 0,
                     "pair_yield": 1.0}


def test_ties_single_samples_and_all_equal():
    pairs, stats = make_pairs(scores_frame([
        ("tie", 0, 1.0), ("tie", 1, 1.0), ("tie", 2, 0.0), ("tie", 3, 0.0),  # ties: lowest sample index wins
        ("single", 0, 1.0),
        ("equal", 0, 0.5), ("equal", 1, 0.5), ("equal", 2, 0.5),
    ]))
    assert list(pairs["prompt_id"]) == ["tie"]
    assert (pairs.iloc[0].chosen_sample_id, pairs.iloc[0].rejected_sample_id) == ("tie/0", "tie/2")
    assert stats["dropped_single_sample"] == 1 and stats["dropped_no_spread"] == 1
    assert stats["pair_yield"] == 1 / 3


def test_min_score_gap_and_empty_result():
    frame = scores_frame([("a", 0, 0.0), ("a", 1, 0.2), ("b", 0, 0.0), ("b", 1, 1.0)])
    pairs, stats = make_pairs(frame, min_score_gap=0.5)
    assert list(pairs["prompt_id"]) == ["b"] and stats["dropped_no_spread"] == 1
    pairs, stats = make_pairs(frame, min_score_gap=5.0)
    assert pairs.empty and list(pairs.columns) == PAIR_COLUMNS and stats["num_pairs"] == 0
