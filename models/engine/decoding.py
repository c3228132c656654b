"""The classical decoders the SLA paper compares against (§2.2, §5): greedy, temperature, top-p,
top-k sampling and beam search, all through Hugging Face ``generate`` with the paper's settings
(the defaults of :class:`ClassicalDecoding`).

Outputs are token lists cut after the first end token (kept, as HF greedy output keeps it), so every
decoder's output can be scored, compared and counted the same way as SLA's. The benchmark: docs/sla.md.

:func:`greedy_responses` is the policy's greedy response to each prompt, in the shape of the samples table: the
self-distillation data that Medusa's heads, RLMedusa, COrAL and the MTP module learn from (the ``distill`` stage).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from models.engine.config import ClassicalDecoding, HFDecoder
from models.engine.generation import chat_prompts, end_token_ids, generate_until_done, left_pad, response_lengths
from models.engine.policy import Policy

GREEDY = {"do_sample": False}
"""``generate`` arguments of greedy decoding."""


def generate_kwargs(decoder: HFDecoder, cfg: ClassicalDecoding) -> dict:
    """``generate`` arguments of one classical decoder. Unused knobs are set to their no-op values
    explicitly, because unset ones fall back to the model's generation_config (e.g. top_k = 50)."""
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    return {
        "greedy": GREEDY,
        "temperature": {"do_sample": True, **neutral, "temperature": cfg.temperature},
        "top_p": {"do_sample": True, **neutral, "top_p": cfg.top_p},
        "top_k": {"do_sample": True, **neutral, "top_k": cfg.top_k},
        "beam": {"do_sample": False, "num_beams": cfg.num_beams, "early_stopping": True},
    }[decoder]


@torch.no_grad()
def hf_decode(policy: Policy, prompt_ids: Sequence[Sequence[int]], kwargs: dict, max_new_tokens: int,
              eos_ids: set[int], batch_size: int, seed: int = 0, chunk_tokens: int = 8) -> list[list[int]]:
    """Decode each prompt (token ids) with ``generate(**kwargs)`` (e.g. :func:`generate_kwargs`); batches
    are left-padded.

    Batch ``b`` of a sampling decoder is seeded with ``seed + b``, so results are reproducible. Rows that have
    ended drop out every ``chunk_tokens`` new tokens (:func:`generate_until_done`); beam search, whose beams
    share one search, runs as one ``generate`` call.
    """
    tok, model = policy.tokenizer, policy.model
    outputs: list[list[int]] = []
    for b, start in enumerate(range(0, len(prompt_ids), batch_size)):
        input_ids, attention_mask = left_pad(prompt_ids[start : start + batch_size], tok.pad_token_id, policy.device)
        torch.manual_seed(seed + b)
        if kwargs.get("num_beams", 1) > 1:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=sorted(eos_ids), **kwargs)
            new = out[:, input_ids.shape[1]:]  # (B, T_new)
        else:
            new = generate_until_done(model, input_ids, attention_mask, kwargs, max_new_tokens, eos_ids,
                                      tok.pad_token_id, chunk_tokens)  # (B, max_new_tokens)
        lengths, _ = response_lengths(new, eos_ids)
        outputs += [new[row, :length].tolist() for row, length in enumerate(lengths)]
    return outputs


def greedy_responses(policy: Policy, prompts: pd.DataFrame, max_new_tokens: int, batch_size: int,
                     system_prompt: str | None = None) -> pd.DataFrame:
    """The policy's greedy response to each prompt (``prompt_id``, ``question``), batched, in the shape of the
    samples table that :func:`models.medusa.training.self_distill` reads (one sample per prompt)."""
    tok, eos = policy.tokenizer, end_token_ids(policy)
    texts = chat_prompts(tok, prompts["question"].tolist(), system_prompt)
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    outputs = []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc="greedy responses", unit="batch"):
        outputs += hf_decode(policy, prompt_ids[start : start + batch_size], GREEDY, max_new_tokens,
                             eos, batch_size=batch_size)
    return pd.DataFrame({
        "prompt_id": prompts["prompt_id"].tolist(), "sample_index": 0, "prompt": texts,
        "response": [tok.decode(o, skip_special_tokens=True) for o in outputs],
        "finish_reason": ["eos" if o and o[-1] in eos else "length" for o in outputs],
    })
