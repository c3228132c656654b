"""Token sequences the drafters fine-tune on (models/common/sequences.py): a response the policy ended gets its end
token, one cut at ``max_new_tokens`` does not (an end token after a cut is text the policy never emits)."""

from __future__ import annotations

import pandas as pd

from models.common.sequences import sft_sequences
from tests.tiny import build_tokenizer


def test_only_responses_the_policy_ended_get_the_end_token(tmp_path) -> None:
    tok = build_tokenizer(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Ben has 4 apples."}], tokenize=False,
                                     add_generation_prompt=True)
    responses = pd.DataFrame({"prompt": [prompt] * 3, "response": ["The answer is 4.", "Ben has 4 apples and", "x"],
                              "finish_reason": ["eos", "length", "stop"]})
    (ended, ended_mask), (cut, cut_mask), (stopped, _) = sft_sequences(tok, responses, max_length=128)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert ended[-1] == tok.eos_token_id and tok.decode(ended[prompt_len:]) == "The answer is 4." + tok.eos_token
    assert tok.eos_token_id not in cut[prompt_len:] and tok.decode(cut[prompt_len:]) == "Ben has 4 apples and"
    assert stopped[-1] == tok.eos_token_id  # vLLM's "stop" is the policy's own end too
    assert ended_mask == [0] * prompt_len + [1] * (len(ended) - prompt_len)
    assert cut_mask == [0] * prompt_len + [1] * (len(cut) - prompt_len)
    # without the column (responses from elsewhere) every response counts as ended
    (no_column, _), *_ = sft_sequences(tok, responses.drop(columns="finish_reason"), max_length=128)
    assert no_column == ended
