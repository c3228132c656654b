"""ArmoRM, loaded natively: the multi-objective reward model with a mixture-of-experts gate, no remote code.

ArmoRM (Wang et al. 2024, "Interpretable Preferences via Multi-Objective Reward Modeling and Mixture-of-Experts",
arXiv:2406.12845; checkpoint ``RLHFlow/ArmoRM-Llama3-8B-v0.1``) reads a conversation with a Llama-3 backbone and
scores it as

    rewards = W h_last                                   (B, K)  one regression per objective (K = 19)
    gate    = softmax(MLP(h_gate) / T) * logit_scale     (B, K)  from the prompt's last token
    score   = sum_k gate_k * (rewards @ M)_k             (B,)    M = reward_transform_matrix

where ``h_last`` is the final hidden state of the conversation's last token and ``h_gate`` that of the first token
of the last "end of user turn + assistant header" span. This module is the forward of the published
``modeling_custom.py`` (class ``LlamaForRewardModelWithGating``) with the checkpoint's own parameter names, so
transformers' loader reads the checkpoint (config.json + sharded safetensors) into it directly. It differs from the
published code in three ways, none of which changes a score that code computes correctly:

- no ``trust_remote_code``: that code imports ``LLAMA_INPUTS_DOCSTRING``, which transformers 5 removed;
- the reward is read at the last token of the attention mask (right padding), not before the first pad id:
  the published pooling lands mid-sequence when the pad id is also an end token that the chat template emits;
- the gating pattern comes from the tokenizer's chat template (:func:`gating_pattern`), not hard-coded Llama-3 ids.

The published code scores conversations untruncated; here one longer than ``label.max_length`` loses the tail of its
response and keeps its prompt (the gating pattern) and its end of turn (where the reward is read):
:mod:`models.labeling.conversations`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer, LlamaConfig, LlamaModel, LlamaPreTrainedModel, PreTrainedTokenizerBase

from models.labeling.conversations import ConversationError, conversation_ids

log = logging.getLogger(__name__)

_SENTINEL = "ARMORM-GATING-SENTINEL"  # a user message whose text is looked for in the rendered template


class ArmoRMError(RuntimeError):
    """An ArmoRM checkpoint, its tokenizer or a conversation does not fit; the message names which and why."""


class GatingNetwork(nn.Module):
    """The gate: ``n_hidden`` ReLU layers and a linear output, then ``softmax(x / temperature) * logit_scale``."""

    def __init__(self, in_features: int, out_features: int, temperature: float, hidden_dim: int, n_hidden: int):
        super().__init__()
        self.temperature = temperature
        self.logit_scale = nn.Parameter(torch.ones(1))
        widths = [in_features] + [hidden_dim] * n_hidden + [out_features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return F.softmax(self.layers[-1](x) / self.temperature, dim=1) * self.logit_scale[0]


@dataclass
class ArmoRMOutput:
    score: torch.Tensor  # (B,) the gated preference score
    rewards: torch.Tensor  # (B, K) the per-objective rewards, before the transform
    gating: torch.Tensor  # (B, K) the gate's weights (they sum to logit_scale)


class ArmoRM(LlamaPreTrainedModel):
    """``LlamaForRewardModelWithGating`` with the same parameter names; heads sized from the config's ArmoRM fields
    (with the published code's defaults)."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        objectives = getattr(config, "num_objectives", 19)
        self.model = LlamaModel(config)
        self.regression_layer = nn.Linear(config.hidden_size, objectives, bias=False)
        self.reward_transform_matrix = nn.Parameter(torch.eye(objectives), requires_grad=False)
        self.gating = GatingNetwork(config.hidden_size, objectives,
                                    temperature=getattr(config, "gating_temperature", 10),
                                    hidden_dim=getattr(config, "gating_hidden_dim", 1024),
                                    n_hidden=getattr(config, "gating_n_hidden", 3))
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                gating_positions: torch.Tensor) -> ArmoRMOutput:
        """Right-padded ``input_ids`` / ``attention_mask`` (B, T) and each row's gating token (B,)."""
        if not torch.equal(attention_mask.cummin(dim=-1).values, attention_mask):
            raise ArmoRMError("ArmoRM reads the last token of each row: the attention mask must be right-padded")
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = attention_mask.sum(dim=-1) - 1  # right padding: the last real token
        rewards = self.regression_layer(hidden[rows, last])  # (B, K)
        gating = self.gating(hidden[rows, gating_positions])  # (B, K)
        score = (gating * (rewards @ self.reward_transform_matrix)).sum(dim=1)  # (B,)
        return ArmoRMOutput(score=score, rewards=rewards, gating=gating)


def _require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ArmoRMError(f"the ArmoRM tokenizer {tokenizer.name_or_path!r} has no chat template: ArmoRM reads "
                          "conversations in its chat template and gates on the template's assistant header")


