"""Tiny random models built locally for tests: nothing is downloaded.

- byte-level BPE tokenizers trained in a second on arithmetic-like text: one with ChatML special tokens and a
  chat template (like SmolLM2's), one with Llama-3's special tokens, pre-tokenizer regex and chat template;
- a 2-layer random Llama causal LM on the ChatML tokenizer, and its weights made spiky for decoding tests;
- tiny random Mistral / Qwen2 models with a sliding window shorter than their inputs;
- a 2-layer random Llama over a Llama-3-style tokenizer that adds its BOS itself, as its chat template does too;
- reward models: an ordinary ``LlamaForSequenceClassification``; an ArmoRM-layout checkpoint
  (``LlamaForRewardModelWithGating``'s key names, config and sharded safetensors, on the Llama-3 tokenizer) written
  by hand, without the modeling code it names; and a classifier that ships its own code (``trust_remote_code``).
"""

from __future__ import annotations

import json
from itertools import pairwise
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

# Meta-Llama-3-8B-Instruct's chat template (the one ArmoRM's tokenizer ships), its special tokens, and the
# pre-tokenizer regex of its tokenizer.json (which keeps "\n\n" one pre-token, so the BPE can merge it, as
# Llama-3's id 271 is).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|finetune_right_pad_id|>"]
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_CORPUS = [f"user\n\n{_CORPUS[0]}\n\nassistant\n\n{_CORPUS[1]}\n\n", *_CORPUS]


def _train_bpe(special: list[str], corpus: list[str], pre_tokenizer=None):
    """A byte-level BPE (320 tokens) trained on ``corpus``; GPT-2's byte-level pre-tokenizer unless one is given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus * 20, trainer)
    return raw


def build_tokenizer(folder: Path):
    """The ChatML tokenizer (pad = eos = ``<|im_end|>``), saved in ``folder``."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(SPECIAL, _CORPUS), bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def build_llama3_tokenizer(folder: Path):
    """A Llama-3-style tokenizer (eos = ``<|eot_id|>``, a distinct pad token), saved in ``folder``."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(LLAMA3_SPECIAL, _LLAMA3_CORPUS, pre),
                                  bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  pad_token="<|finetune_right_pad_id|>")
    tok.chat_template = LLAMA3_CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def _llama_config(tok, **extra):
    from transformers import LlamaConfig

    base = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=True)
    return LlamaConfig(**{**base, **extra})


def build_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama causal LM with the tiny tokenizer, saved as a HF folder."""
    from transformers import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    LlamaForCausalLM(_llama_config(tok)).save_pretrained(folder)
    return folder


def spiky(model):
    """``model`` in eval mode with its matrices re-drawn at std 0.4 (seeded): at the default init a 2-layer random
    model repeats one token forever, which would make decoding tests test nothing."""
    model.eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():
            if w.dim() >= 2:
                w.copy_(torch.randn(w.shape, generator=gen) * 0.4)
    return model


def load_spiky_tiny_llama(folder: Path, **kwargs):
    """The tiny Llama, :func:`spiky`."""
    from transformers import AutoModelForCausalLM

    return spiky(AutoModelForCausalLM.from_pretrained(folder, **kwargs))


# the sliding window of :func:`sliding_model`: far shorter than prompt + output
SLIDING_WINDOW = 6


def sliding_model(kind: str, attn_implementation: str = "sdpa"):
    """A tiny random :func:`spiky` model whose sliding window (:data:`SLIDING_WINDOW`) is far shorter than prompt +
    output: ``mistral`` slides in every layer (Mistral), ``mixed`` in the first of its two (Qwen2 / Gemma style)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, sliding_window=SLIDING_WINDOW,
                  attn_implementation=attn_implementation)
    torch.manual_seed(0)
    if kind == "mistral":
        return spiky(MistralForCausalLM(MistralConfig(**common)))
    return spiky(Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=2,
                                              layer_types=["sliding_attention", "full_attention"], **common)))


def build_bos_llama3(folder: Path) -> Path:
    """A random 2-layer Llama over a Llama-3-style tokenizer that, like Meta-Llama-3's own tokenizer.json (its
    post-processor: ByteLevel, then TemplateProcessing), puts ``<|begin_of_text|>`` before every text it tokenizes with
    special tokens, while its chat template writes that BOS too: the pair that gives a second BOS to whatever tokenizes
    templated text with special tokens on. SmolLM2's tokenizer adds none, so the default run never shows it."""
    from tokenizers import processors
    from transformers import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_llama3_tokenizer(folder)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.bos_token_id)])])
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(tok)).save_pretrained(folder)
    return folder


def build_tiny_classifier(folder: Path, seed: int = 0) -> Path:
    """An ordinary sequence-classification reward model (reward = first logit)."""
    from transformers import LlamaForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(_llama_config(tok, num_labels=1)).save_pretrained(folder)
    return folder


