"""Preference pairs: every (higher, lower) pair of a prompt or its best–worst pair only, the best–worst pair
flagged; prompts without a spread are dropped and counted; the split keeps a prompt's pairs together."""

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
    frame = scores_frame([("a", 0, 0.1), ("a", 1, 0.9), ("a", 2, -0.5), ("b", 0, 2.0), ("b", 1, 1.0)])
    pairs, stats = make_pairs(frame, pairing="best_worst")
    assert list(pairs.columns) == PAIR_COLUMNS and pairs["best_worst"].tolist() == [True, True]
    a = pairs.set_index("prompt_id").loc["a"]
    assert (a.chosen, a.rejected, a.chosen_score, a.rejected_score) == ("r a 1", "r a 2", 0.9, -0.5)
    assert a.score_gap == 0.9 - (-0.5) and a.chosen_sample_id == "a/1"
    assert stats == {"num_prompts": 2, "num_pairs": 2, "num_pairs_uncapped": 2, "dropped_single_sample": 0,
                     "dropped_no_spread": 0, "pair_yield": 1.0, "pairs_per_prompt": 1.0}


def test_all_pairs_of_right_and_wrong_answers():
    # scores [1, 0, 0, 1]: each right answer against each wrong one, 4 pairs; best-worst = (0, 1) by sample index
    pairs, stats = make_pairs(scores_frame([("q", i, s) for i, s in enumerate([1.0, 0.0, 0.0, 1.0])]))
    assert list(zip(pairs["chosen_sample_id"], pairs["rejected_sample_id"], pairs["best_worst"])) == [
        ("q/0", "q/1", True), ("q/0", "q/2", False), ("q/3", "q/1", False), ("q/3", "q/2", False)]
    assert (pairs["score_gap"] == 1.0).all() and pairs["best_worst"].dtype == bool
    assert stats["num_pairs"] == 4 and stats["pair_yield"] == 1.0 and stats["pairs_per_prompt"] == 4.0
    best_worst, _ = make_pairs(scores_frame([("q", i, s) for i, s in enumerate([1.0, 0.0, 0.0, 1.0])]),
                               pairing="best_worst")
    assert best_worst.drop(columns="best_worst").equals(pairs[pairs["best_worst"]].drop(columns="best_worst"))


def test_all_pairs_with_real_valued_scores_and_a_gap():
    # scores 0.9, 0.5, 0.45, -0.2 with min_score_gap 0.3: gaps 0.4, 0.45, 1.1, 0.7, 0.65 pass; 0.05 does not
    frame = scores_frame([("r", 0, 0.5), ("r", 1, -0.2), ("r", 2, 0.9), ("r", 3, 0.45), ("s", 0, 0.2), ("s", 1, 0.4)])
    pairs, stats = make_pairs(frame, min_score_gap=0.3)
    got = {(c, r): round(g, 6) for c, r, g in zip(pairs["chosen_sample_id"], pairs["rejected_sample_id"],
                                                   pairs["score_gap"])}
    assert got == {("r/0", "r/1"): 0.7, ("r/2", "r/0"): 0.4, ("r/2", "r/1"): 1.1, ("r/2", "r/3"): 0.45,
                   ("r/3", "r/1"): 0.65}
    assert pairs.loc[pairs["best_worst"], ["chosen_sample_id", "rejected_sample_id"]].values.tolist() == [
        ["r/2", "r/1"]]
    assert stats["dropped_no_spread"] == 1 and stats["pair_yield"] == 0.5 and stats["pairs_per_prompt"] == 5.0
    assert (pairs["chosen_score"] > pairs["rejected_score"]).all()


def test_a_cap_keeps_the_widest_gaps_of_each_prompt_and_counts_what_it_dropped():
    """Continuous scores: 5 distinct samples give C(5, 2) = 10 pairs. Prompt c: scores 0.9, 0.1, 0.5, -0.3, 0.5+.
    Gaps by hand, widest first: (0, 3) 1.2, (4, 3) 0.81, (0, 1) 0.8, (2, 3) 0.8, (4, 1) 0.41, ... — a cap of 3 keeps
    (0, 3), (4, 3) and, of the two 0.8 gaps, (0, 1) (lower chosen index: 0 < 2). Prompt d (2 samples, 1 pair) is
    under the cap; prompt e's 3 tied-gap pairs keep the lowest (chosen, rejected) indices."""
    frame = scores_frame([("c", 0, 0.9), ("c", 1, 0.1), ("c", 2, 0.5), ("c", 3, -0.3), ("c", 4, 0.51),
                          ("d", 0, 0.0), ("d", 1, 1.0),
                          ("e", 0, 1.0), ("e", 1, 1.0), ("e", 2, 0.0), ("e", 3, 0.0)])
    uncapped, before = make_pairs(frame)
    assert before["num_pairs"] == before["num_pairs_uncapped"] == 10 + 1 + 4
    pairs, stats = make_pairs(frame, max_pairs_per_prompt=3)
    kept = list(zip(pairs["prompt_id"], pairs["chosen_sample_id"], pairs["rejected_sample_id"]))
    # in sample order (chosen, then rejected), as without the cap
    assert kept == [("c", "c/0", "c/1"), ("c", "c/0", "c/3"), ("c", "c/4", "c/3"), ("d", "d/1", "d/0"),
                    ("e", "e/0", "e/2"), ("e", "e/0", "e/3"), ("e", "e/1", "e/2")]
    assert stats["num_pairs"] == 7 and stats["num_pairs_uncapped"] == 15 and stats["pairs_per_prompt"] == 7 / 3
    # every prompt keeps its best–worst pair: the widest gap, lowest indices first
    assert pairs.loc[pairs["best_worst"], "chosen_sample_id"].tolist() == ["c/0", "d/1", "e/0"]
    assert pairs.loc[pairs["best_worst"], "rejected_sample_id"].tolist() == ["c/3", "d/0", "e/2"]
    one, _ = make_pairs(frame, max_pairs_per_prompt=1)
    assert one.drop(columns="best_worst").equals(make_pairs(frame, pairing="best_worst")[0].drop(columns="best_worst"))
    assert make_pairs(frame, max_pairs_per_prompt=100)[0].equals(uncapped)


def test_ties_single_samples_and_all_equal():
    pairs, stats = make_pairs(scores_frame([
        ("tie", 0, 1.0), ("tie", 1, 1.0), ("tie", 2, 0.0), ("tie", 3, 0.0),  # ties: lowest sample index wins
        ("single", 0, 1.0),
        ("equal", 0, 0.5), ("equal", 1, 0.5), ("equal", 2, 0.5),
    ]), pairing="best_worst")
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
    # with every pair of 3 samples (3 pairs per prompt), a prompt's pairs all land on one side
    many, _ = make_pairs(scores_frame([(f"p{i}", j, float(j)) for i in range(10) for j in range(3)]))
    train, held_out = split_pairs(many, 0.25, seed=0)
    assert held_out["prompt_id"].value_counts().tolist() == [3, 3] and len(train) == 24
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])
    assert list(split_pairs(pairs, 0.25, seed=1)[1]["prompt_id"]) != list(held_out["prompt_id"])
    one_each = split_pairs(pairs.head(2), 0.01, seed=0)
    assert (len(one_each[0]), len(one_each[1])) == (1, 1)
