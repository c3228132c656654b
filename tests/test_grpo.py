"""GRPO (models/mtp/grpo.py) on hand-worked numbers, the advantage-aware MTP loss, and the MTP-RL step
(models/mtp/rl.py): which parameters each variant moves, a short run of every variant, and rewards from the reward
function given (hand-worked advantages; the verifiable labeler; a real reward model on prompts without answers)."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.common.sequences import padding_id
from models.engine.config import Adaptation
from models.engine.speculative import SpeculativeStats
from models.labeling.config import LabelerSpec
from models.labeling.labelers import LabelerError, build_labeler
from models.mtp.config import MTPRLTraining
from models.mtp.grpo import (
    clipped_policy_loss,
    group_advantages,
    grpo_loss,
    k3_kl,
    token_logps,
    token_mean,
    zero_std_groups,
)
from models.mtp.module import MTPModule, MTPModuleConfig, advantage_aware_kl, advantage_mask
from models.mtp.rl import (
    Rollouts,
    collect_rollouts,
    completion_logps,
    mtp_rl_step_loss,
    rollout_batch,
    rollout_rewards,
    train_variant,
    variant,
)
from tests.helpers import perturbed_module

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("What is 2 + 3?", "Ben has 4 apples. How many apples?")
VERIFIABLE = build_labeler(LabelerSpec()).score  # the verifiable answer check: 1.0 right, 0.0 wrong


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, eps=1e-4)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = 0.5 / (std + 1e-4)
    assert advantages[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert advantages[4:].tolist() == [0.0] * 4  # no spread, no signal
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, group_size=3)


def test_zero_std_groups_by_hand():
    """Four groups of 3: mixed 0/1, all 0, all 1, real-valued with one apart. The two flat groups get advantages 0
    (no gradient): half the groups carry one."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.7])
    flat = zero_std_groups(rewards, group_size=3)
    assert flat.tolist() == [False, True, True, False]
    assert (~flat).float().mean().item() == 0.5
    advantages = group_advantages(rewards, group_size=3).view(4, 3)
    assert [bool((row == 0).all()) for row in advantages] == flat.tolist()


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
    # the logits of positions 1 and 2 only (a forward with logits_to_keep = 2): the same log-probs from there
    assert token_logps(logits[:, 1:], input_ids, first=1)[0].tolist() == pytest.approx([0.0, math.log(0.8), 0.0],
                                                                                        abs=1e-6)


def test_completion_logps_equal_a_full_forward_from_the_first_completion_position(policy):
    """Only the completion positions' logits are computed (``logits_to_keep``); their log-probs equal those of a
    forward over every position, prompts of different lengths in one batch."""
    tok = policy.tokenizer
    prompts = [tok(q)["input_ids"] for q in ("Ben has 4 apples. How many?", "What is 7 * 8?")]
    completions = [tok(t)["input_ids"] for t in ("The answer is 6.", "56")]
    batch = rollout_batch(Rollouts(prompts, completions, torch.zeros(2), 1.0, SpeculativeStats()),
                          padding_id(tok), policy.device)
    with torch.no_grad():
        out, logps, first, _ = completion_logps(policy.model, batch, temperature=0.8)
        full = token_logps(policy.model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits,
                           batch["input_ids"], 0.8)
    assert first == min(map(len, prompts)) - 1
    assert out.logits.shape[1] == batch["input_ids"].shape[1] - first
    completion = torch.nn.functional.pad(batch["response_mask"][:, 1:], (0, 1)).bool()
    torch.testing.assert_close(logps[completion], full[completion])


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

    return load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32"))


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
    batch = rollout_batch(rollouts, padding_id(policy.tokenizer), policy.device)
    mtp_rl_step_loss(policy.model, policy.model, module, batch, advantages, None, None, var, cfg, [0.6, 0.4],
                     lambda loss: loss.backward())
    optimizer.step()
    policy_changed = any(not torch.equal(a, b) for a, b in zip(policy_before, policy.model.parameters()))
    module_changed = any(not torch.equal(a, b) for a, b in zip(module_before, module.parameters()))
    return policy_changed, module_changed


@pytest.mark.parametrize("name, policy_moves, module_moves", [
    ("vanilla", False, False), ("frozen_mtp", False, False), ("mtp_rl", True, True), ("mtp_rl_detached", True, True),
    ("ce_only", True, True), ("no_backprop", False, True)])
def test_which_parameters_each_variant_moves_when_rewards_carry_no_signal(policy, name, policy_moves, module_moves):
    """All rewards equal: advantages are 0 and GRPO gives no gradient, so the policy moves only through L_Adv —
    which MTP-RL (either KL target) and CE-only back-propagate into it and no-backprop does not."""
    module = MTPModule(policy.model, MTPModuleConfig(2))
    assert _step(policy, module, name, [0.0, 0.0, 0.0, 0.0]) == (policy_moves, module_moves)


