"""Export of trained Medusa heads in vLLM's Medusa draft format, and a loader that reads it back as vLLM does.

The format, read from vLLM's sources (github.com/vllm-project/vllm):

- ``config.json``, read by ``MedusaConfig`` (vllm/transformers_utils/configs/medusa.py): ``hidden_size``,
  ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (residual blocks per head) and ``truncated_vocab_size`` (the
  vocabulary the heads score: all of it here, so no ``token_map``); ``model_type: medusa``, how
  ``SpeculativeConfig`` (vllm/config/speculative.py) recognises a Medusa draft; ``architectures: [MedusaModel]``,
  the registry's name of the ``Medusa`` model class. The model reads two more attributes with ``getattr``:
  ``medusa_fc_bias`` (the blocks' linear layers have a bias; default false) and ``original_lm_head`` (every head
  projects with one shared LM head, ``lm_head.weight``; otherwise each has its own, ``lm_heads.{i}.weight``).
- ``model.safetensors`` (vLLM's default loader reads every ``*.safetensors`` of the folder), names as
  ``Medusa.load_weights`` (vllm/model_executor/models/medusa.py) maps them: ``blocks.{i}.layers.{j}.weight`` /
  ``.bias``, then ``lm_head.weight`` or ``lm_heads.{i}.weight``.

Ours against vLLM's, and why the export is exact (every tensor is written as it is):

- vLLM's ``ResidualBlock.forward`` runs ``x = x + SiLU(layer(x))`` for each of its layers in turn: our head's
  ``nn.Sequential`` of :class:`~models.medusa.heads.ResBlock` computes the same function. Our linear layers have a
  bias, so ``medusa_fc_bias: true``.
- Shared heads (``medusa.untie: false``) project with the backbone's LM head, which their checkpoint leaves out: the
  export writes it once, as ``lm_head.weight`` with ``original_lm_head: true``. Untied heads write their own
  projections as ``lm_heads.{i}.weight``. vLLM's ``ParallelLMHead`` has no bias, so an LM head with one cannot be
  exported (SmolLM2's has none).
- Input: vLLM's Medusa proposer reads the target's final hidden states, which vLLM's models return after the final
  norm (``LlamaModel.forward`` ends with ``self.norm``); our heads are trained on transformers' ``last_hidden_state``,
  after the same norm.

What differs is decoding, not the heads: vLLM's proposer drafts the top-1 token of every head as one chain of K
tokens (vllm/v1/spec_decode/medusa.py, ``propose``), where our benchmark verifies a tree of candidates and drafts only
while drafting pays (``medusa_benchmark.adaptive``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.common.files import atomic_path
from models.medusa.heads import MedusaHeads, MedusaHeadsConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "MedusaModel"  # vLLM's registry: "MedusaModel" -> medusa.Medusa
CHECKPOINT_PREFIX = "medusa_heads."  # stripped by Medusa.load_weights (the FasterDecoding checkpoints carry it)


def vllm_medusa_config(heads: MedusaHeads) -> dict:
    """The ``config.json`` of ``heads`` in vLLM's Medusa format."""
    c = heads.config
    return {"model_type": "medusa", "architectures": [ARCHITECTURE], "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "truncated_vocab_size": c.vocab_size, "num_heads": c.num_heads,
            "num_hidden_layers": c.num_layers, "medusa_fc_bias": True, "original_lm_head": not c.untie}


