"""GRPO (models/mtp/grpo.py) on hand-worked numbers, the advantage-aware MTP loss, and the MTP-RL step
(models/mtp/rl.py): which parameters each variant moves, and a short run of every variant."""

from __future__ import annotations

import math

import pytest
import torch

from models.engine.speculative import SpeculativeStats
from models.mtp.config import MTPRLTraining
from models.mtp.grpo import clipped_policy_loss, group_advantages, grpo_loss, k3_kl, token_logps, token_mean
from models.mtp.module import MTPModule, MTPModuleConfig, advantage_aware_kl, advantage_mask
from models.mtp.rl import Rollouts, mtp_rl_step_loss, train_variant, variant


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, eps=1e-4)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = 0.5 / (std + 1e-4)
    assert advantages[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert advantages[4:].tolist() == [0.0] * 4  # no spread, no signal
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, group_size=3)


def test_clipped_loss_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.9 against advantages +1, −1, +1, −1
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]]))
    mask = torch.ones(1, 4)
    per_token, clipped = clipped_policy_loss(logps, old, torch.tensor([1.0]), mask)
    # A = +1: −min(ρ, clip(ρ, 0.8, 1.28))
    assert per_token[0].tolist() == pytest.approx([-1.28, -0.5, -1.1, -0.9], abs=1e-6)
    assert clipped[0].tolist() == [True, False, False, False]
    per_token, clipped = clipped_policy_loss(logps, old, torch.tensor([-1.0]), mask)
    # A = −1: −min(−ρ, −clip(ρ)) = max(ρ, clip(ρ))
    assert per_token[0].tolist() == pytest.approx([1.5, 0.8, 1.1, 0.9], abs=1e-6)
    assert clipped[0].tolist() == [False, True, False, False]


def test_token_mean_weighs_tokens_not_sequences():
    values = torch.tensor([[1.0, 1.0, 1.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert token_mean(values, mask).item() == pytest.approx(7 / 4)  # not (1 + 4) / 2


def test_grpo_loss_with_k3_kl_by_hand():
    logps = torch.log(torch.tensor([[0.5, 0.25]]))
    ref_logps = torch.log(torch.tensor([[0.25, 0.25]]))
    # k3 with r = log(0.25 / 0.5): exp(r) − r − 1 = 0.5 + ln 2 − 1
    assert k3_kl(logps, ref_logps)[0].tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-6)
    mask = torch.ones(1, 2)
    loss, stats = grpo_loss(logps, logps.detach(), torch.tensor([2.0]), mask, ref_logps=ref_logps, kl_beta=0.1)
    # ratio 1 everywhere: policy loss −A = −2 per token
    assert stats["policy_loss"] == pytest.approx(-2.0)
    assert stats["kl"] == pytest.approx((0.5 + math.log(2) - 1) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * stats["kl"], abs=1e-6)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logps, logps, torch.tensor([1.0]), mask, kl_beta=0.1)


def test_token_logps_align_with_the_next_token():
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]]))
    input_ids = torch.tensor([[0, 1, 2]])
    assert token_logps(logits, input_ids)[0].tolist() == pytest.approx([math.log(0.2), math.log(0.8), 0.0], abs=1e-6)


def test_advantage_mask_zeroes_negative_advantage_samples(tiny_llama):
    from tests.tiny import load_spiky_tiny_llama

    assert advantage_mask(torch.tensor([-0.5, 0.0, 0.3])).tolist() == [0.0, 1.0, 1.0]
    model = load_spiky_tiny_llama(tiny_llama)
    module = MTPModule(model, MTPModuleConfig(2))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8))
    mask = torch.ones_like(input_ids)
    out = model(input_ids, output_hidden_states=True)
    states = module(model, input_ids, out.hidden_states[-1].detach())
    # sample 0 has a negative advantage: its KL must not count, nor give any gradient
    weights = advantage_mask(torch.tensor([-1.0, 1.0]))
    loss, _ = advantage_aware_kl(model, states, out.logits.detach(), mask, weights, [1.0, 1.0])
    only_second, _ = advantage_aware_kl(model, [s[1:] for s in states], out.logits.detach()[1:], mask[1:],
                                        torch.ones(1), [1.0, 1.0])
    assert loss.item() == pytest.approx(only_second.item() / 2, rel=1e-5)  # mean over both samples
    grads = torch.autograd.grad(loss, states)
    assert all(g[0].abs().max() == 0 and g[1].abs().max() > 0 for g in grads)


@pytest.fixture
def policy(tiny_llama):
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained

    return load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu"))


def _rollouts(policy, rewards: list[float]) -> Rollouts:
    tok = policy.tokenizer
    prompt = tok("Ben has 4 apples. How many?")["input_ids"]
    completions = [tok(text)["input_ids"] for text in ("The answer is 6.", "4 apples", "The answer is 4.", "6")]
    return Rollouts([prompt] * 4, completions, torch.tensor(rewards), 1.0, SpeculativeStats())