@pytest.mark.parametrize("name, target_takes_gradient", [("mtp_rl", True), ("mtp_rl_detached", False)])
def test_the_kl_pulls_the_policy_toward_the_module_only_in_the_papers_reading(policy, monkeypatch, name,
                                                                            target_takes_gradient):
    """Eq. 3's KL(π_main ‖ π_MTP) in the main loss (eq. 5): in ``mtp_rl`` its target π_main takes gradient (the
    policy is pulled toward the module); in ``mtp_rl_detached`` the target is a constant, and the policy's share
    of L_Adv comes only through the hidden states the module reads."""
    import models.mtp.rl as mtp_rl

    seen = []
    real = mtp_rl.advantage_aware_kl

    def recording(base, states, main_logits, *args):
        seen.append(main_logits.requires_grad)
        return real(base, states, main_logits, *args)

    monkeypatch.setattr(mtp_rl, "advantage_aware_kl", recording)
    cfg = MTPRLTraining()
    torch.manual_seed(0)
    module = MTPModule(policy.model, MTPModuleConfig(2))
    policy.model.requires_grad_(True)
    rollouts = _rollouts(policy, [1.0, 0.0, 1.0, 0.0])
    batch = rollout_batch(rollouts, padding_id(policy.tokenizer), policy.device)
    _, stats = mtp_rl_step_loss(policy.model, policy.model, module, batch, group_advantages(rollouts.rewards, 4),
                                None, None, variant(name, cfg), cfg, [0.6, 0.4], lambda loss: None)
    assert seen == [target_takes_gradient]
    policy.model.requires_grad_(False)
    assert stats["mtp_kl_1"] > 0


@pytest.mark.parametrize("name", ["vanilla", "no_backprop"])
def test_rewards_with_a_spread_move_the_policy(policy, name):
    module = MTPModule(policy.model, MTPModuleConfig(2))
    policy_changed, _ = _step(policy, module, name, [1.0, 0.0, 1.0, 0.0])
    assert policy_changed


def _assert_drafting_counts(h: dict, depths: int) -> None:
    """A drafted step's counters checked against each other, by hand: each policy forward of a row (prefill, plain
    step or draft–verify cycle) emits one token, a cycle its accepted drafts besides, so the rollout tokens beyond
    one per forward are τ − 1 per cycle; each cycle offers the module's ``depths`` chained drafts; the accepted
    drafts are the cycles' tokens beyond their bonus token, plus at most one per row (its last cycle, which an end
    token or the length limit cut before the bonus)."""
    rollouts = h["rollouts"]
    cycles, forwards = h["cycles"], sum(r["forwards"] for r in rollouts)
    accepted, drafted = sum(r["accepted"] for r in rollouts), sum(r["drafted"] for r in rollouts)
    assert cycles > 0 and drafted == depths * cycles and h["tau"] <= 1 + depths
    assert h["rollout_tokens"] - forwards == pytest.approx((h["tau"] - 1) * cycles)
    beyond_bonus = sum(r["cycle_tokens"] for r in rollouts) - cycles
    assert 0 <= accepted - beyond_bonus <= sum(r["rows"] for r in rollouts)


