"""Tiny random models built locally for tests: nothing is downloaded.

- a byte-level BPE tokenizer trained in a second on arithmetic-like text, with ChatML special tokens
  and a chat template (like SmolLM2's), wrapped as a Hugging Face fast tokenizer;
- a 2-layer random Llama causal LM on top of it;
- sequence-classification reward models: an ordinary ``LlamaForSequenceClassification`` and an
  ArmoRM-like model that ships its own code (``trust_remote_code``) and returns ``output.score``.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "Ben has 4 apples. Ava gives Ben 2 more apples. How many apples does Ben have now?",
    "The answer is 6. Ivy has 3 cookies and gives 1 of them to Omar. How many are left?",
    "0 1 2 3 4 5 6 7 8 9 10 + - * = user assistant system marbles bags stickers total",
]


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(_CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def _llama_config(tok, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **extra)


def build_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama causal LM with the tiny tokenizer, saved as a HF folder."""
    from transformers import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    LlamaForCausalLM(_llama_config(tok)).save_pretrained(folder)
    return folder


def load_spiky_tiny_llama(folder: Path, **kwargs):
    """The tiny Llama in eval mode with its matrices re-drawn at std 0.4 (seeded): at the default init a
    2-layer random model repeats one token forever, which would make decoding tests test nothing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():
            if w.dim() >= 2:
                w.copy_(torch.randn(w.shape, generator=gen) * 0.4)
    return model


def build_tiny_classifier(folder: Path, seed: int = 0) -> Path:
    """An ordinary sequence-classification reward model (reward = first logit)."""
    from transformers import LlamaForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(_llama_config(tok, num_labels=1)).save_pretrained(folder)
    return folder


# ArmoRM ships modeling code with its checkpoint and is loaded with trust_remote_code=True; its forward
# returns a ModelOutput whose `score` is the preference score. This mimics exactly that contract.
_REMOTE_CODE = '''
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
from transformers.utils import ModelOutput


class TinyArmoConfig(LlamaConfig):
    model_type = "tiny_armo"


@dataclass
class ArmoOutput(ModelOutput):
    score: Optional[torch.FloatTensor] = None
    rewards: Optional[torch.FloatTensor] = None


class TinyArmoRM(LlamaPreTrainedModel):
    config_class = TinyArmoConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.regression_layer = torch.nn.Linear(config.hidden_size, 3, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # like ArmoRM: pool the last non-pad token (right padding)
        last = attention_mask.sum(dim=1) - 1 if attention_mask is not None else torch.full(
            (input_ids.shape[0],), input_ids.shape[1] - 1)
        pooled = hidden[torch.arange(hidden.shape[0]), last]
        rewards = self.regression_layer(pooled)
        return ArmoOutput(score=rewards.mean(dim=-1, keepdim=True), rewards=rewards)
'''


def build_tiny_armorm(folder: Path, seed: int = 0) -> Path:
    """A model folder with its own code (``auto_map``), returning ``output.score`` like ArmoRM."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    (folder / "modeling_tiny_armo.py").write_text(_REMOTE_CODE)
    config = _llama_config(tok).to_dict()
    config.update(model_type="tiny_armo", architectures=["TinyArmoRM"],
                  auto_map={"AutoConfig": "modeling_tiny_armo.TinyArmoConfig",
                            "AutoModelForSequenceClassification": "modeling_tiny_armo.TinyArmoRM"})
    (folder / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True)
    model.save_pretrained(folder)
    return folder
