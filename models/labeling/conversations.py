"""(question, response) conversations as a reward model reads them: the model's chat template, at most
``max_length`` tokens, cut in the response, never in the prompt.

A reward model that is too short for a conversation must not lose the prompt's end or the end of the assistant
turn. ArmoRM (RLHFlow ``modeling_custom.py``, ``LlamaForRewardModelWithGating.forward``) gates on the first token of
the last ``<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n`` — the end of the prompt — and raises
when that pattern is absent; and it, like a sequence classifier, reads its reward at the last token, which in every
conversation it was trained on (``tokenizer.apply_chat_template(messages)``, untruncated, on the model card) is
the template's end of the assistant turn (Llama-3: ``<|eot_id|>``). Cutting the rendered conversation's tail, as
``tokenizer(..., truncation=True)`` does, removes first that end token and, for a prompt longer than
``max_length``, the gating pattern. So a conversation that does not fit keeps its templated prompt and its end of
turn whole and loses the tail of the response in between; a prompt that leaves no room for a response is an error
that names the knob which drops such prompts (``prompts.max_prompt_tokens``, stage ``prepare_prompts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_RESPONSE_SENTINEL = "REWARD-MODEL-RESPONSE-SENTINEL"  # an assistant message looked for in the rendered template


class ConversationError(ValueError):
    """A conversation cannot be given to the reward model; the message names the prompt and the knob to turn."""


def _messages(question: str, response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": response}]


def response_end(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the chat template renders after an assistant message's text (Llama-3: ``<|eot_id|>``; ChatML:
    ``<|im_end|>\\n``): the end of turn a truncated conversation keeps."""
    text = tokenizer.apply_chat_template(_messages("?", _RESPONSE_SENTINEL), tokenize=False)
    _, found, tail = text.rpartition(_RESPONSE_SENTINEL)
    if not found:
        raise ConversationError(f"the chat template of {tokenizer.name_or_path!r} does not render an assistant "
                                f"message's text (rendered: {text!r})")
    return tail


def conversation_ids(tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], responses: Sequence[str],
                     max_length: int) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each (user, assistant) conversation in the tokenizer's chat template, at most ``max_length``,
    and whether its response was cut.

    A conversation that fits is the rendered text tokenised whole (what the model card scores). One that does not
    is ``prompt + response[:budget] + end``: the templated prompt with its generation prompt (the assistant header
    ArmoRM gates on), the response's first ``budget`` tokens and the template's end of turn
    (:func:`response_end`), ``budget = max_length - len(prompt) - len(end)``.
    """
    if len(questions) != len(responses):
        raise ConversationError(f"{len(questions)} questions but {len(responses)} responses")
    texts = [tokenizer.apply_chat_template(_messages(q, r), tokenize=False) for q, r in zip(questions, responses)]
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    truncated = [False] * len(rows)
    long_rows = [i for i, row in enumerate(rows) if len(row) > max_length]
    if not long_rows:
        return rows, truncated
    end = response_end(tokenizer)
    end_ids = tokenizer.encode(end, add_special_tokens=False)
    for i in long_rows:
        prompt = tokenizer.apply_chat_template(_messages(questions[i], responses[i])[:1], tokenize=False,
                                               add_generation_prompt=True)
        text = texts[i]
        if not (text.startswith(prompt) and text.endswith(end)):
            raise ConversationError(
                f"the chat template of {tokenizer.name_or_path!r} does not render a conversation as its prompt "
                f"(with the generation prompt), the response and the end of turn {end!r}, so a conversation over "
                f"label.max_length = {max_length} tokens cannot be cut in its response; raise label.max_length")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        budget = max_length - len(prompt_ids) - len(end_ids)
        if budget < 1:
            raise ConversationError(
                f"a prompt of {len(prompt_ids)} tokens in the reward model's chat template ({questions[i][:80]!r}"
                f"{'...' if len(questions[i]) > 80 else ''}) leaves no room for its response within label.max_length "
                f"= {max_length}: set prompts.max_prompt_tokens (stage prepare_prompts drops longer prompts; "
                "automatic with a reward model: label.max_length - generate.max_new_tokens) or raise label.max_length")
        response_ids = tokenizer.encode(text[len(prompt) : len(text) - len(end)], add_special_tokens=False)
        rows[i] = prompt_ids + response_ids[:budget] + end_ids
        truncated[i] = len(response_ids) > budget
    return rows, truncated