def test_every_variant_runs_a_short_rl_loop(policy, tiny_llama):
    from models.engine.config import PolicySpec
    from models.engine.generation import end_token_ids
    from models.engine.policy import load_pretrained

    cfg = MTPRLTraining(steps=2, prompts_per_step=1, group_size=2, max_new_tokens=6, learning_rate=1e-3)
    questions = ["What is 2 + 3?", "What is 4 * 2?"]
    prompts = _prompts(policy.tokenizer, questions)
    answers = ["5", "8"]
    eos = end_token_ids(policy)
    for name in ("vanilla", "mtp_rl", "mtp_rl_detached", "frozen_mtp", "ce_only", "no_backprop"):
        fresh = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32"))
        var = variant(name, cfg)
        module = MTPModule(fresh.model, MTPModuleConfig(2)) if var.drafts else None
        history = train_variant(fresh, module, var, prompts, questions, answers, VERIFIABLE, cfg, [0.6, 0.4], eos)
        assert [h["step"] for h in history] == [1, 2]
        for h in history:
            assert h["rollout_seconds"] > 0 and 0 <= h["reward"] <= 1
            # per rollout batch (the intervals' units; a step's prompt × G = 2 rollouts in one): they add up to the
            # step's totals
            rollouts = h["rollouts"]
            assert [r["rows"] for r in rollouts] == [2] and sum(r["tokens"] for r in rollouts) == h["rollout_tokens"]
            assert 0 < sum(r["seconds"] for r in rollouts) <= h["rollout_seconds"]
            assert h["tokens_per_forward"] == pytest.approx(h["rollout_tokens"] / sum(r["forwards"] for r in rollouts))
            assert h["nonzero_advantage_share"] in (0.0, 1.0)  # one group
            if var.drafts:
                _assert_drafting_counts(h, 2)
                assert sum(r["cycles"] for r in rollouts) == h["cycles"]
                assert h["tau"] == pytest.approx(sum(r["cycle_tokens"] for r in rollouts) / h["cycles"])
                assert h["acceptance_rate"] == pytest.approx(sum(r["accepted"] for r in rollouts)
                                                             / sum(r["drafted"] for r in rollouts))
            else:
                assert h["tau"] == 1.0 and h["acceptance_rate"] == 0.0 and h["tokens_per_forward"] == 1.0
                assert not any(r["cycles"] or r["drafted"] for r in rollouts)
            if var.trains_module:
                assert not math.isnan(h["mtp_ce_1"])
        assert not fresh.model.training and not any(p.requires_grad for p in fresh.model.parameters())
    with pytest.raises(ValueError, match="need 6 training prompts"):
        train_variant(policy, None, variant("vanilla", cfg), prompts, questions, answers, VERIFIABLE,
                      MTPRLTraining(steps=3, prompts_per_step=2), [1.0], eos)
    with pytest.raises(ValueError, match="2 prompts, 1 questions and 2 answers"):
        train_variant(policy, None, variant("vanilla", cfg), prompts, questions[:1], answers, VERIFIABLE, cfg, [1.0],
                      eos)
    with pytest.raises(ValueError, match="unknown MTP-RL variant"):
        variant("nope", cfg)


@pytest.mark.parametrize("name", ["mtp_rl", "no_backprop"])
def test_an_update_in_micro_batches_equals_the_whole_batch(tiny_llama, name):
    """``update_batch_size`` 1 (each rollout its own forward/backward, gradients accumulated) against the whole step
    at once, with a k3 KL to the reference and two passes (π_old per micro-batch): the same losses, and the policy
    and the MTP module end the same."""
    from models.engine.config import PolicySpec
    from models.engine.generation import end_token_ids
    from models.engine.policy import load_pretrained

    def run(update_batch_size):
        torch.manual_seed(0)
        fresh = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32"))
        cfg = MTPRLTraining(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6, learning_rate=1e-3,
                            mtp_learning_rate=1e-3, kl_beta=0.1, iterations=2, adaptive=False,
                            update_batch_size=update_batch_size)
        module = MTPModule(fresh.model, MTPModuleConfig(2))
        history = train_variant(fresh, module, variant(name, cfg), _prompts(fresh.tokenizer), QUESTIONS, ["4", "4"],
                                response_length, cfg, [0.6, 0.4], end_token_ids(fresh))
        return history[0], [p.detach().clone() for p in fresh.model.parameters()], list(module.parameters())

    whole, whole_policy, whole_module = run(None)
    micro, micro_policy, micro_module = run(1)
    assert micro["rollout_tokens"] == whole["rollout_tokens"] and micro["reward"] == whole["reward"]
    for key in ("policy_loss", "kl", "mtp_loss", "mtp_ce_1", "mtp_kl_2"):
        assert micro[key] == pytest.approx(whole[key], abs=1e-5), key
    for a, b in zip(micro_policy + micro_module, whole_policy + whole_module, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(whole_module, MTPModule(
        load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32")).model,
        MTPModuleConfig(2)).parameters(), strict=True))  # the module did train


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
    train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer)[:1], QUESTIONS[:1], ["5"],
                  VERIFIABLE, cfg, [1.0], end_token_ids(policy))
    assert len(seen) == 3 and seen[0][0] is None
    assert seen[1][0] is seen[0][1] and seen[2][0] is seen[0][1]


def _load(tiny_llama, **spec):
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained

    return load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), **{"device": "cpu", "dtype": "float32", **spec}))


def first_of_each_pair(questions, responses, answers, truncated=None) -> list[float]:
    """A reward function for groups of G = 2: 1 for each prompt's first rollout, 0 for its second (advantages
    ±1/(√2 + ε), never all zero)."""
    return [1.0 - i % 2 for i in range(len(responses))]


def response_length(questions, responses, answers, truncated=None) -> list[float]:
    """A reward function: the response's length in characters."""
    return [float(len(response)) for response in responses]


