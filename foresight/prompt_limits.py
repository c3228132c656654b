"""How long a prompt may be: the policy's context, the prompt limit (``prompts.max_prompt_tokens``) and the prompts
over it, counted in tokens of the policy's chat template exactly as generation tokenises them.

Apart from :mod:`foresight.prompts` (the prompt sources): every stage that generates checks its prompts against
the limit, and this module is a code dep of each; the sources are prepare_prompts' and distill's alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
from transformers import AutoConfig

from models.engine.generation import chat_prompts


class PromptSourceError(ValueError):
    """A prompt source is missing, empty or lacks the configured columns, or its prompts do not fit the limit."""


def prompt_token_counts(tokenizer, questions: Sequence[str], system_prompt: str | None,
                        batch_size: int = 1024) -> list[int]:
    """Tokens of each question's prompt exactly as the generate stage gives it to the policy: the chat template of
    :func:`models.engine.generation.chat_prompts` (system prompt included), tokenised without added special tokens
    (the template holds them), as the samplers do; in batches (a fast tokenizer encodes a batch in parallel)."""
    counts: list[int] = []
    for start in range(0, len(questions), batch_size):
        texts = chat_prompts(tokenizer, list(questions[start : start + batch_size]), system_prompt)
        counts += [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return counts


def policy_context_length(folder: Path, trust_remote_code: bool = False) -> int:
    """The policy's context in tokens: ``max_position_embeddings`` of its config.json (read without the weights)."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 1:
        raise PromptSourceError(f"the policy's config.json in {folder} gives no max_position_embeddings (its "
                                "context length): set prompts.max_prompt_tokens in params.yaml")
    return context


def resolve_max_prompt_tokens(configured: int | None, context: int, max_new_tokens: int,
                              reward_model_length: int | None) -> int:
    """The longest prompt kept: ``configured`` (``prompts.max_prompt_tokens``), or automatically the policy's
    ``context`` minus ``max_new_tokens`` and, when a reward model labels the samples, at most its
    ``reward_model_length`` (``label.max_length``) minus ``max_new_tokens``: it then sees every response whole.
    A configured value the policy cannot generate from (over ``context - max_new_tokens``) is an error."""
    room = context - max_new_tokens
    if room < 1:
        raise PromptSourceError(f"generate.max_new_tokens = {max_new_tokens} leaves no room for a prompt in the "
                                f"policy's context of {context} tokens")
    if configured is not None:
        if configured > room:
            raise PromptSourceError(
                f"prompts.max_prompt_tokens = {configured} exceeds the policy's context ({context} tokens) minus "
                f"generate.max_new_tokens ({max_new_tokens}) = {room}: a longer prompt would overflow the context "
                "during generation; lower it (or null: automatic)")
        return configured
    if reward_model_length is None:
        return room
    if reward_model_length - max_new_tokens < 1:
        raise PromptSourceError(f"label.max_length = {reward_model_length} leaves no room for a prompt beside "
                                f"generate.max_new_tokens = {max_new_tokens}: raise it, or set "
                                "prompts.max_prompt_tokens")
    return min(room, reward_model_length - max_new_tokens)


def drop_long_prompts(splits: Mapping[str, pd.DataFrame], tokenizer, system_prompt: str | None,
                      limit: int) -> tuple[dict[str, pd.DataFrame], dict[str, list[int]]]:
    """Each split without its prompts over ``limit`` tokens (:func:`prompt_token_counts`), and each split's token
    counts (all rows, in its order). A split that had prompts and keeps none is an error naming
    ``prompts.max_prompt_tokens``."""
    kept, counts = {}, {}
    for name, table in splits.items():
        counts[name] = prompt_token_counts(tokenizer, table["question"].tolist(), system_prompt)
        fits = pd.Series(counts[name], index=table.index) <= limit
        kept[name] = table[fits].reset_index(drop=True)
        if len(table) and kept[name].empty:
            raise PromptSourceError(
                f"every one of the {len(table)} {name} prompts is longer than prompts.max_prompt_tokens = {limit} "
                f"tokens in the policy's chat template (the shortest has {min(counts[name])}): raise "
                "prompts.max_prompt_tokens (at most the policy's context minus generate.max_new_tokens) or use "
                "shorter prompts")
    return kept, counts
