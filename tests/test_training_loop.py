"""The shared supervised training loop (models/common/training.py): gradients synchronised across processes,
float32 master weights for half-precision models, the schedule and the log."""

from __future__ import annotations

import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn

from models.common.training import float32_master_weights, train

ROOT = Path(__file__).resolve().parent.parent


def _mse_step(model: nn.Module, batch: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, y = batch
    loss = (model(x) - y).pow(2).mean()
    return loss, {"loss": loss.detach()}


def _train_on_two_ranks() -> None:
    """Run by each of 2 processes: train a linear model on this rank's half of the batches, then compare."""
    AcceleratorState._reset_state(True)  # the forked process inherits the parent's single-process state
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(16, 1, generator=torch.Generator().manual_seed(2)))
    for through_wrapper in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)

        def step(model, batch):
            # bypassing the DDP wrapper (what COrAL once did) trains each rank on its own gradients only
            return _mse_step(model if through_wrapper else accelerator.unwrap_model(model), batch)

        trained, history = train(model, data, step, model.parameters(), partial(torch.optim.SGD, lr=0.1),
                                 accelerator=accelerator, epochs=2, batch_size=2, seed=0)
        assert len(history["loss"]) == 2 * 16 // (2 * 2)  # each rank takes half of the batches
        weights = torch.cat([p.detach().flatten() for p in trained.parameters()])
        gathered = accelerator.gather(weights[None])  # (2, P)
        assert torch.equal(gathered[0], gathered[1]) == through_wrapper, through_wrapper


def _stop_together_on_two_ranks() -> None:
    """Run by each of 2 processes: each rank sees its own held-out losses; the loop stops on their mean."""
    from models.common.training import EarlyStopping

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    scripted = iter({0: [0.5, 0.3, 0.4, 0.45, 0.1], 1: [0.5, 0.5, 0.2, 0.45, 0.1]}[accelerator.process_index])
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    model = nn.Linear(4, 1)
    _, history = train(model, data, _mse_step, model.parameters(), partial(torch.optim.SGD, lr=0.1),
                       accelerator=accelerator, epochs=5, batch_size=2, seed=0,
                       early_stopping=EarlyStopping(lambda m: next(scripted), patience=1))
    # means 0.5, 0.4, 0.3, 0.45: best epoch 3, stopped after epoch 4 on both ranks (alone, rank 0 would stop
    # after epoch 3 and rank 1 after epoch 2, and the ranks would wait for each other forever)
    assert history["held_out_loss"] == pytest.approx([0.5, 0.4, 0.3, 0.45]), history["held_out_loss"]
    assert history["best_epoch"] == [3]