def end_token_ids_of(model, tokenizer) -> set[int]:
    from models.engine.generation import end_token_ids
    from models.engine.policy import Policy

    return end_token_ids(Policy(model, tokenizer, model.device, "tiny"))


def _prompts(tokenizer, questions=QUESTIONS) -> list[torch.Tensor]:
    return [tokenizer(q, return_tensors="pt").input_ids for q in questions]


def first_prompt_mixed(questions, responses, answers, truncated=None) -> list[float]:
    """A reward function for two prompts × G = 2: the first prompt's rollouts score 1 and 0, the second's 0 and 0."""
    return [1.0, 0.0] + [0.0] * (len(responses) - 2)


def test_nonzero_advantage_share_and_tokens_per_forward_per_step_by_hand(policy):
    """One step of two groups, one mixed and one flat: half the groups carry a gradient; advantages +, −, 0, 0, so
    three of four rollouts have A ≥ 0. Plain sampling takes one forward per token."""
    cfg = MTPRLTraining(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4)
    (record,) = train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer), QUESTIONS,
                              [None, None], first_prompt_mixed, cfg, [1.0],
                              end_token_ids_of(policy.model, policy.tokenizer))
    assert record["nonzero_advantage_share"] == 0.5 and record["positive_advantage_share"] == 0.75
    assert record["tokens_per_forward"] == 1.0
    assert sum(r["forwards"] for r in record["rollouts"]) == record["rollout_tokens"]


def test_a_step_at_the_default_learning_rate_changes_every_parameter(policy):
    """TRL's check of a training step (its tests compare every parameter before and after): one vanilla GRPO step at
    the pipeline's default policy learning rate, on rewards with a spread, moves every weight tensor."""
    from models.mtp.config import MTPRLConfig

    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=6, learning_rate=MTPRLConfig().learning_rate)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer)[:1], QUESTIONS[:1], [None],
                  first_of_each_pair, cfg, [1.0], end_token_ids_of(policy.model, policy.tokenizer))
    unchanged = [name for name, p in policy.model.named_parameters() if torch.equal(p, before[name])]
    assert not unchanged


def test_a_step_at_the_default_learning_rate_moves_much_of_a_bfloat16_policy(tiny_llama):
    """The policy samples in bf16, rounded from its float32 master weights: an update far below a weight's bf16
    spacing leaves it as it was. One step at the default rate changes over a fifth of the tiny bf16 policy's
    weights (measured: 30 % at 3e-5, 16 % at 1e-5, 3.8 % at the former default 2e-6)."""
    from models.mtp.config import MTPRLConfig

    policy = _load(tiny_llama, dtype="bfloat16")
    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=6, learning_rate=MTPRLConfig().learning_rate)
    before = [p.detach().clone() for p in policy.model.parameters()]
    train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer)[:1], QUESTIONS[:1], [None],
                  first_of_each_pair, cfg, [1.0], end_token_ids_of(policy.model, policy.tokenizer))
    changed = sum(int((p != b).sum()) for p, b in zip(policy.model.parameters(), before, strict=True))
    assert changed > 0.2 * sum(b.numel() for b in before)


def test_bfloat16_policy_moves_at_learning_rate_1e6(tiny_llama):
    """bf16 GRPO, three AdamW passes at lr 1e-6 over one step's rollouts: weights of magnitude in [2⁻¹¹, 2⁻¹⁰)
    (bf16 spacing 2⁻¹⁸ ≈ 3.8e-6) move, which three 1e-6 steps applied to bf16 weights directly almost never do
    (each rounds away): the float32 master weights' updates reach the policy, which comes back in bf16."""
    policy = _load(tiny_llama, dtype="bfloat16")
    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=6, learning_rate=1e-6, iterations=3)
    before = [p.detach().clone() for p in policy.model.parameters()]
    history = train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer)[:1], QUESTIONS[:1],
                            [None], first_of_each_pair, cfg, [1.0], end_token_ids_of(policy.model, policy.tokenizer))
    assert history[0]["reward"] == 0.5 and history[0]["positive_advantage_share"] == 0.5
    after = list(policy.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in after)
    band = [(b.abs() >= 2**-11) & (b.abs() < 2**-10) for b in before]
    moved_in_band = sum(int(((a != b) & m).sum()) for a, b, m in zip(after, before, band, strict=True))
    # measured: 546 of 547 with master weights, 2 when AdamW updates the bf16 weights directly
    assert moved_in_band > 0.9 * sum(int(m.sum()) for m in band)