def gating_pattern(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids that end a user turn and open the assistant's (Llama-3:
    ``<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n``): what the template renders after a user
    message when asked for a generation prompt. ArmoRM gates on the first of them."""
    _require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    _, found, tail = text.rpartition(_SENTINEL)
    if not found or not tail:
        raise ArmoRMError(f"the chat template of {tokenizer.name_or_path!r} renders no assistant header after a user "
                          f"message (rendered: {text!r}): ArmoRM cannot find where the prompt ends")
    return tokenizer.encode(tail, add_special_tokens=False)


def gating_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, pattern: Sequence[int]) -> torch.Tensor:
    """Per row, the first token of the LAST occurrence of ``pattern`` inside the row's real tokens: (B,) long."""
    size = len(pattern)
    if input_ids.shape[1] >= size:
        windows = input_ids.unfold(1, size, 1)  # (B, T - size + 1, size)
        real = attention_mask.unfold(1, size, 1).bool().all(dim=-1)  # (B, T - size + 1)
        found = (windows == torch.tensor(pattern, device=input_ids.device)).all(dim=-1) & real
    else:
        found = torch.zeros(input_ids.shape[0], 0, dtype=torch.bool, device=input_ids.device)
    missing = (~found.any(dim=-1)).nonzero().flatten().tolist()
    if missing:
        raise ArmoRMError(f"rows {missing} hold no end-of-prompt pattern {list(pattern)} (user turn end + assistant "
                          "header), which ArmoRM gates on")
    return found.shape[1] - 1 - found.flip(dims=[-1]).int().argmax(dim=-1)


def encode_conversations(tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], responses: Sequence[str],
                         max_length: int, pattern: Sequence[int]) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """(user, assistant) conversations in the tokenizer's chat template, at most ``max_length`` tokens each (a
    longer one loses the tail of its response, never its prompt nor its end of turn:
    :func:`models.labeling.conversations.conversation_ids`), right-padded: the model's inputs ``input_ids``,
    ``attention_mask`` (B, T) and ``gating_positions`` (B,), and per row whether its response was cut."""
    _require_chat_template(tokenizer)
    try:
        rows, truncated = conversation_ids(tokenizer, questions, responses, max_length)
    except ConversationError as err:
        raise ArmoRMError(str(err)) from err
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ArmoRMError(f"the tokenizer {tokenizer.name_or_path!r} has neither a pad nor an end token to pad with")
    input_ids = torch.full((len(rows), max(map(len, rows), default=0)), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "gating_positions": gating_positions(input_ids, attention_mask, pattern)}, truncated


def load_armorm(path: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> tuple[ArmoRM, PreTrainedTokenizerBase]:
    """ArmoRM (eval mode, frozen) and its tokenizer from a folder or a hub id in the local cache."""
    folder = Path(path).expanduser()
    if not folder.is_dir() and (folder.is_absolute() or str(path).startswith((".", "~"))):
        raise ArmoRMError(f"ArmoRM checkpoint {str(path)!r}: no such folder")
    source = str(folder) if folder.is_dir() else str(path)  # else a hub id
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = LlamaConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        hint = "" if folder.is_dir() else (" It is no folder here, so it was looked up as a hub id: offline, that "
                                           "needs the model in the Hugging Face cache (or point label.model at a "
                                           "local folder).")
        raise ArmoRMError(f"ArmoRM checkpoint {source!r} could not be read: {str(err).rstrip('.')}.{hint}") from err
    _require_chat_template(tokenizer)
    if config.model_type != "llama":
        raise ArmoRMError(f"{source!r} has a {config.model_type!r} backbone; native ArmoRM loading knows Llama only")
    # mismatched shapes come back in the loading info (instead of an exception that names none) and are refused below
    model, info = ArmoRM.from_pretrained(source, config=config, dtype=dtype, device_map=torch.device(device),
                                         ignore_mismatched_sizes=True, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise ArmoRMError(
            f"{source!r} is not an ArmoRM-layout checkpoint (LlamaForRewardModelWithGating): missing "
            f"{sorted(info['missing_keys'])}, unexpected {sorted(info['unexpected_keys'])}. For an ordinary "
            "sequence-classification reward model use label.labeler: hf-classifier")
    if info["mismatched_keys"]:
        shapes = "; ".join(f"{key} is {list(found)} in the checkpoint, {list(expected)} by the config"
                           for key, found, expected in sorted(info["mismatched_keys"]))
        raise ArmoRMError(f"{source!r}: tensor shapes disagree with its config.json (num_objectives, gating_*): "
                          f"{shapes}")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id >= model.get_input_embeddings().num_embeddings:
        # Llama-3 ships no pad token (or one may be added to the tokenizer but not the embedding); right padding is
        # never attended to and the reward is read from the attention mask, so the end token pads correctly
        log.info("ArmoRM %s: pad token %r is not in the embedding; padding with the end token %r", source,
                 tokenizer.pad_token, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval().requires_grad_(False), tokenizer
