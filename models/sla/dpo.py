"""Direct Preference Optimization of the policy on the pipeline's preference pairs ("DPO on top").

Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(NeurIPS 2023). DPO fits the policy π_θ to pairs (x, y_w, y_l) without a separate reward model by
minimising

    L_DPO = −log σ( β·log π_θ(y_w|x)/π_ref(y_w|x) − β·log π_θ(y_l|x)/π_ref(y_l|x) )

where π_ref is the frozen initial policy (a copy, or with LoRA the same model with its adapters off) and
β·log π_θ/π_ref is the *implicit reward*.
The SLA paper (Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward";
docs/sla.md) uses DPO as an orthogonal way to improve the policy and
shows that SLA decoding still adds on top of a DPO-tuned policy; the pipeline reproduces that by
training DPO on exactly the pairs (and the same held-out split) that the reward heads train on.

Training is TRL's ``DPOTrainer`` (sigmoid loss = the equation above), which runs on accelerate: the
same code trains on CPU, on one GPU, or on several under ``accelerate launch``.

Sequence log-probabilities ``chosen_logps`` / ``rejected_logps`` are sums over the response tokens
only (the prompt is context), and every response ends with the tokenizer's end token, so the policy
is also taught where to stop.

The token ids DPO trains on are the ones the policy decoded from. The pairs' ``prompt`` is already chat-templated,
and the generate stage tokenized it without the tokenizer's special tokens (the template writes them: Llama-3's
starts with ``<|begin_of_text|>``). TRL 1.16 tokenizes a standard-format ``prompt`` with them
(trl/trainer/dpo_trainer.py ``_prepare_dataset`` → trl/data_utils.py ``_tokenize``: ``processing_class(text=...)``)
and offers no switch for it, no pre-tokenized input (it always re-tokenizes ``prompt``) and, in its conversational
format, re-renders the response through the chat template (which trims it and writes the template's end of turn).
So the prompt handed to TRL is the templated text less the BOS text the tokenizer adds itself
(:func:`trl_prompt`), checked to give exactly the generation ids; a BOS-less tokenizer (SmolLM2's) gets the prompt
unchanged. A pair with a side longer than ``max_length`` is dropped, never truncated (:func:`fitting_pairs`;
models/common/sequences.py's length rule), so TRL's own ``keep_start`` truncation never cuts an end token.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from torch import nn

from models.common.curves import log_step
from models.common.files import CHECKPOINTS_ENV, atomic_path
from models.common.lora import ADAPTER_DIR, Adapter, is_lora, merged, trained_weight_names, with_lora
from models.common.training import check_update, run_fingerprint, weight_changes
from models.engine.policy import Policy, cpu_has_bf16_units
from models.sla.config import DPOTraining

if TYPE_CHECKING:  # trl and datasets are imported where used: importing them costs seconds
    from datasets import Dataset
    from trl import DPOTrainer

log = logging.getLogger(__name__)

MIN_TRAIN_PAIRS = 2
"""Fewer pairs give no meaningful optimisation (one pair = one step, nothing to shuffle or average)."""



def with_eos(response: str, eos_token: str) -> str:
    """The response followed by exactly one end token.

    Responses are stored decoded without special tokens, so the end token the policy emitted is gone;
    it is put back so DPO also learns to stop. The rule (append only when missing) is the one TRL
    applies to standard-format data, so TRL leaves these strings alone and the end token is never doubled.
    """
    return response if response.endswith(eos_token) else response + eos_token


def trl_prompt(tokenizer, prompt: str) -> str:
    """The text whose tokenization with special tokens (TRL's) gives the ids of the templated ``prompt`` without
    them (the generate stage's): the prompt itself where the tokenizer adds nothing, else the prompt less the BOS
    text its template wrote (the tokenizer adds that BOS back). An error where neither gives those ids (a tokenizer
    that appends tokens, or adds a BOS the template does not write)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for text in dict.fromkeys((prompt, prompt.removeprefix(tokenizer.bos_token or ""))):
        if tokenizer(text)["input_ids"] == ids:
            return text
    added = tokenizer("")["input_ids"]
    raise ValueError(f"the policy's tokenizer adds special tokens {tokenizer.convert_ids_to_tokens(added)} that its "
                     "chat template does not write at the start of the prompt: TRL's DPO would train on other token "
                     "ids than the policy decoded from. Use a tokenizer that adds no special tokens, or only the BOS "
                     "its chat template writes")


def preference_dataset(pairs: pd.DataFrame, tokenizer) -> Dataset:
    """Pairs as a ``datasets.Dataset`` in TRL's standard (non-conversational) preference format.

    ``prompt`` is the already chat-templated prompt (ending with the assistant header) exactly as the
    policy saw it when sampling, less the BOS text TRL's tokenization adds back (:func:`trl_prompt`), so DPO trains
    on the same context ids; ``chosen`` / ``rejected`` are the response texts with the end token.
    """
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": [trl_prompt(tokenizer, p) for p in pairs["prompt"]],
        "chosen": [with_eos(r, tokenizer.eos_token) for r in pairs["chosen"]],
        "rejected": [with_eos(r, tokenizer.eos_token) for r in pairs["rejected"]],
    })