def test_mtp_rl_in_bfloat16_drafts_rollouts_and_trains_both(tiny_llama):
    """MTP-RL on a bf16 policy: speculative rollouts by the bf16 policy with bf16 drafts, one update of policy and
    module (float32 master weights under bf16 autocast), both back in bf16."""
    policy = _load(tiny_llama, dtype="bfloat16")
    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=6, learning_rate=1e-6, mtp_learning_rate=1e-4)
    module = MTPModule(policy.model, MTPModuleConfig(2))
    policy_before = [p.detach().clone() for p in policy.model.parameters()]
    module_before = [p.detach().clone() for p in module.parameters()]
    rollout_dtypes = set()

    def reward(questions, responses, answers, truncated=None):  # called inside the rollout phase
        rollout_dtypes.update(p.dtype for p in [*policy.model.parameters(), *module.parameters()])
        return VERIFIABLE(questions, responses, answers)

    history = train_variant(policy, module, variant("mtp_rl", cfg), _prompts(policy.tokenizer)[:1], QUESTIONS[:1],
                            ["5"], reward, cfg, [0.6, 0.4], end_token_ids_of(policy.model, policy.tokenizer))
    assert history[0]["cycles"] > 0 and math.isfinite(history[0]["mtp_ce_1"])
    # the rollouts ran on the bf16 policy and module (the float32 masters set aside), not on the masters
    assert rollout_dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.bfloat16 for p in [*policy.model.parameters(), *module.parameters()])
    assert any(not torch.equal(a, b) for a, b in zip(module_before, module.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, policy.model.parameters()))


def test_lora_grpo_keeps_the_starting_policy_as_its_kl_reference(tiny_llama, monkeypatch):
    """lora_rank > 0 with kl_beta > 0: the adapters train (with gradient checkpointing), the KL's reference is the
    same model with its adapters off — it gives the starting policy's log-probs at every step, with no copy — and
    the policy comes back as a plain model with the adapters merged in."""
    import models.mtp.rl as mtp_rl

    seen = []
    real = mtp_rl.reference_logps

    def recording(reference, batch, temperature):
        logps = real(reference, batch, temperature)
        seen.append((reference, batch, logps))
        return logps

    monkeypatch.setattr(mtp_rl, "reference_logps", recording)
    policy = _load(tiny_llama)
    start = copy.deepcopy(policy.model)
    cfg = MTPRLTraining(steps=2, group_size=2, max_new_tokens=6, learning_rate=1e-2, mtp_learning_rate=1e-3,
                        lora_rank=4, kl_beta=0.5, gradient_checkpointing=True)
    module = MTPModule(policy.model, MTPModuleConfig(2))
    history = train_variant(policy, module, variant("mtp_rl", cfg), _prompts(policy.tokenizer), QUESTIONS,
                            ["5", "4"], VERIFIABLE, cfg, [0.6, 0.4], end_token_ids_of(policy.model, policy.tokenizer))
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # adapters start as the identity (B = 0)
    assert history[1]["kl"] > 0  # the adapters moved, the reference did not
    assert len(seen) == 2
    for reference, batch, logps in seen:
        assert reference.__class__.__name__.startswith("Peft")  # no second copy of the policy
        with torch.no_grad():
            expected = completion_logps(start, batch, cfg.temperature)[1]
        torch.testing.assert_close(logps, expected)
    assert type(policy.model) is type(start)  # merged back into a plain model
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), policy.model.parameters()))


def _two_process_runs(tiny_llama: str, folder: str, batch_size: int) -> dict:
    """The MTP equip training and one MTP-RL step, on this process's share of one global batch (the frozen states
    go to ``folder``); returns the trained parameters and the losses. Under several processes, also checks that
    every rank holds the same parameters, and the main process saves the result in ``folder``."""
    from accelerate import Accelerator

    from models.mtp.config import MTPTraining
    from models.mtp.training import frozen_states, train_mtp_module

    accelerator = Accelerator(cpu=True)
    policy = _load(tiny_llama)
    # equip: 8 distinct sequences of equal length (each process's mean over its batch is then a share of the
    # global mean); both processes compute frozen states into one folder
    gen = torch.Generator().manual_seed(3)
    sequences = [(torch.randint(3, policy.model.config.vocab_size, (12,), generator=gen).tolist(), [0] * 4 + [1] * 8)
                 for _ in range(8)]
    states = frozen_states(policy, sequences, Path(folder), batch_size=2, accelerator=accelerator)
    module, equip = train_mtp_module(policy, sequences, states, 2,
                                     MTPTraining(epochs=1, batch_size=batch_size, learning_rate=1e-3), accelerator)
    # MTP-RL: a step of 2 prompts, split between the processes, each scoring its own rollouts
    # adaptive drafting decides by measured wall times: the two runs would draw different (equally exact) rollouts
    # one rollout batch per prompt's group, so the gathered batches of two processes are one process's batches
    cfg = MTPRLTraining(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=5, learning_rate=1e-3,
                        mtp_learning_rate=1e-3, adaptive=False, rollout_batch_size=2)
    rl_module = MTPModule(policy.model, MTPModuleConfig(2))
    history = train_variant(policy, rl_module, variant("mtp_rl", cfg), _prompts(policy.tokenizer), QUESTIONS,
                            [None, None], first_of_each_pair, cfg, [0.6, 0.4],
                            end_token_ids_of(policy.model, policy.tokenizer), accelerator)
    result = {"equip_module": torch.cat([p.flatten() for p in module.parameters()]), "equip_loss": equip["loss"],
              "policy": torch.cat([p.detach().flatten() for p in policy.model.parameters()]),
              "rl_module": torch.cat([p.detach().flatten() for p in rl_module.parameters()]),
              "record": history[0]}
    if accelerator.num_processes > 1:
        for key in ("equip_module", "policy", "rl_module"):
            gathered = accelerator.gather(result[key][None])  # (2, P)
            assert torch.equal(gathered[0], gathered[1]), key
        if accelerator.is_main_process:
            torch.save(result, Path(folder) / "result.pt")
    return result


