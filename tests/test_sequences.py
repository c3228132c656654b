"""Token sequences the drafters fine-tune on (models/common/sequences.py): a response the policy ended gets its end
token, one cut at ``max_new_tokens`` does not (an end token after a cut is text the policy never emits); a sequence
longer than ``max_length`` is dropped whole and counted, never truncated."""

from __future__ import annotations

import pandas as pd
import pytest

from models.common.sequences import sft_sequences
from tests.tiny import build_tokenizer


def test_only_responses_the_policy_ended_get_the_end_token(tmp_path) -> None:
    tok = build_tokenizer(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Ben has 4 apples."}], tokenize=False,
                                     add_generation_prompt=True)
    responses = pd.DataFrame({"prompt": [prompt] * 3, "response": ["The answer is 4.", "Ben has 4 apples and", "x"],
                              "finish_reason": ["eos", "length", "stop"]})
    (ended, ended_mask), (cut, cut_mask), (stopped, _) = sft_sequences(tok, responses)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert ended[-1] == tok.eos_token_id and tok.decode(ended[prompt_len:]) == "The answer is 4." + tok.eos_token
    assert tok.eos_token_id not in cut[prompt_len:] and tok.decode(cut[prompt_len:]) == "Ben has 4 apples and"
    assert stopped[-1] == tok.eos_token_id  # vLLM's "stop" is the policy's own end too
    assert ended_mask == [0] * prompt_len + [1] * (len(ended) - prompt_len)
    assert cut_mask == [0] * prompt_len + [1] * (len(cut) - prompt_len)
    # without the column (responses from elsewhere) every response counts as ended
    (no_column, _), *_ = sft_sequences(tok, responses.drop(columns="finish_reason"))
    assert no_column == ended


def _prompt_of(tok, tokens: int) -> str:
    """A chat-templated prompt of exactly ``tokens`` tokens."""
    def templated(question: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)

    base = len(tok(templated("Ben has"), add_special_tokens=False)["input_ids"])
    prompt = templated("Ben has" + " apples" * (tokens - base))
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == tokens
    return prompt


def test_a_row_longer_than_max_length_is_dropped_and_counted_not_cut_to_one_response_token(tmp_path) -> None:
    """A 255-token prompt at COrAL's / the MTP module's max_length 256: the old rule kept the prompt and one response
    token; the row is dropped and counted, and a row that fits stays whole, end token included."""
    from models.common.sequences import fitting_sft

    tok = build_tokenizer(tmp_path)
    short = tok.apply_chat_template([{"role": "user", "content": "Ben has 4 apples."}], tokenize=False,
                                    add_generation_prompt=True)
    responses = pd.DataFrame({"prompt_id": ["long", "short"], "prompt": [_prompt_of(tok, 255), short],
                              "response": ["The answer is 4."] * 2, "finish_reason": ["eos"] * 2})
    kept, sequences, dropped = fitting_sft(tok, responses, 256, "coral.max_length")
    assert dropped == 1 and kept["prompt_id"].tolist() == ["short"] and kept.index.tolist() == [0]
    ((ids, mask),) = sequences
    assert ids[-1] == tok.eos_token_id and sum(mask) == len(tok("The answer is 4.")["input_ids"]) + 1
    assert (sequences, 0) == fitting_sft(tok, responses.iloc[1:], 256, "coral.max_length")[1:]
    with pytest.raises(ValueError, match=r"none of 1 responses fits coral.max_length 256 tokens"):
        fitting_sft(tok, responses.iloc[:1], 256, "coral.max_length")
