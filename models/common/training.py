"""One supervised training loop for every trained component: SLA's reward heads (docs/sla.md), the Medusa
heads and RLMedusa's reward model and t + 2 head (docs/medusa.md), COrAL's two stages (docs/coral.md) and the
MTP module (docs/mtp.md).

Each method supplies only its data, the parameters it trains and a step function ``(model, batch) -> (loss,
stats)``; the loop owns what they would otherwise each write again:

* ``accelerate``: the same code runs on a CPU, one GPU or several (``accelerate launch``). The step runs the
  *prepared* model, so under DDP the forward goes through the wrapper and gradients are all-reduced.
* the optimizer, built from the given parameters (each paper's algorithm, betas and weight decay are the
  caller's), and the schedule: linear warm-up then cosine decay, or a constant rate;
* precision: when the model holds half-precision weights, the trained ones are kept in float32 (master
  weights) for the run and the step runs under autocast to that half dtype. An Adam step moves a weight by
  about the learning rate; in bfloat16 (8 bits of mantissa) a 1e-6 step of a weight near 0.01 rounds away,
  so half-precision weights trained directly mostly never move. They are cast back at the end;
* the log: per step, every stat averaged over processes (``accelerator.reduce``) and the learning rate the
  step applied, a progress bar on the local main process, ``on_step`` and the live curve sink
  (:func:`models.common.curves.log_step`: the stage's MLflow run) on the main process;
* the data order: batches are shuffled by a generator seeded with ``seed``. Seeding the model's
  initialisation stays with the caller, who builds the model before handing it over;
* the usual knobs (:class:`models.common.config.TrainingLoop`, in every trained component's section): gradient
  clipping (``accelerator.clip_grad_norm_``), gradient accumulation (accelerate's: ``Accelerator(
  gradient_accumulation_steps=...)`` and ``accelerator.accumulate``), and checkpoints every N optimizer steps that a
  killed run resumes from, to the same weights (``accelerator.save_state`` / ``load_state`` and
  ``skip_first_batches``; docs/pipeline.md, "Training knobs");
* early stopping (:class:`EarlyStopping`): ``epochs`` is then a budget, not a schedule. After each epoch the
  caller's held-out loss is measured; training stops once it has not improved for ``patience`` epochs and the
  trained parameters go back to their best epoch. Budgets copied from 7–8B papers (a few epochs of a large
  data set) are a handful of optimizer steps on this project's default data, where a module is still learning
  when the run ends (docs/README.md, "Budgets"): with a held-out split the run decides how long it trains.

Master weights do not save an update from the final cast: a float32 master that moved by less than half its weight's
bfloat16 spacing (2⁻¹⁴ ≈ 6e-5 near 0.015) rounds back to the very value it started from, and so does a merged LoRA
delta (models/common/lora.py). Every training stage therefore reports the share of its trained weights whose saved
value differs from the starting one (:func:`weight_changes`, compared tensor by tensor, against the initial checkpoint
files where the weights came from disk) and warns below :data:`ROUNDED_AWAY_SHARE` (:func:`check_update`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from models.common.config import TrainingLoop
from models.common.curves import log_step
from models.common.files import CHECKPOINTS_ENV, atomic_path

if TYPE_CHECKING:
    from accelerate import Accelerator

HALF_DTYPES = (torch.float16, torch.bfloat16)

log = logging.getLogger(__name__)

ROUNDED_AWAY_SHARE = 0.01
"""Below this share of a stage's trained weight elements changed in what it saved, :func:`check_update` warns that
the update was rounded away. An update below half a bfloat16 spacing still moves the few weights so small that their
own spacing is below it (a spacing is 2⁻⁷–2⁻⁸ of the weight's magnitude), so a lost update shows as a share near 0,
not exactly 0. Measured on the tiny test Llama in bf16 (LoRA rank 4, 3 DPO steps): lr 1e-6 → 0.76 %, 1e-5 → 7.9 %,
1e-4 → 56 %, 1e-3 → 94 %. For Gaussian weights of std σ the share is about P(|w| < ~400·δ) for a delta δ: with
Llama-3-8B's shapes (σ ≈ 0.015, rank 16) LoRA at lr 1e-6 or 2e-6 over 3 steps (δ ≈ 1e-7–3e-7) gives 0.2–0.7 %."""

TensorSource = Mapping[str, torch.Tensor] | Path
"""Named tensors: a state dict in memory, or safetensors on disk (one file, or a folder's ``*.safetensors``, sharded
checkpoints included), read one tensor at a time."""


@dataclass(frozen=True)
class WeightChanges:
    """How many elements of the compared weights differ between the saved and the initial tensors."""

    changed: int
    total: int

    @property
    def share(self) -> float:
        """changed / total; NaN when nothing could be compared (no name in common)."""
        return self.changed / self.total if self.total else math.nan


@contextmanager
def _opened(source: TensorSource) -> Iterator[dict[str, Callable[[], torch.Tensor]]]:
    """Name → a loader of that tensor (from disk on demand: never a whole checkpoint in memory)."""
    if isinstance(source, Mapping):
        yield {name: (lambda tensor=tensor: tensor) for name, tensor in source.items()}
        return
    from safetensors import safe_open

    files = [source] if source.is_file() else sorted(Path(source).glob("*.safetensors"))
    with ExitStack() as stack:
        loaders = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            loaders |= {name: (lambda handle=handle, name=name: handle.get_tensor(name)) for name in handle.keys()}
        yield loaders


def weight_changes(saved: TensorSource, initial: TensorSource, names: Collection[str] | None = None) -> WeightChanges:
    """Elements of ``saved`` that differ from ``initial``, over ``names`` (None: every saved tensor), tensor by tensor:
    two tensors in memory at a time. A name missing on either side is skipped (a tied output projection that
    ``save_pretrained`` leaves out). The initial tensor is first cast to the saved one's dtype and device: what the
    stage started from is the checkpoint as loaded (a float32 file loaded in bf16 is compared in bf16)."""
    changed = total = 0
    with _opened(saved) as after, _opened(initial) as before, torch.no_grad():
        for name in (after if names is None else names):
            if name not in after or name not in before:
                continue
            new = after[name]()
            old = before[name]().to(new.device, new.dtype)
            if new.shape != old.shape:
                raise ValueError(f"weight {name}: saved shape {tuple(new.shape)} but initial {tuple(old.shape)}")
            changed += int((new != old).sum())
            total += new.numel()
    return WeightChanges(changed, total)


def check_update(changes: WeightChanges, what: str, learning_rate: float, dtype: torch.dtype,
                 logger: logging.Logger | logging.LoggerAdapter) -> float:
    """Log the share of ``what``'s trained weights that changed, with a warning when none could be compared or when
    it is below :data:`ROUNDED_AWAY_SHARE` (naming the learning rate and the saved dtype); returns the share, the
    stage's ``weights_changed`` metric."""
    share = changes.share
    if math.isnan(share):
        logger.warning("%s: no saved weight matched an initial one by name: the share of changed weights is not "
                       "measured", what)
    elif share < ROUNDED_AWAY_SHARE:
        name = str(dtype).removeprefix("torch.")
        why = (f"the update was rounded away (an update below half a {name} spacing is lost in the final cast or LoRA "
               "merge). Raise the learning rate or the steps, or keep float32 weights (policy.dtype)"
               if dtype in HALF_DTYPES else "the update left them where they were (no gradient reached them?)")
        logger.warning("%s: only %d of %d trained weight elements (%.3g %%) differ from the initial ones in the final "
                       "%s weights at learning rate %g: %s", what, changes.changed, changes.total, 100 * share, name,
                       learning_rate, why)
    else:
        logger.info("%s: %.3g %% of %d trained weight elements changed in the final weights", what, 100 * share,
                    changes.total)
    return share


class MasterWeights:
    """Parameters held in float32 (master weights) while they train; :meth:`in_own_dtypes` lends them back in their
    own dtypes for inference between updates (a rollout), the masters kept aside untouched."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)
        self.dtypes = [p.dtype for p in self.params]

    @contextmanager
    def in_own_dtypes(self) -> Iterator[None]:
        """The parameters in their own dtypes inside the block (a fresh rounding of the masters), the float32
        masters back after it, not a bit lost. GRPO samples its rollouts here: a bf16 policy samples as fast as it
        would untrained (on the 2-core CPU a one-token float32 forward costs 1.6× a bf16 one, a 4-token one 2.6×).
        Memory: the copies in the own dtypes, while the block runs."""
        masters = [p.data for p in self.params]
        for p, dtype in zip(self.params, self.dtypes, strict=True):
            p.data = p.data.to(dtype)  # a no-op for float32 ones
        try:
            yield
        finally:
            for p, master in zip(self.params, masters, strict=True):
                p.data = master


@contextmanager
def float32_master_weights(params: Sequence[nn.Parameter]) -> Iterator[MasterWeights]:
    """The parameters held in float32 inside the block (master weights), cast back to their own dtypes after. At lr
    1e-6 an AdamW step moves a bfloat16 weight by less than half its spacing (2⁻⁸ relative): it would round away."""
    masters = MasterWeights(params)
    for p in masters.params:
        p.data = p.data.float()  # a no-op for float32 ones
    try:
        yield masters
    finally:
        for p, dtype in zip(masters.params, masters.dtypes, strict=True):
            p.data = p.data.to(dtype)


def half_dtype(model: nn.Module) -> torch.dtype | None:
    """The half-precision dtype of the model's weights (the autocast dtype of its training step), or None."""
    return next((p.dtype for p in model.parameters() if p.dtype in HALF_DTYPES), None)


@contextmanager
def step_precision(accelerator: Accelerator, half: torch.dtype | None) -> Iterator[None]:
    """The context a training step runs in: accelerate's mixed precision, and autocast to ``half`` when the model
    holds half-precision weights (its float32 master weights then meet half-precision activations)."""
    # a disabled torch.autocast would switch accelerate's off too, hence nullcontext
    half_autocast = torch.autocast(accelerator.device.type, dtype=half) if half else nullcontext()
    with accelerator.autocast(), half_autocast:
        yield


@dataclass(frozen=True)
class EarlyStopping:
    """Stop when the held-out loss stops falling, and keep the best epoch's parameters."""

    held_out_loss: Callable[[nn.Module], float]
    """The loss of the (unwrapped) model on held-out data, measured after each epoch in inference mode; every
    process must get the same value (all evaluate the same data; the value is averaged over them all the same)."""
    patience: int = 1
    """Epochs without a new best held-out loss before training stops."""
    min_delta: float = 0.0
    """An improvement smaller than this does not count as one."""


def held_out_mean(step: Step, batches: Iterable, weight: Callable[[Any], float]) -> Callable[[nn.Module], float]:
    """An :class:`EarlyStopping` criterion: the model's mean loss over the held-out ``batches`` (re-iterable, e.g. a
    list or a ``DataLoader``), each batch's ``step`` loss weighted by ``weight(batch)`` (its targets, or its rows)."""

    def loss(model: nn.Module) -> float:
        total = count = 0.0
        for batch in batches:
            w = float(weight(batch))
            total, count = total + float(step(model, batch)[0]) * w, count + w
        return total / count

    return loss


class _BestEpoch:
    """The trained parameters' values at the epoch of the lowest held-out loss (copies in float32)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params, self.values, self.loss, self.epoch, self.stale = list(params), None, float("inf"), 0, 0

    def update(self, loss: float, epoch: int, min_delta: float) -> None:
        if loss < self.loss - min_delta:
            self.values = [p.detach().clone() for p in self.params]
            self.loss, self.epoch, self.stale = loss, epoch, 0
        else:
            self.stale += 1

    def restore(self) -> None:
        if self.values is None:  # no epoch gave a finite held-out loss: keep the last parameters
            return
        with torch.no_grad():
            for p, value in zip(self.params, self.values, strict=True):
                p.copy_(value)

    def state_dict(self) -> dict:
        return {"values": self.values, "loss": self.loss, "epoch": self.epoch, "stale": self.stale}

    def load_state_dict(self, state: dict) -> None:
        values = state["values"]
        self.values = None if values is None else [v.to(p.device) for v, p in zip(values, self.params, strict=True)]
        self.loss, self.epoch, self.stale = state["loss"], state["epoch"], state["stale"]


def _held_out_loss(early_stopping: EarlyStopping, prepared: nn.Module, accelerator: Accelerator) -> float:
    """The held-out loss of the model being trained, in inference mode, averaged over processes (so that all stop
    together); the model goes back to training mode after."""
    model = accelerator.unwrap_model(prepared)
    was_training = model.training
    model.eval()
    with torch.no_grad():  # not inference_mode: tensors a module caches in its forward stay usable for training
        loss = float(early_stopping.held_out_loss(model))
    model.train(was_training)
    return accelerator.reduce(torch.tensor([loss], dtype=torch.float64, device=accelerator.device), "mean").item()


Step = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, float | torch.Tensor]]]
"""``(prepared model, batch) -> (loss to minimise, stats to log)``; stats are scalars (floats or 1-element tensors)."""


class GeneratorState:
    """A ``torch.Generator`` as checkpointable state (``state_dict`` / ``load_state_dict``), for a step that draws
    from a generator of its own (RLMedusa's sampled actions): pass it in ``train(resumable=...)``."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["state"])


LOOP_STATE = "loop_state.pt"
"""The loop's own part of a checkpoint (beside accelerate's ``save_state`` files): the position in the data, the
history so far, early stopping and the caller's ``resumable`` objects."""


def _digest(value: Any, hasher) -> None:
    """Feed ``value`` (tensors, numbers, strings, and mappings and sequences of them) into ``hasher``."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        hasher.update(f"{value.dtype}{tuple(value.shape)}".encode())
        hasher.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            hasher.update(str(key).encode())
            _digest(value[key], hasher)
    elif isinstance(value, (list, tuple)) and all(isinstance(item, (bool, int, float, str)) for item in value):
        hasher.update(repr(value).encode())  # token ids: one update per sequence, not per token
    elif isinstance(value, (list, tuple)):
        hasher.update(f"[{len(value)}".encode())
        for item in value:
            _digest(item, hasher)
    else:
        hasher.update(repr(value).encode())


def run_fingerprint(model: nn.Module, data, settings: Mapping[str, Any]) -> str:
    """A hash of everything a training run's result depends on: the model's initial state (every tensor of its state
    dict), every item of ``data`` (indexable), and the run's ``settings`` (the loop's arguments, the optimizer's, the
    caller's knobs). A checkpoint is resumed only by a run with the same fingerprint, so one left by a run with other
    params, data or starting weights is never picked up. It reads the whole model and data, so it is taken only when
    checkpoints are on."""
    import hashlib

    hasher = hashlib.sha256()
    _digest(dict(settings), hasher)
    _digest(model.state_dict(), hasher)
    hasher.update(f"data{len(data)}".encode())
    for index in range(len(data)):
        _digest(data[index], hasher)
    return hasher.hexdigest()[:16]


def _checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first (a half-written one is a hidden temporary)."""
    return sorted(folder.glob("step-*")) if folder.is_dir() else []


def _save_checkpoint(accelerator: Accelerator, folder: Path, step: int, loop_state: dict) -> None:
    """accelerate's ``save_state`` (model, optimizer, schedule, every process's RNG states) and the loop's state into
    ``folder/step-N``, written to a temporary sibling the main process made and renamed whole; older checkpoints of
    the run are removed after."""
    from accelerate.utils import broadcast_object_list

    target = folder / f"step-{step:08d}"
    with ExitStack() as stack:
        tmp = [stack.enter_context(atomic_path(target)) if accelerator.is_main_process else None]
        tmp = broadcast_object_list(tmp)[0]  # every process writes its own RNG states into the same folder
        accelerator.save_state(str(tmp))
        if accelerator.is_main_process:
            torch.save(loop_state, tmp / LOOP_STATE)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for old in _checkpoints(folder)[:-1]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def train(model: nn.Module, data, step: Step, params: Iterable[nn.Parameter] | Iterable[dict],
          optimizer: Callable[..., torch.optim.Optimizer], *, accelerator: Accelerator, epochs: int, batch_size: int,
          seed: int, warmup_ratio: float | None = None, collate_fn: Callable | None = None, desc: str = "training",
          show: Iterable[str] = ("loss",),
          on_step: Callable[[int, int, dict[str, float]], None] | None = None,
          on_epoch_end: Callable[[int], None] | None = None,
          early_stopping: EarlyStopping | None = None,
          count_changes: str | None = None,
          loop: TrainingLoop | None = None,
          checkpoint_dir: Path | None = None,
          resumable: Sequence[Any] = ()) -> tuple[nn.Module, dict[str, list[float]]]:
    """Train ``params`` (parameters of ``model``, or param groups) for ``epochs`` passes over ``data``.

    ``optimizer``: builds the optimizer from the parameters, e.g. ``partial(torch.optim.AdamW, lr=1e-3,
    weight_decay=0.0)``. ``warmup_ratio``: the share of steps with linear warm-up before the cosine decay
    to 0; ``None`` keeps the rate constant. ``show``: the stats on the progress bar. ``on_step(step,
    num_steps, stats)`` runs on the main process after each optimizer step; ``on_epoch_end(epoch)`` on
    every process (it may reduce across them). ``early_stopping``: ``epochs`` becomes the most epochs to run
    (the schedule still spans them all); training ends after ``patience`` epochs without a new best held-out
    loss, the trained parameters set back to the best epoch's. ``count_changes``: the name of what trains (for the
    log), for a module small enough to copy (heads, the MTP module; a policy is compared against its checkpoint files
    instead): the trained parameters are copied to the CPU in their own dtypes before training, and after the cast
    back the share of their elements that changed is logged (:func:`check_update`).

    ``loop``: the caller's knobs (:class:`models.common.config.TrainingLoop`, usually its whole config section):

    * ``gradient_accumulation_steps``: accelerate's accumulation (``accelerator.accumulate``; ``backward`` divides
      each batch's loss by it), which the ``accelerator`` must have been built with. A step is an *optimizer* step:
      the schedule, ``num_steps``, ``on_step`` and the history count those, and each step's stats are the mean of
      its batches' (an epoch's last step may take fewer batches). ``k`` batches of ``b`` whose losses are means
      over their rows give the gradient of one batch of ``k·b``;
    * ``max_grad_norm``: ``accelerator.clip_grad_norm_`` before each optimizer step; the global gradient norm before
      clipping is logged as the stat ``grad_norm``;
    * ``checkpoint_every``: every that many optimizer steps, and when training ends, the state is saved under
      ``checkpoint_dir`` (default: the folder ``$FORESIGHT_CHECKPOINTS``, which a pipeline stage sets,
      :func:`models.common.files.training_checkpoints`; neither: no checkpoints) in a subfolder
      keyed by :func:`run_fingerprint`. A run that finds a checkpoint there resumes from it (logged: "resuming …
      from step k of n"): accelerate's ``load_state`` (weights, optimizer, schedule, RNG states), the shuffling
      generator as it was when that epoch began and ``skip_first_batches`` for the batches it had taken, the history
      so far and early stopping's best epoch, so it ends with the same weights as a run never interrupted. A
      checkpoint taken at an epoch's last step is saved after the epoch's end (``on_epoch_end``, early stopping).
      State the step or ``on_epoch_end`` keep themselves resumes only through ``resumable``: objects with
      ``state_dict()`` / ``load_state_dict()`` (:class:`GeneratorState` for a generator), saved with each checkpoint.

    Returns the unwrapped model (trained parameters back in their own dtype) and the history: per step,
    ``learning_rate`` and each stat; with early stopping also ``held_out_loss`` per epoch run and
    ``best_epoch`` (one value, counted from 1); with ``count_changes`` also ``weights_changed`` (one value: the
    share of the trained elements whose value, as saved in its own dtype, differs from the initial one).
    The prepared objects are released from ``accelerator`` at the end (``free_memory``: accelerate's advice between
    two trainings), so a later run on the same accelerator saves only its own state.
    """
    from transformers import get_cosine_schedule_with_warmup

    loop = loop or TrainingLoop()
    accumulation = accelerator.gradient_accumulation_steps
    if accumulation != loop.gradient_accumulation_steps:
        raise ValueError(f"gradient_accumulation_steps is {loop.gradient_accumulation_steps} but the Accelerator was "
                         f"built with {accumulation}: build it with Accelerator(gradient_accumulation_steps=...)")
    params = list(params)
    trained = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    half = half_dtype(model)
    initial = {str(i): p.detach().to("cpu", copy=True) for i, p in enumerate(trained)} if count_changes else None
    root = checkpoint_dir if checkpoint_dir is not None else os.environ.get(CHECKPOINTS_ENV)
    with float32_master_weights(trained):
        generator = torch.Generator().manual_seed(seed)
        loader = DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=collate_fn, generator=generator)
        raw_optimizer = optimizer(params)
        folder = None
        if loop.checkpoint_every is not None and root is not None:
            settings = {"loop": loop.model_dump(mode="json", exclude={"checkpoint_every"}), "desc": desc,
                        "epochs": epochs, "batch_size": batch_size, "seed": seed, "warmup_ratio": warmup_ratio,
                        "optimizer": type(raw_optimizer).__name__, "processes": accelerator.num_processes,
                        "early_stopping": None if early_stopping is None else
                        [early_stopping.patience, early_stopping.min_delta],
                        "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                         | {"sizes": [p.numel() for p in group["params"]]}
                                         for group in raw_optimizer.param_groups]}
            folder = Path(root) / run_fingerprint(model, data, settings)
        prepared, optimizer, loader = accelerator.prepare(model, raw_optimizer, loader)
        # Counted on the prepared loader (this process's batches): an optimizer step takes `accumulation` of them
        # (an epoch's last step may take fewer). accelerate steps a prepared scheduler once per process for every
        # optimizer step when batches are split between processes, so the schedule spans `processes` × the local
        # steps, and the warm-up is a whole number of those: N processes at batch B follow the schedule of one
        # process at batch N·B.
        steps_per_epoch = math.ceil(len(loader) / accumulation)
        local_steps = epochs * steps_per_epoch
        processes = accelerator.num_processes
        num_steps = processes * local_steps
        warmup_steps = processes * round(warmup_ratio * num_steps / processes) if warmup_ratio is not None else 0
        schedule = ([accelerator.prepare(get_cosine_schedule_with_warmup(raw_optimizer, warmup_steps, num_steps))]
                    if warmup_ratio is not None else [])

        history: dict[str, list[float]] = {"learning_rate": []}
        best = _BestEpoch(trained) if early_stopping is not None else None
        # where the run stands: optimizer steps done, the epoch under way and the batches it has taken, the
        # shuffling generator's state when that epoch began; `done` once training ended
        position = {"step": 0, "epoch": 0, "batches": 0, "generator": generator.get_state(), "done": False}

        def loop_state() -> dict:
            return {**position, "history": history, "best": None if best is None else best.state_dict(),
                    "resumable": [obj.state_dict() for obj in resumable]}

        if folder is not None and (found := _checkpoints(folder)):
            accelerator.load_state(str(found[-1]))
            saved = torch.load(found[-1] / LOOP_STATE, weights_only=True)
            position.update({key: saved[key] for key in position})
            history = saved["history"]
            if best is not None:
                best.load_state_dict(saved["best"])
            for obj, state in zip(resumable, saved["resumable"], strict=True):
                obj.load_state_dict(state)
            log.info("resuming %s from step %d of %d (checkpoint %s)", desc, position["step"], local_steps, found[-1])

        def save() -> None:
            _save_checkpoint(accelerator, folder, position["step"], loop_state())

        def due() -> bool:
            return folder is not None and position["step"] % loop.checkpoint_every == 0

        bar = tqdm(total=local_steps, initial=position["step"], desc=desc, unit="step",
                   disable=not accelerator.is_local_main_process)
        for epoch in range(position["epoch"], epochs if not position["done"] else 0):
            if position["batches"]:  # resumed mid-epoch: the same shuffle, past the batches already taken
                generator.set_state(position["generator"])
                batches = accelerator.skip_first_batches(loader, position["batches"])
            else:
                position["generator"] = generator.get_state()
                batches = loader
            group: list[dict[str, float]] = []  # the stats of this optimizer step's batches
            for batch in batches:
                with accelerator.accumulate(prepared):
                    with step_precision(accelerator, half):
                        loss, stats = step(prepared, batch)
                    accelerator.backward(loss)
                    group.append({key: float(value) for key, value in stats.items()})
                    if accelerator.sync_gradients:
                        if loop.max_grad_norm is not None:
                            norm = accelerator.clip_grad_norm_(trained, loop.max_grad_norm)
                            group[-1]["grad_norm"] = float(norm)
                        rate = schedule[0].get_last_lr()[0] if schedule else optimizer.param_groups[0]["lr"]
                        history["learning_rate"].append(rate)  # the rate this step applies
                    # accelerate's wrappers step and zero only when gradients sync (the group's last batch)
                    optimizer.step()
                    for scheduler in schedule:
                        scheduler.step()
                    optimizer.zero_grad()
                position["batches"] += 1
                if not accelerator.sync_gradients:
                    continue
                position["step"] += 1
                # the mean over the step's batches (NaN where a batch has no value: the gradient norm, measured
                # once, is the last batch's), then over processes; float64: a float32 stat (and a Python float made
                # from one) passes through exactly
                values = torch.tensor([[entry.get(key, math.nan) for key in group[-1]] for entry in group],
                                      dtype=torch.float64, device=accelerator.device)
                logged = dict(zip(group[-1], accelerator.reduce(values.nanmean(0), "mean").tolist(), strict=True))
                group = []
                for key, value in logged.items():
                    history.setdefault(key, []).append(value)
                # no forced redraw: the bar keeps its minimum interval (the pipeline's log gets a line per 10 s)
                bar.set_postfix({key: f"{logged[key]:.4f}" for key in show}, refresh=False)
                bar.update(1)
                if accelerator.is_main_process:  # live curves: this step's history entries, to the sink set around
                    log_step({"learning_rate": history["learning_rate"][-1], **logged}, bar.n)
                if on_step is not None and accelerator.is_main_process:
                    on_step(bar.n, local_steps, logged)
                if due() and position["batches"] < len(loader):
                    save()
            if on_epoch_end is not None:
                on_epoch_end(epoch)
            position.update(epoch=epoch + 1, batches=0)
            if best is not None:
                loss = _held_out_loss(early_stopping, prepared, accelerator)
                history.setdefault("held_out_loss", []).append(loss)
                best.update(loss, epoch + 1, early_stopping.min_delta)
                if best.stale >= early_stopping.patience:
                    break
            if due() and epoch + 1 < epochs:
                save()
        if folder is not None and not position["done"]:  # a re-run (a later component killed) skips this one
            position["done"] = True
            save()
        bar.close()
        if best is not None:
            best.restore()
            history["best_epoch"] = [best.epoch]
    if initial is not None:  # after the cast back: the values the caller saves
        rate = max(group["initial_lr"] if "initial_lr" in group else group["lr"] for group in optimizer.param_groups)
        changes = weight_changes({str(i): p for i, p in enumerate(trained)}, initial)
        history["weights_changed"] = [check_update(changes, count_changes, rate, trained[0].dtype, log)]
    unwrapped = accelerator.unwrap_model(prepared)
    accelerator.free_memory()
    return unwrapped, history