def _on_two_ranks(tiny_llama: str, folder: str) -> None:
    """Run by each of 2 processes: :func:`_two_process_runs` with half the global batch each."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the forked process inherits the parent's single-process state
    torch.set_num_threads(1)  # two ranks on a loaded 2-core machine: intra-op threads only contend
    _two_process_runs(tiny_llama, folder, batch_size=2)


def test_two_processes_train_like_one_on_the_same_global_batch(tiny_llama, tmp_path):
    """Under 2 processes (each half of every batch: the equip stage's sequences, MTP-RL's prompts) every trained
    model is prepared, so both ranks end identical — the MTP module included — and the losses and parameters
    equal one process's on the same global batch (the MTP-RL losses are normalised by global counts)."""
    launch = ("from accelerate import debug_launcher; from tests.test_grpo import _on_two_ranks; "
              f"debug_launcher(_on_two_ranks, args=({str(tiny_llama)!r}, {str(tmp_path / 'two')!r}), "
              "num_processes=2)")
    result = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    two = torch.load(tmp_path / "two" / "result.pt")
    one = _two_process_runs(str(tiny_llama), str(tmp_path / "one"), batch_size=4)
    # the same rollouts, each process's share scored by it: advantages ±1/(√2 + ε) in both groups
    assert one["record"]["rollout_tokens"] == two["record"]["rollout_tokens"]
    # every rollout's counts, the processes' gathered in prompt order
    counted = ("tokens", "cycles", "cycle_tokens", "drafted", "accepted")
    assert [[r[c] for c in counted] for r in two["record"]["rollouts"]] == [[r[c] for c in counted]
                                                                           for r in one["record"]["rollouts"]]
    assert one["record"]["reward"] == two["record"]["reward"] == 0.5
    assert one["record"]["positive_advantage_share"] == two["record"]["positive_advantage_share"] == 0.5
    assert two["equip_loss"] == pytest.approx(one["equip_loss"], abs=1e-6)
    for key in ("policy_loss", "mtp_loss", "mtp_ce_1", "mtp_kl_1"):
        assert two["record"][key] == pytest.approx(one["record"][key], abs=1e-6), key
    for key in ("equip_module", "policy", "rl_module"):
        torch.testing.assert_close(two[key], one[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("draft_temperature, tree", [(0.0, False), (1.0, False), (0.0, True)],
                         ids=["top-1 chain", "sampled chain", "dynamic tree"])
def test_a_drafted_rollout_does_not_depend_on_its_batch(policy, draft_temperature, tree):
    """Each rollout draws from its own seeded stream (its drafts and its verdicts), so MTP-drafted rollouts sampled
    one at a time, two by two or all six together are the same tokens (always drafting; an adaptive batch decides
    for all its rows at once) — chains, or each rollout's own dynamic tree; vanilla rollouts too are sampled as
    batches."""
    from models.engine.config import DynamicTree
    from models.engine.generation import end_token_ids

    module = perturbed_module(policy.model, 2, scale=0.0)
    prompts, eos = _prompts(policy.tokenizer), end_token_ids(policy)

    def rollouts(batch_size: int | None, drafts: bool = True):
        cfg = MTPRLTraining(group_size=3, max_new_tokens=12, adaptive=False, rollout_batch_size=batch_size,
                            draft_temperature=draft_temperature,
                            dynamic_tree=DynamicTree(depth=3, top_k=3, frontier=2, budget=5) if tree else None)
        return collect_rollouts(policy.model, policy.tokenizer, module if drafts else None, prompts, QUESTIONS,
                                [None, None], response_length, cfg, 0, eos)

    together = rollouts(None)
    assert [c.rows for c in together.counts] == [6]
    assert len(set(map(tuple, together.completion_ids))) > 1
    if draft_temperature:  # sampled drafts pass often on this flat model (Σ min(p, q)); top-1 ones seldom (≈ 1/V)
        assert together.stats.accepted_drafts > 0
    for size in (1, 2):
        apart = rollouts(size)
        assert [c.rows for c in apart.counts] == [size] * (6 // size)
        assert apart.completion_ids == together.completion_ids, size
    vanilla = rollouts(None, drafts=False)
    assert [c.rows for c in vanilla.counts] == [6] and not any(c.cycles for c in vanilla.counts)
    assert len(set(map(tuple, vanilla.completion_ids))) > 1  # sampled, not greedy


def test_rollouts_are_scored_by_the_reward_function_given_in_one_call(policy):
    """A step's rollouts go to the reward function at once (a reward model scores in batches), each with its
    prompt's question and answer (None where it has none); the rollouts' rewards are what it returns (here each
    response's length)."""
    from models.engine.generation import end_token_ids

    calls = []

    def recording(questions, responses, answers, truncated=None):
        calls.append((questions, responses, answers, truncated))
        return response_length(questions, responses, answers)

    cfg = MTPRLTraining(group_size=3, max_new_tokens=6)
    eos = end_token_ids(policy)
    rollouts = collect_rollouts(policy.model, policy.tokenizer, None, _prompts(policy.tokenizer), QUESTIONS,
                                [None, "4"], recording, cfg, 0, eos)
    assert len(calls) == 1
    questions, responses, answers, truncated = calls[0]
    assert questions == [QUESTIONS[0]] * 3 + [QUESTIONS[1]] * 3 and answers == [None] * 3 + ["4"] * 3
    assert responses == [policy.tokenizer.decode(c, skip_special_tokens=True) for c in rollouts.completion_ids]
    # which rollouts max_new_tokens cut (no end token): the verifiable reward credits those only for a marked answer
    assert truncated == [len(c) == 6 and c[-1] not in eos for c in rollouts.completion_ids]
    assert rollouts.rewards.tolist() == [float(len(r)) for r in responses]
    assert len(set(rollouts.rewards.tolist())) > 1  # the rollouts differ: the rewards have a spread


def test_advantages_follow_the_reward_function_by_hand(policy, monkeypatch):
    """Rewards [1, 3] for the first prompt's pair and [5, 5] for the second's: the loss gets advantages
    ∓1/(√2 + ε) (mean 2, unbiased std √2) and 0, 0 (no spread); the step's reward is the mean, 3.5, and 3 of the 4
    advantages are ≥ 0 (eq. 2's w)."""
    import models.mtp.rl as mtp_rl
    from models.engine.generation import end_token_ids

    seen = []
    real = mtp_rl.mtp_rl_step_loss

    def recording(*args):
        seen.append(args[4])  # the advantages
        return real(*args)

    def by_prompt_and_position(questions, responses, answers, truncated=None):
        first, step = {QUESTIONS[0]: (1.0, 2.0), QUESTIONS[1]: (5.0, 0.0)}, 2  # per prompt: first reward, spread
        return [first[q][0] + first[q][1] * (i % step) for i, q in enumerate(questions)]

    monkeypatch.setattr(mtp_rl, "mtp_rl_step_loss", recording)
    cfg = MTPRLTraining(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4, learning_rate=1e-3)
    history = train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer), QUESTIONS,
                            [None, None], by_prompt_and_position, cfg, [1.0], end_token_ids(policy))
    a = 1 / (math.sqrt(2) + 1e-4)
    assert cfg.advantage_epsilon == 1e-4 and len(seen) == 1
    assert seen[0].tolist() == pytest.approx([-a, a, 0.0, 0.0], abs=1e-6)
    assert history[0]["reward"] == 3.5 and history[0]["positive_advantage_share"] == 0.75


def test_a_reward_that_is_not_a_finite_number_is_an_error(policy):
    from models.engine.generation import end_token_ids

    def rewards(*values):
        return rollout_rewards(lambda questions, responses, answers, truncated=None: list(values), QUESTIONS[:1],
                               [None], ["a", "b"],
                               group_size=2)

    assert rewards(0.5, -2.0).tolist() == [0.5, -2.0]
    with pytest.raises(ValueError, match=r"non-finite rewards \[nan\] for rollouts \[1\] of 2"):
        rewards(0.5, math.nan)
    with pytest.raises(ValueError, match=r"non-finite rewards \[inf, -inf\] for rollouts \[0, 1\] of 2"):
        rewards(math.inf, -math.inf)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 rollouts"):
        rewards(0.5)
    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="non-finite rewards"):  # a training step stops before its update
        train_variant(policy, None, variant("vanilla", cfg), _prompts(policy.tokenizer)[:1], QUESTIONS[:1], [None],
                      lambda questions, responses, answers, truncated=None: [math.nan] * len(responses), cfg, [1.0],
                      end_token_ids(policy))


