"""RLMedusa (models/medusa/rlmedusa.py): the reward model r(e, h) and the policy-gradient t + 2 head."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

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
    evaluation = evaluate_reward_model(model, hidden, embedding(candidates), probs)
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