def test_early_stopping_decides_on_the_mean_over_processes():
    launch = ("from accelerate import debug_launcher; from tests.test_training_loop import _stop_together_on_two_ranks; "
              "debug_launcher(_stop_together_on_two_ranks, num_processes=2)")
    result = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_gradients_are_all_reduced_across_processes():
    """Both ranks end with identical parameters, and would not if the step ran the unwrapped model.

    The two ranks are forked from a fresh interpreter: forked from this test process, they would inherit the
    state of whatever ran before (a Prefect test server's threads, say) and could die before training.
    """
    launch = ("from accelerate import debug_launcher; from tests.test_training_loop import _train_on_two_ranks; "
              "debug_launcher(_train_on_two_ranks, num_processes=2)")
    result = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_half_precision_model_trains_float32_master_weights():
    """At lr 1e-6 every Adam step of a bfloat16 weight of 2⁻⁸ (spacing 2⁻¹⁵ ≈ 3e-5) rounds away; the loop's
    float32 master weights accumulate 40 steps, and the result is cast back to bfloat16."""
    def model() -> nn.Module:
        linear = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
        nn.init.constant_(linear.weight, 2.0 ** -8)
        return linear

    data = torch.utils.data.TensorDataset(torch.ones(40, 4), torch.full((40, 1), 10.0))
    plain = model()  # the same training in bfloat16 alone
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-6)
    for x, y in torch.utils.data.DataLoader(data):
        _mse_step(plain, [x.bfloat16(), y.bfloat16()])[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.all(plain.weight == 2.0 ** -8)

    linear = model()
    trained, history = train(linear, data, _mse_step, linear.parameters(), partial(torch.optim.Adam, lr=1e-6),
                             accelerator=Accelerator(cpu=True), epochs=1, batch_size=1, seed=0)
    assert trained.weight.dtype == torch.bfloat16
    assert torch.all(trained.weight > 2.0 ** -8)  # moved by ≈ 40 · 1e-6 ≥ one bfloat16 spacing
    assert len(history["loss"]) == 40


def test_master_weights_lend_their_own_dtype_and_keep_every_bit():
    """Between updates the parameters are lent back in bfloat16 (a rounding of the masters), and the float32
    masters come back bit for bit: a master 1e-6 above a bfloat16 value keeps its 1e-6."""
    linear = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    nn.init.constant_(linear.weight, 2.0 ** -8)
    with float32_master_weights(linear.parameters()) as masters:
        assert linear.weight.dtype == torch.float32
        linear.weight.data += 1e-6  # an update below bfloat16's spacing at 2⁻⁸ (2⁻¹⁶ ≈ 1.5e-5)
        master = linear.weight.detach().clone()
        with masters.in_own_dtypes():
            assert linear.weight.dtype == torch.bfloat16
            assert torch.equal(linear.weight, master.to(torch.bfloat16))
            assert torch.all(linear.weight == 2.0 ** -8)
        assert linear.weight.dtype == torch.float32 and torch.equal(linear.weight, master)
        assert torch.all(linear.weight > 2.0 ** -8)
    assert linear.weight.dtype == torch.bfloat16


def test_cosine_schedule_with_warmup_and_the_log():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    seen = []
    _, history = train(model, data, _mse_step, model.parameters(), partial(torch.optim.AdamW, lr=1.0),
                       accelerator=Accelerator(cpu=True), epochs=2, batch_size=2, seed=0, warmup_ratio=0.25,
                       on_step=lambda step, num_steps, stats: seen.append((step, num_steps, stats["loss"])))
    # 8 steps: 2 of linear warm-up from 0, then the cosine decay towards 0
    assert history["learning_rate"][:3] == pytest.approx([0.0, 0.5, 1.0])
    assert history["learning_rate"][-1] < 0.1
    assert seen == [(i + 1, 8, loss) for i, loss in enumerate(history["loss"])]


def test_early_stopping_stops_after_patience_and_restores_the_best_epoch() -> None:
    """Held-out losses scripted per epoch (0.5, 0.3, 0.4, 0.45, 0.1): with patience 2 training stops after epoch
    4 (two epochs without a new best) and the parameters are those saved after epoch 2, not epoch 4's."""
    from models.common.training import EarlyStopping

    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    scripted = iter([0.5, 0.3, 0.4, 0.45, 0.1])
    snapshots = []

    def held_out_loss(m: nn.Module) -> float:
        snapshots.append(m.weight.detach().clone())
        return next(scripted)

    trained, history = train(model, data, _mse_step, model.parameters(), partial(torch.optim.SGD, lr=0.1),
                             accelerator=Accelerator(cpu=True), epochs=5, batch_size=4, seed=0,
                             early_stopping=EarlyStopping(held_out_loss, patience=2))
    assert history["held_out_loss"] == [0.5, 0.3, 0.4, 0.45]
    assert history["best_epoch"] == [2]
    assert len(history["loss"]) == 4 * 2  # 4 epochs of 2 batches ran, the fifth did not
    assert not torch.equal(snapshots[1], snapshots[3])  # the parameters moved after the best epoch
    torch.testing.assert_close(trained.weight.detach(), snapshots[1], rtol=0, atol=0)


def test_early_stopping_min_delta_counts_small_gains_as_none() -> None:
    from models.common.training import EarlyStopping

    model = nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
    scripted = iter([1.0, 0.99, 0.985, 0.5])
    _, history = train(model, data, _mse_step, model.parameters(), partial(torch.optim.SGD, lr=0.1),
                       accelerator=Accelerator(cpu=True), epochs=4, batch_size=4, seed=0,
                       early_stopping=EarlyStopping(lambda m: next(scripted), patience=2, min_delta=0.05))
    assert history["held_out_loss"] == [1.0, 0.99, 0.985]
    assert history["best_epoch"] == [1]


def _regression_data(n: int = 16) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=torch.Generator().manual_seed(3)),
                                          torch.randn(n, 1, generator=torch.Generator().manual_seed(4)))