def test_a_reward_model_rewards_prompts_without_answers(policy, tiny_classifier):
    """One MTP-RL step end to end with a real sequence-classification reward model as the reward, on prompts with
    no known answer: the step's mean reward is the model's mean score of the very rollouts the step drew (drawn
    again apart from the same seeded streams), real-valued rather than 0/1, and policy and module move. The
    verifiable labeler on the same prompts fails, naming the missing answers."""
    from models.engine.generation import end_token_ids

    labeler = build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), device="cpu"))
    # a fixed cycle cost: the adaptive decisions (carried across a call's rollouts) then depend on acceptance alone,
    # so the step redraws exactly the reference's rollouts; a measured cost would make them depend on timing
    cfg = MTPRLTraining(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6, learning_rate=1e-2,
                        mtp_learning_rate=1e-2, adaptation=Adaptation(cycle_cost=2.0))
    module = MTPModule(policy.model, MTPModuleConfig(2))
    prompts, eos = _prompts(policy.tokenizer), end_token_ids(policy)
    reference = collect_rollouts(policy.model, policy.tokenizer, module, prompts, QUESTIONS, [None, None],
                                 labeler.score, cfg, 0, eos)
    assert not set(reference.rewards.tolist()) <= {0.0, 1.0}
    policy_before = [p.detach().clone() for p in policy.model.parameters()]
    module_before = [p.detach().clone() for p in module.parameters()]
    history = train_variant(policy, module, variant("mtp_rl", cfg), prompts, QUESTIONS, [None, None], labeler.score,
                            cfg, [0.6, 0.4], eos)
    assert history[0]["reward"] == pytest.approx(reference.rewards.mean().item(), abs=1e-6)
    assert history[0]["rollout_tokens"] == sum(map(len, reference.completion_ids))
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, policy.model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(module_before, module.parameters()))
    with pytest.raises(LabelerError, match="verifiable labeler"):
        collect_rollouts(policy.model, policy.tokenizer, None, prompts, QUESTIONS, [None, None], VERIFIABLE, cfg, 0,
                         eos)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["vanilla", "mtp_rl", "frozen_mtp", "ce_only", "no_backprop"])
