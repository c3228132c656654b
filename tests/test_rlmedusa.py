"""RLMedusa (models/medusa/rlmedusa.py): the reward model r(e, h) and the policy-gradient t + 2 head."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors.torch import load_file, save_file

from models.medusa.config import RLMedusaTraining
from models.medusa.heads import MedusaHeads, MedusaHeadsConfig
from models.medusa.rlmedusa import (
    TokenRewardModel,
    evaluate_reward_model,
    fit_reward_model,
    reinforce_loss,
    reinforce_step_loss,
    shaped_rewards,
    state_baselined_advantages,
    train_rl_head,
)

HIDDEN, VOCAB = 8, 12


def _lm_head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)


def _embedding() -> torch.nn.Embedding:
    torch.manual_seed(1)
    return torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)


def test_shaped_rewards_and_group_baseline_by_hand():
    rewards = torch.tensor([[0.5, 0.1]])
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-1.5, -1.0]])
    shaped = shaped_rewards(rewards, logprobs, ref_logprobs, beta=0.1)
    assert shaped.tolist()[0] == pytest.approx([0.5 - 0.1 * 0.5, 0.1 - 0.1 * (-1.0)])
    assert not shaped.requires_grad  # the KL estimate is part of the reward, not differentiated
    advantages = state_baselined_advantages(shaped)
    assert advantages.tolist()[0] == pytest.approx([0.125, -0.125])
    loss = reinforce_loss(logprobs, advantages)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-0.125 / 2, 0.125 / 2])  # push up the better action


def test_policy_gradient_flows_from_the_reward_alone():
    """The published code's action is an argmax under no_grad, so the reward gives zero gradient. Here,
    with β = 0, the sampled actions' rewards alone must move head 1."""
    torch.manual_seed(0)
    head_logits = torch.randn(16, VOCAB, requires_grad=True)
    reward_model = TokenRewardModel(HIDDEN, HIDDEN, width=16)
    embedding = _embedding()
    loss, stats = reinforce_step_loss(head_logits, head_logits.detach(), torch.randn(16, HIDDEN), reward_model, embedding,
                               num_actions=4, beta=0.0, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert head_logits.grad.abs().sum() > 0
    assert stats["kl"] == pytest.approx(0.0, abs=1e-6)


def test_reward_model_is_nonlinear_enough_for_context_dependent_best_tokens():
    """A model linear in [h ; e] ranks tokens the same in every context (the reference code's flaw).
    Here the best token flips with the state, and the fitted r must rank both right."""
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(2, HIDDEN, generator=gen)
    hidden = states.repeat(64, 1)  # (128, H): two contexts
    candidates = torch.tensor([[3, 7]]).repeat(128, 1)  # (128, 2)
    probs = torch.tensor([[0.9, 0.05], [0.05, 0.9]]).repeat(64, 1)  # context 0 likes token 3, context 1 token 7
    embedding = _embedding()
    cfg = RLMedusaTraining(reward_width=32, reward_epochs=60, reward_batch_size=32, reward_learning_rate=3e-3)
    model, losses = fit_reward_model(hidden, embedding, candidates, probs, cfg, Accelerator(cpu=True))
    assert losses[-1] < losses[0] / 10
    rewards = model(states, embedding(torch.tensor([[3, 7], [3, 7]])))  # (2, 2)
    assert rewards[0, 0] > rewards[0, 1] and rewards[1, 1] > rewards[1, 0]
    evaluation = evaluate_reward_model(model, hidden, embedding, candidates, probs, batch_size=48)
    assert evaluation["top1_ranked_first"] == 1.0 and evaluation["mse"] < 0.05


def test_rl_step_changes_head_1_only():
    lm_head, embedding = _lm_head(), _embedding()
    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=3))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.1)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    torch.manual_seed(0)
    reward_model = TokenRewardModel(HIDDEN, HIDDEN, width=16).eval()
    cfg = RLMedusaTraining(num_actions=4, batch_size=8, epochs=2, learning_rate=1e-2, beta=0.05)
    trained, history = train_rl_head(heads, lm_head, reward_model, embedding, torch.randn(32, HIDDEN), cfg,
                                     Accelerator(cpu=True))
    after = trained.state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before if k.startswith("blocks.0."))
    assert all(torch.equal(after[k], before[k]) for k in before if not k.startswith("blocks.0."))
    assert all(torch.equal(v, heads.state_dict()[k]) for k, v in before.items())  # the input heads are untouched
    assert len(history["reward"]) == 2 * 4 and history["kl"][0] == pytest.approx(0.0, abs=1e-6)
    assert history["kl"][-1] > 0  # it moved away from its start


def test_rl_raises_the_reward_of_sampled_tokens():
    """With a reward that likes one token everywhere, REINFORCE must make that token more likely."""
    lm_head, embedding = _lm_head(), _embedding()
    heads = MedusaHeads(MedusaHeadsConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=1))

    class LikesToken5(torch.nn.Module):
        def forward(self, hidden, embeddings):
            return (embeddings == embedding.weight[5]).all(dim=-1).float()  # (N, C)

    states = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(0))
    cfg = RLMedusaTraining(num_actions=8, batch_size=16, epochs=40, learning_rate=3e-2, beta=0.0)
    start = torch.softmax(heads(states, lm_head, only=0), -1)[:, 5].mean()
    trained, history = train_rl_head(heads, lm_head, LikesToken5(), embedding, states, cfg, Accelerator(cpu=True))
    end = torch.softmax(trained(states, lm_head, only=0), -1)[:, 5].mean()
    assert end > start + 0.3
    assert sum(history["reward"][-4:]) / 4 > sum(history["reward"][:4]) / 4


