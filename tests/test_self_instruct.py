"""Instructions the policy writes itself for the distillation (foresight/self_instruct.py; Self-Instruct §2.2): the
filter on hand-written replies, and the generator end to end on the tiny random model."""

from __future__ import annotations

import pandas as pd
import pytest

SEEDS = ["Ben has 4 apples.", "What is 7 * 8?", "Ivy has 3 cookies."]
HELD_OUT = ["Ava has 2 marbles.", "What is 3 + 5?"]


def test_overlap_and_normalise_by_hand():
    from foresight.self_instruct import normalise, overlap

    assert normalise("  Write a POEM, about snow!  ") == "write a poem about snow"
    # {write, a, poem, about, snow} and {write, a, poem, about, rain}: 4 shared of 6 words
    assert overlap("write a poem about snow", "write a poem about rain") == pytest.approx(4 / 6)
    assert overlap("a b", "c d") == 0.0 and overlap("", "") == 0.0


def test_filter_keeps_new_one_line_instructions_only():
    from foresight.self_instruct import filter_instructions

    replies = [
        "4. Explain how rainbows form.\nAnd then say more.",  # numbering and later lines go: kept as the first line
        "explain how RAINBOWS form!",  # the same once normalised: dropped
        "Explain how a rainbow forms.",  # 2 of 7 words shared with the first (0.29 < 0.7): kept
        "Explain how rainbows form today.",  # 4 of 5 words shared with the first (0.8): dropped
        "What is 3 + 5?",  # a held-out instruction: dropped
        "Ben has 4 apples",  # a seed instruction without its full stop: dropped
        "Here is a new request:",  # announces, asks nothing: dropped
        "Hi",  # under min_tokens
        "Plan a picnic for " + "very " * 20 + "many friends.",  # over max_tokens
        '"Name three rivers in Africa."',  # quotes go
        "Describe your favourite season.",  # one more than asked for
    ]
    words = lambda text: len(text.split())  # noqa: E731  (a token per word)
    kept = filter_instructions(replies, SEEDS, HELD_OUT, 3, words, min_tokens=2, max_tokens=12, max_overlap=0.7)
    assert kept == ["Explain how rainbows form.", "Explain how a rainbow forms.", "Name three rivers in Africa."]
    looser = filter_instructions(replies[:4], SEEDS, HELD_OUT, 10, words, 2, 12, max_overlap=0.9)
    assert looser == ["Explain how rainbows form.", "Explain how a rainbow forms.", "Explain how rainbows form today."]


def test_policy_writes_the_same_instructions_under_a_seed(tiny_llama):
    """End to end on the tiny random model: the general set's schema, new instructions only (none a seed, a held-out
    one or a near-duplicate of another), the same under the same seed and others under another seed."""
    from foresight.params import SelfInstructConfig
    from foresight.prompts import stable_id
    from foresight.self_instruct import SOURCE, normalise, overlap, self_instruct_prompts
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained

    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32"))
    seeds, held_out = pd.DataFrame({"question": SEEDS}), pd.DataFrame({"question": HELD_OUT})
    cfg = SelfInstructConfig(shots=2, batch_size=8, min_tokens=1, max_tokens=24)

    def write(seed: int) -> pd.DataFrame:
        return self_instruct_prompts(policy, seeds, held_out, 4, cfg.model_copy(update={"seed": seed}))

    first = write(0)
    assert len(first) == 4 and list(first.columns) == ["prompt_id", "question", "answer", "source", "category"]
    assert first["prompt_id"].tolist() == [stable_id(SOURCE, q) for q in first["question"]]
    assert (first["source"] == SOURCE).all() and (first["category"] == SOURCE).all() and first["answer"].isna().all()
    keys = [normalise(q) for q in first["question"]]
    others = [normalise(q) for q in SEEDS + HELD_OUT]
    assert all(overlap(a, b) < 0.7 for i, a in enumerate(keys) for b in others + keys[:i])
    pd.testing.assert_frame_equal(write(0), first)
    assert write(1)["question"].tolist() != first["question"].tolist()
    assert self_instruct_prompts(policy, seeds, held_out, 0, cfg).empty
    with pytest.raises(ValueError, match="shots"):
        self_instruct_prompts(policy, seeds, held_out, 2, cfg.model_copy(update={"shots": 4}))