def test_every_variant_rolls_out_and_updates_on_cuda_in_bfloat16(tiny_llama, name):
    """Each variant's rollouts (seeded CUDA generators: a CPU one once failed every drafted rollout) and one
    update on the GPU with a bf16 policy; what the variant trains moves and comes back in bf16 on the GPU."""
    policy = _load(tiny_llama, device="cuda", dtype="bfloat16")
    cfg = MTPRLTraining(steps=1, group_size=2, max_new_tokens=8, learning_rate=1e-4, mtp_learning_rate=1e-3)
    var = variant(name, cfg)
    module = MTPModule(policy.model, MTPModuleConfig(2)) if var.drafts else None
    module_before = [p.detach().clone() for p in module.parameters()] if module is not None else []
    prompts = [ids.cuda() for ids in _prompts(policy.tokenizer)[:1]]
    history = train_variant(policy, module, var, prompts, QUESTIONS[:1], ["5"], VERIFIABLE, cfg, [0.6, 0.4],
                            end_token_ids_of(policy.model, policy.tokenizer))
    assert history[0]["rollout_tokens"] > 0
    if var.drafts:  # the drafted rollouts' counters add up as on the CPU
        _assert_drafting_counts(history[0], 2)
    params = list(policy.model.parameters()) + (list(module.parameters()) if module is not None else [])
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    if var.trains_module:
        assert any(not torch.equal(a, b) for a, b in zip(module_before, module.parameters()))


def test_a_dynamic_tree_with_sampled_drafts_is_refused():
    from pydantic import ValidationError

    from models.engine.config import DynamicTree

    with pytest.raises(ValidationError, match="draft_temperature 0.5 samples chain drafts only"):
        MTPRLTraining(dynamic_tree=DynamicTree(budget=4), draft_temperature=0.5)