def build_trainer(policy: Policy, train_pairs: pd.DataFrame, cfg: DPOTraining, output_dir: Path) -> DPOTrainer:
    """A TRL ``DPOTrainer`` over a copy of the policy, under ``cfg``'s memory knobs.

    - Full fine-tuning (``lora_rank`` 0): a float32 copy trains, and the reference is a second, frozen copy.
      float32 master weights: at DPO learning rates (~5e-6) bfloat16 weights (3 significant digits) would
      round most updates away. The reference is copied from the policy object rather than reloaded by TRL
      from ``config._name_or_path``, so it is exactly the initial policy (also for remote-code models, and
      with no second read from disk).
    - LoRA (``lora_rank`` > 0, models/common/lora.py): the copy keeps the policy's dtype and its weights are
      frozen; only rank-r adapters train, in float32 (PEFT's default for half-precision bases). The reference
      is the same model with the adapters' contribution switched off (TRL keeps a frozen copy of the freshly
      initialised adapters, whose B = 0 adds exactly nothing), so no second copy of the policy is held: at 8B
      in bf16 the weights cost 16 GB once instead of 32 GB twice, and AdamW's states shrink to the adapters'.
    - ``gradient_checkpointing``: TRL's activation checkpointing (recomputed in the backward pass; off in
      the reference's no-grad forward). Off by default: recomputation costs ~20 %.
    - Copies, so the caller's policy object stays the untouched initial model (TRL patches the forward,
      disables dropout and moves the models it is given). The copy trains all its weights even when the
      caller's are frozen (a :class:`~models.sla.reward_transformer.RewardTransformer` freezes its policy).
    - On a GPU with bfloat16 support, and on a CPU with bf16 units, the forward runs under bf16 autocast. Device
      follows the policy: a policy configured on CPU trains on CPU even when CUDA is visible.
    """
    from trl import DPOConfig, DPOTrainer

    if cfg.lora_rank > 0:
        model, reference = with_lora(copy.deepcopy(policy.model), cfg.lora_rank), None
    else:
        model = copy.deepcopy(policy.model).float().requires_grad_(True)  # whatever froze the caller's weights
        reference = copy.deepcopy(policy.model).float().eval().requires_grad_(False)
    on_cuda = policy.device.type == "cuda"
    args = DPOConfig(
        output_dir=str(output_dir),
        beta=cfg.beta,
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.batch_size,
        max_length=cfg.max_length,
        seed=cfg.seed,
        loss_type=["sigmoid"],  # the DPO loss of Rafailov et al.
        eval_strategy="no",
        max_grad_norm=cfg.max_grad_norm or 0.0,  # 0: the Trainer does not clip
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        # checkpoints (train_dpo: output_dir is then the run's checkpoint folder): the Trainer's own, with the
        # optimizer, schedule and RNG states, so that resume_from_checkpoint continues where the run stopped
        save_strategy="steps" if cfg.checkpoint_every else "no",
        save_steps=cfg.checkpoint_every or 500,
        save_total_limit=1,
        logging_steps=1,
        report_to="none",
        use_cpu=not on_cuda,
        # bf16 autocast over the float32 weights wherever bf16 is native: on the 2-core CPU (AVX512-BF16) a step of
        # the default run takes 9.4 s instead of 13.4 s in float32, with the same held-out accuracy (0.694)
        bf16=torch.cuda.is_bf16_supported() if on_cuda else cpu_has_bf16_units(),
        activation_checkpointing=cfg.gradient_checkpointing,  # always explicit: TRL's default is on
        dataloader_num_workers=0,
    )
    return DPOTrainer(model=model, ref_model=reference, args=args,
                      train_dataset=preference_dataset(train_pairs, policy.tokenizer),
                      processing_class=policy.tokenizer, callbacks=[curve_callback()])