def test_reward_model_reads_states_in_any_dtype_and_evaluates_in_batches():
    """States arrive in the policy's dtype (bf16 on a GPU) and the held-out set in batches on the model's device:
    the scores equal one float32 pass over everything."""
    torch.manual_seed(0)
    model = TokenRewardModel(HIDDEN, HIDDEN, width=16)
    embedding = _embedding()
    hidden = torch.randn(10, HIDDEN)
    candidates = torch.randint(VOCAB, (10, 3), generator=torch.Generator().manual_seed(0))
    probs = torch.rand(10, 3, generator=torch.Generator().manual_seed(1))
    assert model(hidden.bfloat16(), embedding(candidates).bfloat16()).dtype == torch.float32
    whole = evaluate_reward_model(model, hidden, embedding, candidates, probs, batch_size=10)
    assert evaluate_reward_model(model, hidden, embedding, candidates, probs, batch_size=3) == pytest.approx(whole)


ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 8


def _train_all(accelerator: Accelerator, policy_folder: str, batch_size: int) -> dict[str, torch.Tensor]:
    """Medusa-1 heads, then r(e, h), then RL head 1 from those heads, on fixed data with ``batch_size`` states
    per process and step: every trained parameter (flat) and the loss histories."""
    from transformers import AutoModelForCausalLM

    from models.engine.policy import Policy
    from models.medusa.config import MedusaTraining
    from models.medusa.training import DistilledStates, HiddenStates, train_medusa_heads

    model = AutoModelForCausalLM.from_pretrained(policy_folder)
    policy = Policy(model=model, tokenizer=None, device=torch.device("cpu"), name="tiny")
    lm_head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    gen = torch.Generator().manual_seed(0)
    n, vocab = 32, lm_head.out_features
    # every target valid: each process's loss is then a mean over the same number of terms
    hidden = torch.randn(n, model.config.hidden_size, generator=gen)
    candidates, probs = torch.randint(vocab, (n, 3), generator=gen), torch.rand(n, 3, generator=gen)
    data = DistilledStates(HiddenStates(hidden), torch.randint(vocab, (n, 2), generator=gen), torch.arange(n))
    heads, medusa = train_medusa_heads(policy, data, MedusaTraining(
        num_heads=2, epochs=2, batch_size=batch_size, learning_rate=1e-2, warmup_ratio=0.25, mixed_precision="no"),
        accelerator)
    # β as small as the paper's advice: the tolerances below were set for a KL term this size
    cfg = RLMedusaTraining(reward_width=16, reward_epochs=2, reward_batch_size=batch_size, num_actions=4,
                           batch_size=batch_size, epochs=2, learning_rate=1e-2, beta=0.02)
    reward_model, reward_losses = fit_reward_model(data.hidden, embedding, candidates, probs, cfg, accelerator)
    rl_heads, rl = train_rl_head(heads, lm_head, reward_model, embedding, data.hidden, cfg, accelerator)

    def flat(module: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in module.parameters()])

    return {"heads": flat(heads), "reward_model": flat(reward_model), "rl_heads": flat(rl_heads),
            "medusa_loss": torch.tensor(medusa["loss"]), "reward_loss": torch.tensor(reward_losses),
            "rl_loss": torch.tensor(rl["loss"]), "rl_reward": torch.tensor(rl["reward"])}


def _train_on_two_ranks(policy_folder: str, out: str) -> None:
    """Run by each of 2 processes: train everything on this rank's half of each global batch, compare the ranks."""
    AcceleratorState._reset_state(True)  # the forked process inherits the parent's single-process state
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    results = _train_all(accelerator, policy_folder, GLOBAL_BATCH // 2)
    for name in ("heads", "reward_model", "rl_heads"):
        gathered = accelerator.gather(results[name][None])  # (2, P)
        assert torch.equal(gathered[0], gathered[1]), name
    if accelerator.is_main_process:
        save_file(results, out)


def test_two_processes_train_exactly_as_one_with_their_global_batch(tiny_llama, tmp_path):
    """train_medusa_heads, fit_reward_model and train_rl_head under 2 processes (batch B each): identical
    parameters on both ranks, and the same parameters and losses as 1 process with batch 2B. For the RL head
    this needs the actions drawn for the global batch and the advantages scaled by its spread."""
    out = tmp_path / "two_ranks.safetensors"
    launch = ("from accelerate import debug_launcher; from tests.test_rlmedusa import _train_on_two_ranks; "
              f"debug_launcher(_train_on_two_ranks, args=({str(tiny_llama)!r}, {str(out)!r}), num_processes=2)")
    result = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    two = load_file(out)
    one = _train_all(Accelerator(cpu=True), str(tiny_llama), GLOBAL_BATCH)
    assert one.keys() == two.keys()
    for name, value in one.items():
        # the REINFORCE loss is a mean of terms A·log p ≈ ±6 that cancel to ~1e-4: float32 rounding of the
        # terms, summed in another order, moves it by ~1e-5 (its gradient, hence rl_heads, agrees to 1e-6)
        atol = 5e-5 if name == "rl_loss" else 1e-6
        torch.testing.assert_close(two[name], value, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
