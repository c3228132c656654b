"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through PEFT, and
gradient checkpointing: the two memory knobs of the stages that train the policy's own weights (DPO, COrAL
stage 2, GRPO / MTP-RL; docs/gpu.md).

Full fine-tuning of an 8B policy with AdamW and float32 master weights needs ~16 bytes per parameter (128 GB)
before activations; rank-16 adapters on every linear layer train ~0.5 % of that. The frozen reference a
method compares against (DPO's, GRPO's KL) is the same model with its adapters switched off
(:func:`adapters_disabled`), so no second copy of the policy is kept. Saved weights are the adapters merged
back into the base model (:func:`merged`), in the policy's own dtype, so every later stage loads a plain
Hugging Face folder.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

from torch import nn


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