def curve_callback():
    """A ``transformers.TrainerCallback`` that sends each training step's log (``logging_steps=1``: the DPO loss,
    learning rate, gradient norm, TRL's ``rewards/…``, ``logps/…``, ``logits/…``, ``epoch``) to the live curve sink
    (:func:`models.common.curves.log_step`), on the main process. ``report_to="none"`` stays: a TRL integration would
    open an MLflow run of its own; the stage's run gets the steps through the sink. The end-of-training log (no
    ``loss``, but ``train_loss``, ``train_runtime``) is no step and is left out."""
    from transformers import TrainerCallback

    class CurveCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                log_step({key: float(value) for key, value in logs.items()
                          if isinstance(value, (int, float)) and not isinstance(value, bool)}, state.global_step)

    return CurveCallback()


def trained_policy(trainer: DPOTrainer, initial: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The trained policy as a plain Hugging Face model in the ``initial`` policy's dtype, and its state dict.

    LoRA adapters are merged into the weights, so later stages load an ordinary model folder; full
    fine-tuning's float32 master weights are cast back, so the saved folder (weights and the ``dtype`` its
    config records) is the policy's size and precision. The Trainer switches ``use_cache`` off in the
    config of the model it trains; the initial policy's setting is put back, so the saved model decodes
    with its KV cache. Under FSDP / DeepSpeed the state dict is gathered collectively: every process calls this.
    """
    accelerator = trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)  # the forward without autocast
    lora = is_lora(unwrapped)
    model = merged(unwrapped).to(initial.dtype)  # cast in place: tied weights stay one tensor
    model.config.use_cache = initial.config.use_cache
    return model, model.state_dict() if lora else accelerator.get_state_dict(trainer.model)


def _first_last(history: list[dict], key: str, name: str) -> dict[str, float]:
    values = [entry[key] for entry in history if key in entry]
    return {f"{name}_first": float(values[0]), f"{name}_last": float(values[-1])} if values else {}


def train_dpo(policy: Policy, train_pairs: pd.DataFrame, cfg: DPOTraining, out_dir: Path) -> dict:
    """Fine-tune a copy of ``policy`` with DPO on ``train_pairs``; save it with its tokenizer to ``out_dir``.

    The folder is a plain Hugging Face model in the policy's dtype (LoRA adapters merged, and saved themselves in
    ``adapter/``: an update the merge rounds away survives there) and appears whole or not at all (written to a
    temporary sibling and renamed). Under several processes (``accelerate launch``: TRL's accelerator splits the
    batches and all-reduces the gradients) the state dict is gathered collectively and only the main process writes;
    it also adds ``weights_changed`` to the metrics: the share of the trained weights' elements that differ in the
    saved files from the initial policy (:func:`models.common.training.check_update` warns when the update was
    rounded away). Returns metrics from the trainer's per-step logs: DPO
    loss, ``rewards/accuracies`` (share of pairs with a positive implicit-reward margin) and
    ``rewards/margins``, first and last step, plus wall time and counts: ``num_pairs`` trained on and
    ``num_pairs_dropped_too_long`` (:func:`fitting_pairs`: pairs longer than ``cfg.max_length`` are left out).
    """
    from accelerate.state import AcceleratorState
    from transformers.trainer_utils import get_last_checkpoint

    train_pairs, too_long = fitting_pairs(policy.tokenizer, train_pairs, cfg.max_length)
    if len(train_pairs) < MIN_TRAIN_PAIRS:
        raise ValueError(f"DPO needs at least {MIN_TRAIN_PAIRS} training pairs, got {len(train_pairs)} "
                         f"({too_long} dropped as longer than dpo.max_length {cfg.max_length}): raise dpo.max_length, "
                         "sample more prompts or samples per prompt, lower validate.min_score_gap or "
                         "reward.eval_fraction (the held-out share of the pairs)")
    # The Trainer creates its output_dir up front: a scratch folder (nothing is saved there: save_strategy "no")
    # keeps a failed run from leaving an empty out_dir behind. With checkpoint_every, and under a stage
    # ($FORESIGHT_CHECKPOINTS, models/common/files.py), it is the run's checkpoint folder, keyed by the fingerprint
    # of the policy, the pairs and the knobs (never resumed by another run), which the stage removes once it succeeds.
    root = os.environ.get(CHECKPOINTS_ENV) if cfg.checkpoint_every else None
    with contextlib.ExitStack() as stack:
        if root is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dpo-trainer-")))
        else:
            settings = {"dpo": cfg.model_dump(mode="json", exclude={"checkpoint_every"}), "trainer": "trl DPOTrainer"}
            folder = Path(root) / run_fingerprint(policy.model, train_pairs.to_dict("records"), settings)
        trainer = build_trainer(policy, train_pairs, cfg, folder)
        last = get_last_checkpoint(str(folder)) if root is not None and folder.is_dir() else None
        if last is not None:
            log.info("resuming DPO from %s", last)
        started = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=last)
        train_seconds = time.perf_counter() - started

    accelerator = trainer.accelerator
    unwrapped = accelerator.unwrap_model(trainer.model)
    # before merging removes them: what trained, and the adapters themselves (saved beside the merged weights, where
    # an update the merge rounds to nothing survives)
    trained_names, adapter = trained_weight_names(unwrapped), Adapter.of(unwrapped)
    model, state_dict = trained_policy(trainer, policy.model)
    changed = {}
    if accelerator.is_main_process:
        with atomic_path(Path(out_dir)) as tmp:
            model.save_pretrained(tmp, state_dict=state_dict)
            policy.tokenizer.save_pretrained(tmp)
            if adapter is not None:
                adapter.save(tmp / ADAPTER_DIR)
        # the saved files against the initial policy (the caller's untouched object)
        changes = weight_changes(Path(out_dir), policy.model.state_dict(), trained_names)
        changed["weights_changed"] = check_update(changes, "dpo", cfg.learning_rate, policy.model.dtype, log)
    accelerator.wait_for_everyone()  # no process returns before the folder is whole
    # The Trainer's mixed precision lives in accelerate's process-wide AcceleratorState: an Accelerator made later in
    # this process without its own setting (the reward heads' one, say) would silently inherit bf16 autocast
    AcceleratorState._reset_state()

    history = trainer.state.log_history
    return {
        "num_pairs": len(train_pairs),
        "num_pairs_dropped_too_long": too_long,
        "steps": trainer.state.global_step,
        "train_loss": float(result.training_loss),
        **_first_last(history, "loss", "loss"),
        **_first_last(history, "rewards/accuracies", "reward_accuracy"),
        **_first_last(history, "rewards/margins", "reward_margin"),
        "train_seconds": train_seconds,
        **changed,
    }


def tokenize_pair(tokenizer, prompt: str, chosen: str, rejected: str) -> dict[str, list[int]]:
    """``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` of one pair exactly as TRL builds them for training.

    Responses get their end token; the prompt ends where the tokenized prompt and the tokenized prompt +
    response stop agreeing (the shorter of the two agreements), so evaluation scores the very tokens DPO
    trained on.
    """
    from trl.data_utils import common_prefix_length

    prompt = trl_prompt(tokenizer, prompt)  # the text TRL is given (preference_dataset)
    prompt_ids = tokenizer(prompt)["input_ids"]
    chosen_full = tokenizer(prompt + with_eos(chosen, tokenizer.eos_token))["input_ids"]
    rejected_full = tokenizer(prompt + with_eos(rejected, tokenizer.eos_token))["input_ids"]
    start = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    return {"prompt_ids": prompt_ids[:start], "chosen_ids": chosen_full[start:], "rejected_ids": rejected_full[start:]}


def _pair_length(pair: dict[str, list[int]]) -> int:
    """The longer side of a tokenized pair (:func:`tokenize_pair`), prompt included: what TRL's ``max_length`` cuts."""
    return len(pair["prompt_ids"]) + max(len(pair["chosen_ids"]), len(pair["rejected_ids"]))


def fitting_pairs(tokenizer, pairs: pd.DataFrame, max_length: int) -> tuple[pd.DataFrame, int]:
    """The pairs whose chosen and rejected sequences, as TRL tokenizes them (:func:`tokenize_pair`), both fit
    ``max_length`` whole (index reset), and how many were dropped. TRL would cut the longer ones at their end
    (``keep_start``): the end token gone from one side only, a biased comparison."""
    keep = [_pair_length(tokenize_pair(tokenizer, row.prompt, row.chosen, row.rejected)) <= max_length
            for row in pairs.itertuples()]
    return pairs[keep].reset_index(drop=True), len(keep) - sum(keep)


@torch.no_grad()
def pair_logps(model: nn.Module, tokenizer, pairs: pd.DataFrame, max_length: int | None = None,
               batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen_logps, rejected_logps)``: log π(y|x) summed over each response's tokens, end token included.

    Batches go through TRL's preference collator (same right padding as in training); log-probabilities are plain
    softmax over the model's logits. Every pair must fit ``max_length`` whole (``None``: no limit): drop the others
    with :func:`fitting_pairs` first, nothing is truncated.
    """
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    device = next(model.parameters()).device
    chosen_logps, rejected_logps = [], []
    for start in range(0, len(pairs), batch_size):
        examples = [tokenize_pair(tokenizer, row.prompt, row.chosen, row.rejected)
                    for row in pairs.iloc[start:start + batch_size].itertuples()]
        too_long = [length for length in map(_pair_length, examples) if max_length is not None and length > max_length]
        if too_long:
            raise ValueError(f"pairs of {too_long} tokens are longer than max_length {max_length}: drop them with "
                             "fitting_pairs first (pairs are never truncated)")
        batch = {k: v.to(device) for k, v in collate(examples).items()}  # rows: chosen..., rejected...
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        labels = batch["input_ids"][:, 1:]
        token_logps = logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        logps = (token_logps * batch["completion_mask"][:, 1:]).sum(-1)
        chosen, rejected = logps.chunk(2)
        chosen_logps.append(chosen.cpu())
        rejected_logps.append(rejected.cpu())
    return torch.cat(chosen_logps), torch.cat(rejected_logps)


def preference_accuracy(policy_logps: tuple[torch.Tensor, torch.Tensor],
                        reference_logps: tuple[torch.Tensor, torch.Tensor], *, beta: float) -> dict[str, float]:
    """How often DPO's implicit reward r(x, y) = β·log π(y|x)/π_ref(y|x) prefers the chosen response, from the
    ``(chosen_logps, rejected_logps)`` of the policy and of the reference (:func:`pair_logps`; the reference's can
    serve several policies).

    ``accuracy`` counts an exact tie as half (the win + tie/2 convention of the benchmarks), so the
    untrained policy (the reference's own log-probs: every margin is exactly 0) scores 0.5; ``margin`` is the
    mean of r(x, y_w) − r(x, y_l); ``pair_outcomes`` the per-pair 1 / ½ / 0 that ``accuracy`` averages (for
    intervals over pairs).
    """
    (chosen_logps, rejected_logps), (reference_chosen_logps, reference_rejected_logps) = policy_logps, reference_logps
    margins = beta * ((chosen_logps - reference_chosen_logps) - (rejected_logps - reference_rejected_logps))
    wins = (margins > 0).float() + 0.5 * (margins == 0).float()
    return {"accuracy": float(wins.mean()), "margin": float(margins.mean()), "num_pairs": len(margins),
            "pair_outcomes": wins.tolist()}
