"""Batched sampling from a policy: N samples per prompt, reproducible with a seed.

Prompts are left-padded so every row of a batch ends at the same position and ``generate`` can
append to all of them at once; each prompt is repeated N times inside one batch (sharing nothing but the
padding). Batch ``b`` is seeded with ``seed + b`` so a batch's samples do not depend on how many batches ran
before it.

A row that has ended stops costing compute (:func:`generate_until_done`): ``generate`` runs ``chunk_tokens``
new tokens at a time, and only the rows without an end token go on, from their own KV cache. One long call
would run every row to the batch's longest response: at the defaults (96 rows, 64 new tokens) a third of the
row-steps were spent on finished rows. The generate stage: docs/pipeline.md.

Batches are cut in prompt order (:func:`batch_plan`): ``batch_size`` prompts, and with a token budget
(``generate.max_batch_tokens``) fewer where a long prompt would make the batch's KV cache, rows × (longest prompt +
``max_new_tokens``) after left-padding, exceed it. Otherwise one long prompt pads every row of its batch to its
length: SmolLM2-135M in bf16 (23 KB of KV cache per token), 96 rows and a 10,093-token prompt need ~22 GB where
100-token prompts need ~0.4 GB.

The policy's greedy response to each prompt, the self-distillation data: :func:`models.engine.decoding.greedy_responses`.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from models.engine.config import Sampling
from models.engine.kv_cache import cache_kwargs, returned_cache
from models.engine.policy import Policy


def chat_prompts(tokenizer, questions: Sequence[str], system_prompt: str | None = None) -> list[str]:
    """Apply the tokenizer's chat template to each question (a single user turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the policy's tokenizer has no chat template; use an instruction-tuned model")
    prefix = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        tokenizer.apply_chat_template(prefix + [{"role": "user", "content": q}], tokenize=False,
                                      add_generation_prompt=True)
        for q in questions
    ]


def encode_prompt(policy: Policy, prompt: str) -> torch.Tensor:
    """A templated prompt as token ids (1, L) on the policy's device (the template holds any special tokens)."""
    return policy.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(policy.device)


def end_token_ids(policy: Policy) -> set[int]:
    """Every token id that ends a response: the generation config's eos ids and the tokenizer's."""
    return generation_end_token_ids(policy.model.generation_config, policy.tokenizer)


def generation_end_token_ids(generation_config, tokenizer) -> set[int]:
    """:func:`end_token_ids` from a generation config and a tokenizer (a model folder read without its weights)."""
    configured = generation_config.eos_token_id
    ids = {configured} if isinstance(configured, int) else set(configured or [])
    ids.add(tokenizer.eos_token_id)
    return {i for i in ids if i is not None}


@dataclass
class Completion:
    """One sampled response."""

    prompt_index: int
    sample_index: int
    response: str
    prompt_tokens: int
    response_tokens: int
    finish_reason: str  # "eos" or "length"


def response_lengths(new_tokens: torch.Tensor, eos_ids: set[int]) -> tuple[list[int], list[str]]:
    """Tokens up to and including the first end token, per row; rows without one ran out of length."""
    is_end = torch.zeros_like(new_tokens, dtype=torch.bool)
    for eos in eos_ids:
        is_end |= new_tokens == eos
    has_end = is_end.any(dim=1)
    first_end = is_end.int().argmax(dim=1)
    lengths = torch.where(has_end, first_end + 1, torch.full_like(first_end, new_tokens.shape[1]))
    return lengths.tolist(), ["eos" if h else "length" for h in has_end.tolist()]


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded batch, every row ending at the same position: ``input_ids`` and
    ``attention_mask`` (0 on the padding), each (N, T)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


@torch.no_grad()
def generate_until_done(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, kwargs: dict,
                        max_new_tokens: int, eos_ids: set[int], pad_token_id: int,
                        chunk_tokens: int) -> torch.Tensor:
    """``model.generate(**kwargs)`` for every row (left-padded), ``chunk_tokens`` new tokens per call; after each
    call the rows that produced an end token drop out and the others continue from their KV cache.

    Decoding is Markov in the prefix (prompt + response so far), so a continued row draws from the same
    distribution as in one long call: greedy output is identical (float32), and sampled output is a fixed
    function of the seed (the random stream is spent on fewer rows). ``chunk_tokens >= max_new_tokens`` = one
    call, as is a single row. Returns the new tokens ``(rows, max_new_tokens)``, padded after each row's end.
    """
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    new = torch.full((input_ids.shape[0], max_new_tokens), pad_token_id, dtype=input_ids.dtype,
                     device=input_ids.device)
    ends = torch.tensor(sorted(eos_ids), device=input_ids.device)
    cache, done = None, 0
    while len(rows):
        remaining = max_new_tokens - done
        # A lone row needs no chunks: generate stops at its own end.
        step_tokens = remaining if len(rows) == 1 else min(chunk_tokens, remaining)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(model, cache),
                             max_new_tokens=step_tokens, pad_token_id=pad_token_id,
                             eos_token_id=sorted(eos_ids), return_dict_in_generate=True, **kwargs)
        step = out.sequences[:, input_ids.shape[1]:]
        new[rows, done : done + step.shape[1]] = step
        done += step.shape[1]
        if step_tokens == remaining:  # the last call: every row ran to max_new_tokens or to its end
            break
        going = (~torch.isin(step, ends).any(dim=1)).nonzero().squeeze(1)
        # The cache holds every token but the last one sampled, which the next call feeds first.
        cache = returned_cache(out)
        cache.batch_select_indices(going)
        input_ids, rows = out.sequences[going], rows[going]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], step.shape[1])],
                                   dim=1)[going]
    return new


