"""Token sequences shared by every method: a prompt + response as ids with its response mask, and right padding.

A sequence is the chat-templated prompt followed by the response (and the end token); the two parts are
tokenized separately, as the policy produced them, so no BPE merge crosses the boundary. Both are tokenized without
the tokenizer's own special tokens, exactly as the generate stage tokenized the prompt it decoded from
(models/engine/generation.py): the chat template already writes any BOS (Llama-3's ``<|begin_of_text|>``), so
adding the tokenizer's would train on two.

Length rule, the same for every method: a row whose whole sequence (prompt + response + end token) is longer than
the stage's ``max_length`` is dropped, never truncated, and the stage counts it (``*_dropped_too_long`` in its
metrics). Cutting the prompt would train on a context the policy never saw (its template header or the question's
start gone), cutting the response would train a reward or DPO comparison on unequal, end-less halves (the longer
response loses its end token and its conclusion: a biased comparison) and leave a drafter a few response tokens
behind a long prompt. Size ``max_length`` to the data: the longest templated prompt + ``max_new_tokens`` + 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch


def tokenize_sequence(tokenizer, prompt: str, response: str, add_end: bool = True) -> tuple[list[int], list[int]]:
    """Prompt + response (+ end token) as ids, whole, and the mask of the response tokens (end token included).

    The two parts are tokenized separately, as the policy produced them (prompt ids, then sampled ids), so
    no BPE merge crosses the boundary; without the tokenizer's special tokens (the template holds them).
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * add_end
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def fits(sequence: tuple[list[int], list[int]], max_length: int | None) -> bool:
    """Whether a whole sequence is at most ``max_length`` tokens (``None``: no limit)."""
    return max_length is None or len(sequence[0]) <= max_length


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


def sft_sequences(tokenizer, responses: pd.DataFrame) -> Sequences:
    """Prompt + response of each row (``prompt`` is already templated), whole, with the end token only where the
    policy ended the response itself: a response cut at ``max_new_tokens`` (``finish_reason`` ``length``) keeps its
    cut end, since an end token after the cut is text the policy never emits — learning it teaches a drafter to end
    mid-sentence. Without a ``finish_reason`` column every response counts as ended."""
    finished = (responses["finish_reason"] != "length" if "finish_reason" in responses
                else pd.Series(True, index=responses.index))
    return [tokenize_sequence(tokenizer, prompt, response, add_end=bool(ended))
            for prompt, response, ended in zip(responses["prompt"], responses["response"], finished, strict=True)]


def fitting_sft(tokenizer, responses: pd.DataFrame, max_length: int, key: str) -> tuple[pd.DataFrame, Sequences, int]:
    """The rows of ``responses`` whose whole sequence (:func:`sft_sequences`) fits ``max_length`` (index reset, so
    row positions index the sequences), their sequences, and how many rows were dropped (the module's length rule);
    an error naming the setting ``key`` when none fits."""
    sequences = sft_sequences(tokenizer, responses)
    keep = [fits(sequence, max_length) for sequence in sequences]
    if sequences and not any(keep):
        raise ValueError(f"none of {len(keep)} responses fits {key} {max_length} tokens whole (the shortest prompt + "
                         f"response + end token is {min(len(ids) for ids, _ in sequences)}): raise {key}")
    kept = responses[keep].reset_index(drop=True)
    return kept, [sequence for sequence, k in zip(sequences, keep, strict=True) if k], len(keep) - sum(keep)