def _step(policy, module, name: str, rewards: list[float]) -> tuple[bool, bool]:
    """One update of ``name`` on fixed rollouts: did the policy change, did the module change?"""
    cfg = MTPRLTraining()
    var = variant(name, cfg)
    policy_before = [p.detach().clone() for p in policy.model.parameters()]
    module_before = [p.detach().clone() for p in module.parameters()]
    parameters = list(policy.model.parameters()) + (list(module.parameters()) if var.trains_module else [])
    policy.model.requires_grad_(True)
    module.requires_grad_(var.trains_module)
    optimizer = torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.0)
    rollouts = _rollouts(policy, rewards)
    advantages = group_advantages(rollouts.rewards, 4)
    _, stats = mtp_rl_step_loss(policy.model, policy, module, rollouts, advantages, None, None, var, cfg,
                                [0.6, 0.4], lambda loss: loss.backward())
    optimizer.step()
    policy_changed = any(not torch.equal(a, b) for a, b in zip(policy_before, policy.model.parameters()))
    module_changed = any(not torch.equal(a, b) for a, b in zip(module_before, module.parameters()))
    return policy_changed, module_changed


@pytest.mark.parametrize("name, policy_moves, module_moves", [
    ("vanilla", False, False), ("frozen_mtp", False, False), ("mtp_rl", True, True), ("ce_only", True, True),
    ("no_backprop", False, True)])
def test_which_parameters_each_variant_moves_when_rewards_carry_no_signal(policy, name, policy_moves, module_moves):
    """All rewards equal: advantages are 0 and GRPO gives no gradient, so the policy moves only through L_Adv —
    which MTP-RL and CE-only back-propagate into it and no-backprop does not."""
    module = MTPModule(policy.model, MTPModuleConfig(2))
    assert _step(policy, module, name, [0.0, 0.0, 0.0, 0.0]) == (policy_moves, module_moves)


@pytest.mark.parametrize("name", ["vanilla", "no_backprop"])
def test_rewards_with_a_spread_move_the_policy(policy, name):
    module = MTPModule(policy.model, MTPModuleConfig(2))
    policy_changed, _ = _step(policy, module, name, [1.0, 0.0, 1.0, 0.0])
    assert policy_changed


def test_every_variant_runs_a_short_rl_loop(policy, tiny_llama):
    from models.engine.config import PolicySpec
    from models.engine.generation import end_token_ids
    from models.engine.policy import load_pretrained

    cfg = MTPRLTraining(steps=2, prompts_per_step=1, group_size=2, max_new_tokens=6, learning_rate=1e-3)
    prompts = [policy.tokenizer(q, return_tensors="pt").input_ids for q in ("What is 2 + 3?", "What is 4 * 2?")]
    answers = ["5", "8"]
    eos = end_token_ids(policy)
    for name in ("vanilla", "mtp_rl", "frozen_mtp", "ce_only", "no_backprop"):
        fresh = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu"))
        var = variant(name, cfg)
        module = MTPModule(fresh.model, MTPModuleConfig(2)) if var.drafts else None
        history = train_variant(fresh, module, var, prompts, answers, cfg, [0.6, 0.4], eos)
        assert [h["step"] for h in history] == [1, 2]
        for h in history:
            assert h["rollout_seconds"] > 0 and 0 <= h["reward"] <= 1
            if var.drafts:
                assert h["tau"] >= 1 and 0 <= h["acceptance_rate"] <= 1
            else:
                assert h["tau"] == 1.0 and h["acceptance_rate"] == 0.0
            if var.trains_module:
                assert not math.isnan(h["mtp_ce_1"])
        assert not fresh.model.training and not any(p.requires_grad for p in fresh.model.parameters())
    with pytest.raises(ValueError, match="need 6 training prompts"):
        train_variant(policy, None, variant("vanilla", cfg), prompts, answers,
                      MTPRLTraining(steps=3, prompts_per_step=2), [1.0], eos)
    with pytest.raises(ValueError, match="unknown MTP-RL variant"):
        variant("nope", cfg)


def test_every_pass_of_a_step_uses_the_first_pass_log_probs_as_pi_old(policy, monkeypatch):
    """μ = 3 passes over one step's rollouts: passes 2 and 3 compare against the policy before the step's first
    update (the clip then bounds the whole step's move), not against the previous pass."""
    import models.mtp.rl as mtp_rl
    from models.engine.generation import end_token_ids

    seen = []
    real = mtp_rl.mtp_rl_step_loss

    def recording(*args):
        logps, stats = real(*args)
        seen.append((args[5], logps))  # (old_logps passed in, logps returned)
        return logps, stats

    monkeypatch.setattr(mtp_rl, "mtp_rl_step_loss", recording)
    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=4, iterations=3, learning_rate=1e-2)
    prompts = [policy.tokenizer("What is 2 + 3?", return_tensors="pt").input_ids]
    train_variant(policy, None, variant("vanilla", cfg), prompts, ["5"], cfg, [1.0], end_token_ids(policy))
    assert len(seen) == 3 and seen[0][0] is None
    assert seen[1][0] is seen[0][1] and seen[2][0] is seen[0][1]
