"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through PEFT, and
gradient checkpointing: the two memory knobs of the stages that train the policy's own weights (DPO, COrAL
stage 2, GRPO / MTP-RL; docs/gpu.md).

Full fine-tuning of an 8B policy with AdamW and float32 master weights needs ~16 bytes per parameter (128 GB)
before activations; rank-16 adapters on every linear layer train ~0.5 % of that. The frozen reference a
method compares against (DPO's, GRPO's KL) is the same model with its adapters switched off
(:func:`adapters_disabled`), so no second copy of the policy is kept. Saved weights are the adapters merged
back into the base model (:func:`merged`), in the policy's own dtype, so every later stage loads a plain
Hugging Face folder.

Merging can lose the update: the adapters train in float32, but ``W + (alpha/r)·B·A`` is rounded to the base's dtype,
and in bfloat16 a delta below half a weight's spacing (2⁻¹⁴ ≈ 6e-5 for a weight near 0.015) rounds back to ``W``. So
a stage that saves merged weights also saves the adapters themselves beside them (:class:`Adapter`, ``adapter/``, a
PEFT adapter folder: ``PeftModel.from_pretrained(base, folder / "adapter")``), small and in float32, where the update
survives whatever the merge rounded away; :func:`trained_weight_names` names the weights whose change
:func:`models.common.training.weight_changes` then counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_DIR = "adapter"
"""In a saved model folder whose weights have LoRA adapters merged in: the adapters themselves (a PEFT adapter
folder)."""


def with_lora(model: nn.Module, rank: int, exclude: Sequence[str] = ()) -> nn.Module:
    """``model`` wrapped with trainable rank-``rank`` adapters on every linear layer (but the output
    projection, and those whose names match a regex of ``exclude``); the base weights are frozen.

    alpha = 2 × rank (the usual scaling), no dropout (the adapters start as the identity: B = 0).
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"a LoRA rank must be ≥ 1, got {rank}")
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                        exclude_modules="|".join(f"(.*{pattern}.*)" for pattern in exclude) or None,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries PEFT adapters."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapters_disabled(model: nn.Module):
    """A context in which ``model`` runs as its base (the frozen reference); a no-op without adapters."""
    return model.disable_adapter() if is_lora(model) else nullcontext()


def merged(model: nn.Module) -> nn.Module:
    """The plain model with any adapters folded into its weights (what gets saved and decoded)."""
    return model.merge_and_unload() if is_lora(model) else model


def trained_weight_names(model: nn.Module) -> list[str]:
    """The state-dict names, in the plain (merged) model, of the weights that training ``model`` changes: with
    adapters, the weight of every adapted layer (PEFT names it ``base_model.model.<name>.base_layer.weight`` while
    wrapped, ``<name>.weight`` once merged); without, every parameter that requires a gradient."""
    if not is_lora(model):
        return [name for name, p in model.named_parameters() if p.requires_grad]
    from peft.tuners.lora import LoraLayer

    return [name.removeprefix("base_model.model.") + ".weight" for name, module in model.named_modules()
            if isinstance(module, LoraLayer)]


@dataclass(frozen=True)
class Adapter:
    """A trained PEFT LoRA adapter, copied off the model before merging (which removes it)."""

    config: Any
    """The adapter's ``peft.LoraConfig``."""
    weights: dict[str, torch.Tensor]
    """PEFT's adapter state dict (``get_peft_model_state_dict``), on the CPU in the adapters' own dtype."""

    @classmethod
    def of(cls, model: nn.Module) -> Adapter | None:
        """``model``'s active adapter (None without adapters); call before :func:`merged`."""
        if not is_lora(model):
            return None
        from peft import get_peft_model_state_dict

        weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(model).items()}
        return cls(config=model.peft_config[model.active_adapter], weights=weights)

    def save(self, folder: Path) -> None:
        """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), as
        ``PeftModel.save_pretrained`` does; ``PeftModel.from_pretrained(base, folder)`` loads it."""
        from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(folder))
        save_file(self.weights, str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant: works with frozen
    inputs, LoRA and DDP). ``use_cache`` is switched off: a cache is useless while training."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if is_lora(model):  # the embeddings are frozen: the checkpointed layers need an input that requires grad
        model.enable_input_require_grads()


@contextmanager
def memory_saving(model: nn.Module, lora_rank: int, gradient_checkpointing: bool,
                  exclude: Sequence[str] = ()) -> Iterator[nn.Module]:
    """The model to train under a stage's memory knobs; on exit, gradient checkpointing is switched off again.
    Callers :func:`merged` the result to get the plain model back."""
    trained = with_lora(model, lora_rank, exclude) if lora_rank > 0 else model
    if gradient_checkpointing:
        enable_gradient_checkpointing(trained)
    try:
        yield trained
    finally:
        if gradient_checkpointing:
            trained.activation_checkpointing_disable()
            trained.config.use_cache = True