class Sampler(Protocol):
    """An engine that samples ``Sampling.num_samples`` completions for each prompt of a batch: ``sampler(prompts,
    batch_index, first_index)`` → completions, prompt by prompt and sample by sample, ``prompt_index`` counted from
    ``first_index`` (the batch's first prompt among all). Its draws depend on the batch's prompts, its index and the
    seed only, never on the batches before it: a resumed job reproduces an uninterrupted one."""

    def __call__(self, prompts: Sequence[str], batch_index: int, first_index: int) -> list[Completion]: ...


class HFSampler:
    """Hugging Face ``generate`` on the loaded policy (the CPU default and the reference): batch ``b`` seeded with
    ``seed + b``, left-padded, each prompt repeated N times, finished rows dropping out (:func:`generate_until_done`)."""

    def __init__(self, policy: Policy, cfg: Sampling):
        self.policy, self.cfg = policy, cfg
        self.eos_ids = end_token_ids(policy)
        # explicit: None would fall back to generation_config's top_k (50)
        self.kwargs = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], batch_index: int, first_index: int) -> list[Completion]:
        tok, cfg = self.policy.tokenizer, self.cfg
        tok.padding_side = "left"
        enc = tok(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False).to(self.policy.device)
        torch.manual_seed(cfg.seed + batch_index)
        # row p·N + s = sample s of prompt p, as num_return_sequences would expand them
        new = generate_until_done(self.policy.model, enc["input_ids"].repeat_interleave(cfg.num_samples, dim=0),
                                  enc["attention_mask"].repeat_interleave(cfg.num_samples, dim=0), self.kwargs,
                                  cfg.max_new_tokens, self.eos_ids, tok.pad_token_id, cfg.chunk_tokens)
        lengths, reasons = response_lengths(new, self.eos_ids)
        prompt_lengths = enc["attention_mask"].sum(dim=1).tolist()
        return [Completion(prompt_index=first_index + row // cfg.num_samples, sample_index=row % cfg.num_samples,
                           response=tok.decode(new[row, :length], skip_special_tokens=True).strip(),
                           prompt_tokens=int(prompt_lengths[row // cfg.num_samples]), response_tokens=int(length),
                           finish_reason=reason)
                for row, (length, reason) in enumerate(zip(lengths, reasons, strict=True))]


def batch_tokens(prompt_tokens: Sequence[int], num_samples: int, max_new_tokens: int) -> int:
    """What a batch of prompts of these token lengths can fill: rows (prompts × ``num_samples``) × (the longest
    prompt + ``max_new_tokens``), every row left-padded to the longest prompt (the size of its KV cache)."""
    return len(prompt_tokens) * num_samples * (max(prompt_tokens) + max_new_tokens)


def batch_plan(prompt_tokens: Sequence[int], batch_size: int, num_samples: int, max_new_tokens: int,
               max_batch_tokens: int | None = None) -> list[range]:
    """The prompts' batches, consecutive ranges of prompt indices in prompt order: each at most ``batch_size``
    prompts and, with ``max_batch_tokens``, at most that many tokens (:func:`batch_tokens`); a prompt over the
    budget alone forms its own batch. Never sorted: the plan is a function of the token lengths and the knobs only,
    so a resumed run forms the same batches and a batch's index (its seed, its shard) means the same prompts."""
    batches, start = [], 0
    for end in range(1, len(prompt_tokens) + 1):
        full = end - start > batch_size or (
            max_batch_tokens is not None and end - start > 1
            and batch_tokens(prompt_tokens[start:end], num_samples, max_new_tokens) > max_batch_tokens)
        if full:  # the batch ends before prompt end - 1, which starts the next one
            batches.append(range(start, end - 1))
            start = end - 1
    if len(prompt_tokens):
        batches.append(range(start, len(prompt_tokens)))
    return batches


def sample_batches(sampler: Sampler, prompts: Sequence[str], batches: Sequence[range],
                   skip: Container[int] = ()) -> Iterator[tuple[int, list[Completion], float]]:
    """Each batch of ``batches`` (:func:`batch_plan`) but those in ``skip`` (batches already done), in order: its
    index, its completions and the seconds it took."""
    for b, batch in enumerate(batches):
        if b in skip:
            continue
        started = time.perf_counter()
        completions = sampler(prompts[batch.start : batch.stop], b, batch.start)
        yield b, completions, time.perf_counter() - started
