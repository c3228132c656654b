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


def test_split_pairs_is_deterministic_disjoint_and_never_empty():
    from foresight.pairs import split_pairs

    frame = scores_frame([(f"p{i}", j, float(j)) for i in range(10) for j in range(2)])
    pairs, _ = make_pairs(frame)
    train, held_out = split_pairs(pairs, 0.25, seed=0)
    again_train, again_held_out = split_pairs(pairs, 0.25, seed=0)
    assert list(held_out["prompt_id"]) == list(again_held_out["prompt_id"]) and len(held_out) == 2
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"]) and len(train) + len(held_out) == 10
    assert list(split_pairs(pairs, 0.25, seed=1)[1]["prompt_id"]) != list(held_out["prompt_id"])
    one_each = split_pairs(pairs.head(2), 0.01, seed=0)
    assert (len(one_each[0]), len(one_each[1])) == (1, 1)