def vllm_medusa_tensors(heads: MedusaHeads, lm_head: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``heads`` under vLLM's names; ``lm_head``: the backbone's, written once for shared heads."""
    projections = [lm_head] if heads.projections is None else list(heads.projections)
    for projection in projections:
        if getattr(projection, "bias", None) is not None:
            raise ValueError("vLLM's Medusa LM heads (ParallelLMHead) have no bias: this LM head has one, so the "
                             "heads cannot be exported to vLLM's format")
    tensors = {}
    for i, block in enumerate(heads.blocks):
        for j, res_block in enumerate(block):
            tensors[f"blocks.{i}.layers.{j}.weight"] = res_block.linear.weight
            tensors[f"blocks.{i}.layers.{j}.bias"] = res_block.linear.bias
    if heads.projections is None:
        tensors["lm_head.weight"] = lm_head.weight
    else:
        tensors.update({f"lm_heads.{i}.weight": projection.weight for i, projection in enumerate(projections)})
    return {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}


def export_vllm_medusa(heads: MedusaHeads, lm_head: nn.Module, out_dir: Path) -> Path:
    """Write ``heads`` (and, for shared heads, the backbone's ``lm_head``) to ``out_dir`` as a vLLM Medusa draft
    folder: ``config.json`` + ``model.safetensors``, replacing the folder atomically."""
    config, tensors = vllm_medusa_config(heads), vllm_medusa_tensors(heads, lm_head)
    with atomic_path(Path(out_dir)) as tmp:
        tmp.mkdir(parents=True)
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)


def read_vllm_medusa_config(folder: Path) -> dict:
    """``config.json`` as vLLM's ``MedusaConfig`` reads it: ``from_pretrained`` renames every key holding "num" and
    "heads" to ``num_heads`` and every key holding "num" and "layers" to ``num_hidden_layers`` (the FasterDecoding
    checkpoints' ``medusa_num_heads`` / ``medusa_num_layers``), then ``__init__``'s defaults fill what is missing and
    ``truncated_vocab_size`` defaults to ``vocab_size``."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no Medusa draft in {folder} ({CONFIG_FILE} missing)")
    raw = json.loads(path.read_text())
    for key in list(raw):
        if "num" in key and "heads" in key:
            raw["num_heads"] = raw.pop(key)
        elif "num" in key and "layers" in key:
            raw["num_hidden_layers"] = raw.pop(key)
    config = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1, **raw}
    if config.get("truncated_vocab_size") is None:
        config["truncated_vocab_size"] = config["vocab_size"]
    return config


def map_vllm_medusa_weights(config: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names → ``Medusa``'s parameter names, as ``Medusa.load_weights`` maps them: strip
    ``medusa_heads.``; keep a name that is a parameter; with ``original_lm_head``, ``lm_heads.0.weight`` fills
    ``lm_head.weight``; ignore anything else. vLLM leaves a parameter no name filled uninitialised; here that is an
    error naming it. A truncated draft vocabulary (``truncated_vocab_size`` < ``vocab_size`` with a ``token_map``) has
    no counterpart in our heads: an error too."""
    original_lm_head = bool(config.get("original_lm_head", False))
    bias = bool(config.get("medusa_fc_bias", False))
    params = {f"blocks.{i}.layers.{j}.{kind}" for i in range(config["num_heads"])
              for j in range(config["num_hidden_layers"]) for kind in (("weight", "bias") if bias else ("weight",))}
    params |= {"lm_head.weight"} if original_lm_head else {f"lm_heads.{i}.weight" for i in range(config["num_heads"])}
    if config["truncated_vocab_size"] != config["vocab_size"]:
        raise ValueError(f"this Medusa draft scores a truncated vocabulary (truncated_vocab_size "
                         f"{config['truncated_vocab_size']} of vocab_size {config['vocab_size']}, with a token_map): "
                         "our heads score the whole vocabulary")
    mapped = {}
    for name, tensor in weights.items():
        name = name.replace(CHECKPOINT_PREFIX, "")
        if name == "token_map":  # vLLM uses it only with a truncated vocabulary (refused above)
            continue
        if name in params:
            mapped[name] = tensor
        elif original_lm_head and name == "lm_heads.0.weight":
            mapped["lm_head.weight"] = tensor
    missing = sorted(params - mapped.keys())
    if missing:
        raise ValueError(f"the Medusa draft's weights lack {', '.join(missing)} (vLLM would leave them uninitialised)")
    return mapped


def load_vllm_medusa(folder: Path) -> tuple[MedusaHeads, nn.Linear | None]:
    """A vLLM Medusa draft folder read back into our heads, through vLLM's own name mapping: (heads, the shared LM
    head) for ``original_lm_head`` drafts, (heads with their own projections, None) otherwise. Without
    ``medusa_fc_bias`` our blocks' biases are zero (vLLM's layers have none): the same function."""
    folder = Path(folder)
    config = read_vllm_medusa_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in the Medusa draft folder {folder}")
    weights = {name: tensor for file in files for name, tensor in load_file(file).items()}
    mapped = map_vllm_medusa_weights(config, weights)
    original_lm_head = bool(config.get("original_lm_head", False))
    ours = MedusaHeadsConfig(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                             num_heads=config["num_heads"], num_layers=config["num_hidden_layers"],
                             untie=not original_lm_head)
    dtype = mapped["blocks.0.layers.0.weight"].dtype
    placeholder = None if original_lm_head else nn.Linear(ours.hidden_size, ours.vocab_size, bias=False)
    heads = MedusaHeads(ours, placeholder).to(dtype)
    state = {}
    for i in range(ours.num_heads):
        for j in range(ours.num_layers):
            weight = mapped[f"blocks.{i}.layers.{j}.weight"]
            state[f"blocks.{i}.{j}.linear.weight"] = weight
            state[f"blocks.{i}.{j}.linear.bias"] = mapped.get(f"blocks.{i}.layers.{j}.bias",
                                                                weight.new_zeros(weight.shape[0]))
        if not original_lm_head:
            state[f"projections.{i}.weight"] = mapped[f"lm_heads.{i}.weight"]
    heads.load_state_dict(state)
    if not original_lm_head:
        return heads, None
    lm_head = nn.Linear(ours.hidden_size, ours.vocab_size, bias=False, dtype=mapped["lm_head.weight"].dtype)
    lm_head.weight.data.copy_(mapped["lm_head.weight"])
    return heads, lm_head


def export_trained_heads(medusa_dir: Path, lm_head: nn.Module, out_dir: Path) -> dict[str, Path]:
    """Every trained set of heads under ``medusa_dir`` (the ``train_medusa`` stage's ``supervised/``, the
    ``train_rlmedusa`` stage's ``rl/<init>/``) exported to ``out_dir/<decoder name>`` (``medusa_supervised``,
    ``medusa_rl_<init>``: the benchmark's names), each folder replaced atomically; ``out_dir`` itself is never
    replaced. ``lm_head``: the backbone's (the policy the heads were trained on).

    Written in float32: the Medusa-1 heads are saved in the policy's dtype, the RL heads in their training dtype, and
    float32 holds either exactly; vLLM casts a draft to the dtype it serves in."""
    medusa_dir, out_dir = Path(medusa_dir), Path(out_dir)
    lm_head = copy.deepcopy(lm_head).float()
    folders = {"medusa_supervised": medusa_dir / "supervised"}
    rl_dir = medusa_dir / "rl"
    if rl_dir.is_dir():
        folders |= {f"medusa_rl_{folder.name}": folder for folder in sorted(rl_dir.iterdir())
                    if (folder / "heads.json").is_file()}
    return {name: export_vllm_medusa(MedusaHeads.load(folder, lm_head), lm_head, out_dir / name)
            for name, folder in folders.items()}