# The tiny ArmoRM's head sizes; the temperature, logit scale and transform are deliberately not their
# identity values (1, 1, I), so a forward that dropped any of them would not match the reference.
ARMORM_OBJECTIVES = 5
ARMORM_GATING = {"gating_temperature": 2.5, "gating_hidden_dim": 16, "gating_n_hidden": 3}
ARMORM_LOGIT_SCALE = 1.7


def build_tiny_armorm(folder: Path, seed: int = 0) -> Path:
    """A random ArmoRM-layout checkpoint (``LlamaForRewardModelWithGating``), written tensor by tensor.

    Like RLHFlow/ArmoRM-Llama3-8B-v0.1 on the hub: a Llama-3 tokenizer with its chat template; a config.json with
    model_type ``llama``, the ``gating_*`` / ``num_objectives`` fields, the 4.x rope fields (``rope_theta``) and an
    ``auto_map`` to ``modeling_custom.py``, which is NOT written (native loading must never need it); the weights in
    two safetensors shards with ``model.safetensors.index.json``. Every matrix is drawn at std 0.3 and the norms
    around 1 (not the init's 0.02 and exact ones), so attention, rotary positions and each norm visibly matter.
    """
    from safetensors.torch import save_file
    from transformers import LlamaModel

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_llama3_tokenizer(folder)
    config = _llama_config(tok, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, std: float = 0.3, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    backbone = {f"model.{name}": draw(*t.shape, std=0.1, mean=1.0) if name.endswith("norm.weight") else draw(*t.shape)
                for name, t in LlamaModel(config).state_dict().items()}
    widths = [config.hidden_size, *[ARMORM_GATING["gating_hidden_dim"]] * ARMORM_GATING["gating_n_hidden"],
              ARMORM_OBJECTIVES]
    gating = {}
    for i, (fan_in, fan_out) in enumerate(pairwise(widths)):
        gating[f"gating.layers.{i}.weight"] = draw(fan_out, fan_in, std=fan_in ** -0.5)
        gating[f"gating.layers.{i}.bias"] = draw(fan_out, std=0.1)
    heads = {"regression_layer.weight": draw(ARMORM_OBJECTIVES, config.hidden_size),
             "gating.logit_scale": torch.tensor([ARMORM_LOGIT_SCALE]),
             "reward_transform_matrix": torch.eye(ARMORM_OBJECTIVES) + draw(ARMORM_OBJECTIVES, ARMORM_OBJECTIVES),
             **gating}
    # half the backbone in each shard and the heads in the second: a loader that read one shard would miss keys
    shards = {"model-00001-of-00002.safetensors": dict(list(backbone.items())[: len(backbone) // 2]),
              "model-00002-of-00002.safetensors": {**dict(list(backbone.items())[len(backbone) // 2:]), **heads}}
    for name, tensors in shards.items():
        save_file(tensors, folder / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards.values() for t in s.values())},
             "weight_map": {key: name for name, tensors in shards.items() for key in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    layout = {k: v for k, v in config.to_dict().items() if k not in ("rope_parameters", "dtype")}
    layout.update(architectures=["LlamaForRewardModelWithGating"], rope_theta=5e5, rope_scaling=None,
                  auto_map={"AutoModelForSequenceClassification": "modeling_custom.LlamaForRewardModelWithGating"},
                  torch_dtype="float32", num_objectives=ARMORM_OBJECTIVES, **ARMORM_GATING)
    (folder / "config.json").write_text(json.dumps(layout, indent=2))
    return folder


# A classifier that ships its own code (``auto_map``): the ``hf-classifier`` labeler loads it only with an explicit
# ``trust_remote_code``. Its output has ``logits`` (B, 1), read at the last non-pad token (right padding).
_REMOTE_CODE = '''
import torch
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"


class TinyRemoteClassifier(LlamaPreTrainedModel):
    config_class = TinyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.head = torch.nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        last = attention_mask.sum(dim=1) - 1 if attention_mask is not None else torch.full(
            (input_ids.shape[0],), input_ids.shape[1] - 1)
        return SequenceClassifierOutput(logits=self.head(hidden[torch.arange(hidden.shape[0]), last]))  # (B, 1)
'''
REMOTE_CODE_FILE = "modeling_tiny_remote.py"


def build_remote_code_classifier(folder: Path, seed: int = 0) -> Path:
    """A sequence classifier whose folder ships its modeling code (``auto_map`` to ``modeling_tiny_remote.py``)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    (folder / REMOTE_CODE_FILE).write_text(_REMOTE_CODE)
    config = _llama_config(tok).to_dict()
    config.update(model_type="tiny_remote", architectures=["TinyRemoteClassifier"],
                  auto_map={"AutoConfig": "modeling_tiny_remote.TinyRemoteConfig",
                            "AutoModelForSequenceClassification": "modeling_tiny_remote.TinyRemoteClassifier"})
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True)
    model.save_pretrained(folder)
    return folder
