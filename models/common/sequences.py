"""Token sequences shared by every method: a prompt + response as ids with its response mask, and right padding.

A sequence is the chat-templated prompt followed by the response (and the end token); the two parts are
tokenized separately, as the policy produced them, so no BPE merge crosses the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch


def tokenize_sequence(tokenizer, prompt: str, response: str, max_length: int, add_end: bool = True
                      ) -> tuple[list[int], list[int]]:
    """Prompt + response (+ end token) as ids, and the mask of the response tokens (end token included).

    The two parts are tokenized separately, as the policy produced them (prompt ids, then sampled ids), so
    no BPE merge crosses the boundary. Too long: the response loses its end first; a prompt that leaves no
    room keeps only its last ``max_length − 1`` tokens, so every sequence scores at least one response token.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-(max_length - 1):]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * add_end
    response_ids = response_ids[: max_length - len(prompt_ids)]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def padding_id(tokenizer) -> int:
    """The token id right padding uses: the tokenizer's pad token, else its end token (padding is masked)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def right_pad(sequences: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """(ids, response mask) sequences as one right-padded batch: ``input_ids``, ``attention_mask`` and
    ``response_mask``, each (N, T). Padding has attention 0 and response mask 0."""
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros_like(input_ids)  # (N, T)
    response_mask = torch.zeros_like(input_ids)  # (N, T)
    for row, (ids, mask) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        response_mask[row, : len(ids)] = torch.tensor(mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}


Sequences = list[tuple[list[int], list[int]]]
"""(ids, response mask) per sequence, as :func:`tokenize_sequence` returns them."""


def sft_sequences(tokenizer, responses: pd.DataFrame, max_length: int) -> Sequences:
    """Prompt + response of each row (``prompt`` is already templated), with the end token only where the policy
    ended the response itself: a response cut at ``max_new_tokens`` (``finish_reason`` ``length``) keeps its cut
    end, since an end token after the cut is text the policy never emits — learning it teaches a drafter to end
    mid-sentence. Without a ``finish_reason`` column every response counts as ended."""
    finished = (responses["finish_reason"] != "length" if "finish_reason" in responses
                else pd.Series(True, index=responses.index))
    return [tokenize_sequence(tokenizer, prompt, response, max_length, add_end=bool(ended))
            for prompt, response, ended in zip(responses["prompt"], responses["response"], finished, strict=True)]