def test_accumulated_batches_train_as_one_large_batch():
    """4 micro-batches of 2 (accelerate's accumulation) against batches of 8: the same weights, one schedule.

    Both see the same 8 rows per optimizer step: each epoch's shuffle draws the permutation from the same seeded
    generator, and consecutive batches of 2 cover what one batch of 8 covers. The gradients differ only in the order
    float32 sums run (a mean of 4 means of 2 rows against a mean of 8), a few ulps per step; over 8 Adam steps at lr
    0.01 on weights of order 1 that stays below 1e-6."""
    from models.common.config import TrainingLoop

    runs = {}
    for accumulation, batch_size in ((4, 2), (1, 8)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        _, history = train(model, _regression_data(), _mse_step, model.parameters(),
                           partial(torch.optim.Adam, lr=0.01), epochs=4, batch_size=batch_size, seed=0,
                           warmup_ratio=0.25,
                           accelerator=Accelerator(cpu=True, gradient_accumulation_steps=accumulation),
                           loop=TrainingLoop(gradient_accumulation_steps=accumulation))
        runs[accumulation] = (model, history)
    (accumulated, history), (large, reference) = runs[4], runs[1]
    assert len(history["learning_rate"]) == len(history["loss"]) == 8  # 2 optimizer steps an epoch, not 8
    assert history["learning_rate"] == pytest.approx(reference["learning_rate"], abs=0, rel=0)
    assert history["loss"] == pytest.approx(reference["loss"], rel=1e-5)  # the mean of the 4 micro-batch losses
    assert not torch.equal(accumulated.weight, torch.zeros_like(accumulated.weight))
    torch.testing.assert_close(accumulated.weight, large.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(accumulated.bias, large.bias, rtol=0, atol=1e-6)


def test_an_accelerator_without_the_accumulation_is_refused():
    from models.common.config import TrainingLoop

    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps is 2 but the Accelerator was built with 1"):
        train(model, _regression_data(), _mse_step, model.parameters(), partial(torch.optim.SGD, lr=0.1), epochs=1,
              batch_size=2, seed=0, accelerator=Accelerator(cpu=True), loop=TrainingLoop(gradient_accumulation_steps=2))


def test_clipping_bounds_each_update_and_logs_the_norm():
    """SGD at lr 1 moves the weights by exactly the gradient it is given: with clipping at 0.1 every update is at
    most 0.1 long, while the logged norm (before clipping) is the unclipped gradient's, as a run without clipping
    measures it on its first step."""
    from models.common.config import TrainingLoop

    updates, norms = [], {}
    for clip in (None, 0.1):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        data = torch.utils.data.TensorDataset(10 * torch.randn(8, 4), 10 * torch.randn(8, 1))
        before = [torch.cat([p.detach().flatten() for p in model.parameters()])]

        def record(step, num_steps, stats, model=model):
            before.append(torch.cat([p.detach().flatten() for p in model.parameters()]))

        _, history = train(model, data, _mse_step, model.parameters(), partial(torch.optim.SGD, lr=1.0), epochs=1,
                           batch_size=4, seed=0, accelerator=Accelerator(cpu=True), on_step=record,
                           loop=TrainingLoop(max_grad_norm=clip))
        if clip is None:
            assert "grad_norm" not in history
            first_update = (before[1] - before[0]).norm().item()
        else:
            updates = [(b - a).norm().item() for a, b in zip(before, before[1:])]
            norms = history["grad_norm"]
    assert len(updates) == len(norms) == 2
    assert max(updates) <= 0.1 + 1e-6
    assert min(norms) > 1.0  # the gradients were far longer than the bound
    assert norms[0] == pytest.approx(first_update, rel=1e-5)


def _resumable_run(folder: Path, kill_after: int | None = None, seen: list | None = None, lr: float = 0.01):
    """Dropout (the global RNG), a cosine schedule, Adam, early stopping and accumulation, checkpointed every 3
    optimizer steps: 5 epochs of 8 batches of 1, 2 batches per optimizer step → 20 steps."""
    from models.common.config import TrainingLoop
    from models.common.training import EarlyStopping, held_out_mean

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    held_out = [list(_regression_data(32)[16:])]

    def on_step(step, num_steps, stats):
        if seen is not None:
            seen.append(step)
        if step == kill_after:
            raise KeyboardInterrupt  # the stage is killed after its checkpoint at this step

    trained, history = train(model, _regression_data(8), _mse_step, model.parameters(),
                             partial(torch.optim.Adam, lr=lr), epochs=5, batch_size=1, seed=0, warmup_ratio=0.2,
                             accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2), on_step=on_step,
                             early_stopping=EarlyStopping(held_out_mean(_mse_step, held_out, len), patience=3),
                             loop=TrainingLoop(gradient_accumulation_steps=2, checkpoint_every=3),
                             checkpoint_dir=folder)
    return trained, history


def test_a_killed_run_resumes_from_its_checkpoint_with_the_same_weights(tmp_path, caplog):
    """Killed after step 7 (its last checkpoint: step 6, in the middle of epoch 2) and run again, the run takes only
    the steps after the checkpoint and ends with the weights, history and best epoch of a run never interrupted; a
    run with another learning rate starts afresh beside it."""
    reference, expected = _resumable_run(tmp_path / "uninterrupted")
    with pytest.raises(KeyboardInterrupt):
        _resumable_run(tmp_path / "killed", kill_after=7)
    assert [p.name for p in (tmp_path / "killed").glob("*/step-*")] == ["step-00000006"]
    other = []  # another learning rate: another fingerprint, so the checkpoint is not this run's to resume
    _resumable_run(tmp_path / "killed", seen=other, lr=0.02)
    assert other == list(range(1, 21))
    seen = []
    with caplog.at_level("INFO", logger="models.common.training"):
        resumed, history = _resumable_run(tmp_path / "killed", seen=seen)
    assert "from step 6 of 20" in caplog.text
    assert seen == list(range(7, 21))
    for a, b in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert history == expected
    assert len(expected["held_out_loss"]) == 5 and len(expected["loss"]) == 20


def test_medusa_heads_killed_under_a_stage_resume_there_and_the_folder_goes_on_success(tiny_llama, tmp_path):
    """A real component through its own entry point (the Accelerator it builds gets the section's accumulation):
    Medusa heads killed after step 3 inside a stage's checkpoint folder leave their step-2 checkpoint; run again
    they end with the weights of a run that never checkpointed, and the folder is removed once the block succeeds."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.common.files import training_checkpoints
    from models.engine.policy import Policy
    from models.medusa.config import MedusaTraining
    from models.medusa.training import self_distill, train_medusa_heads

    policy = Policy(model=AutoModelForCausalLM.from_pretrained(tiny_llama).eval(),
                    tokenizer=AutoTokenizer.from_pretrained(tiny_llama), device=torch.device("cpu"), name="tiny")
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 * 8?"}], tokenize=False,
                                                  add_generation_prompt=True)
    samples = pd.DataFrame([{"prompt_id": f"p{i}", "sample_index": 0, "prompt": prompt, "finish_reason": "eos",
                             "response": f"Ben gives {i} more apples to Ava. The answer is {i + 3}."}
                            for i in range(4)])
    cfg = MedusaTraining(num_heads=2, epochs=2, batch_size=4, learning_rate=1e-2, distill_batch_size=4,
                         mixed_precision="no", gradient_accumulation_steps=2, checkpoint_every=2)
    data = self_distill(policy, samples, cfg, tmp_path / "cache")
    reference, history = train_medusa_heads(policy, data, cfg)  # no folder set: no checkpoints
    assert len(history["loss"]) == 2 * math.ceil(math.ceil(len(data.hidden) / 4) / 2) >= 6

    def kill(step, num_steps, stats):
        if step == 3:
            raise KeyboardInterrupt

    folder = tmp_path / ".foresight" / "checkpoints" / "train_medusa"
    with pytest.raises(KeyboardInterrupt), training_checkpoints(folder):
        train_medusa_heads(policy, data, cfg, on_step=kill)
    assert [p.name for p in folder.glob("*/step-*")] == ["step-00000002"]
    steps = []
    with training_checkpoints(folder):
        resumed, resumed_history = train_medusa_heads(policy, data, cfg,
                                                      on_step=lambda step, n, stats: steps.append(step))
    assert steps[0] == 3 and steps[-1] == len(history["loss"])
    for a, b in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed_history["loss"] == history["loss"]
    assert not folder.exists()
