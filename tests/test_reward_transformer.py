"""The Reward Transformer and its adapter baselines (models/reward_transformer.py; SLA §4.2–4.3, eq. 14–17)."""

from __future__ import annotations

import math

import pytest
import torch

from models.engine.config import PolicySpec
from models.engine.policy import load_pretrained
from models.sla.reward_transformer import (
    FinalStateAdapter,
    RewardChannel,
    RewardHeadConfig,
    RewardTransformer,
    bradley_terry_loss,
    mean_response_reward,
)

HEADS = {
    "channel": RewardHeadConfig(kind="channel", hidden_size=16),
    "adapter-1": RewardHeadConfig(kind="adapter", hidden_size=16, adapter_layers=1),
    "adapter-4": RewardHeadConfig(kind="adapter", hidden_size=16, adapter_layers=4),
}


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def policy(tiny_llama):
    return load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def input_ids(policy) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(3, len(policy.tokenizer), (2, 11))  # (B, T), no special tokens


@pytest.mark.parametrize("head", HEADS)
def test_shapes(policy, input_ids, head):
    torch.manual_seed(0)
    out = RewardTransformer(policy.model, HEADS[head])(input_ids)
    assert out.rewards.shape == input_ids.shape
    assert out.logits.shape == (*input_ids.shape, policy.model.config.vocab_size)
    assert torch.isfinite(out.rewards).all()


@pytest.mark.parametrize("head", HEADS)
def test_incremental_rewards_equal_full_forward(policy, input_ids, head):
    """SLA scores new tokens on top of a KV cache; the head carries no cache, so nothing may change."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = RewardTransformer(policy.model, HEADS[head])
    with torch.no_grad():
        full = model(input_ids).rewards  # (B, T)
        first = model(input_ids[:, :6], use_cache=True)
        assert isinstance(first.cache, DynamicCache)
        rest = model(input_ids[:, 6:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.rewards, rest.rewards], dim=1), full, atol=1e-5, rtol=0)


def test_channel_under_bf16_autocast_normalises_in_its_weights_dtype():
    """Training runs the channel's float32 master weights under bf16 autocast on the bf16 policy's states. CPU
    autocast leaves ``rms_norm`` alone, so a norm handed the bf16 states as they are runs unfused and warns
    "Mismatch dtype" (an error here: pyproject.toml's filterwarnings); the channel upcasts them to its weights' dtype
    and scores as a float32 channel does on the same states, to bf16 precision."""
    torch.manual_seed(0)
    channel = RewardChannel(32, 2, hidden_size=16)
    states = tuple(torch.randn(2, 5, 32).to(torch.bfloat16) for _ in range(3))  # 2 layer inputs + the final state
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rewards = channel(states)
    assert rewards.dtype == torch.bfloat16
    torch.testing.assert_close(rewards.float(), channel(tuple(s.float() for s in states)), atol=0.05, rtol=0.02)


def test_mean_response_reward_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 7.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(mean_response_reward(rewards, mask), torch.tensor([2.5, 5.5]))
    # an empty mask gives 0, not NaN
    assert mean_response_reward(rewards[:1], torch.zeros(1, 4)).item() == 0.0


def test_bradley_terry_loss_by_hand():
    chosen_rewards = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    chosen_mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    rejected_rewards = torch.tensor([[0.5, 1.5, 9.0], [2.0, 0.0, 0.0]])
    rejected_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # margins: 2.5 − 1.0 = 1.5 and 0 − 2 = −2; −log σ(m) = log(1 + e^{−m}); batch mean
    expected = (math.log(1 + math.exp(-1.5)) + math.log(1 + math.exp(2.0))) / 2
    loss = bradley_terry_loss(chosen_rewards, chosen_mask, rejected_rewards, rejected_mask)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_padding_positions_do_not_change_the_loss():
    torch.manual_seed(0)
    chosen, rejected = torch.randn(3, 5), torch.randn(3, 4)
    chosen_mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    rejected_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    loss = bradley_terry_loss(chosen, chosen_mask, rejected, rejected_mask)

    def pad(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Three more positions of large garbage rewards under mask 0."""
        return (torch.cat([rewards, 100 * torch.randn(len(rewards), 3)], dim=1),
                torch.cat([mask, torch.zeros(len(mask), 3, dtype=mask.dtype)], dim=1))

    padded = bradley_terry_loss(*pad(chosen, chosen_mask), *pad(rejected, rejected_mask))
    torch.testing.assert_close(padded, loss)


def test_channel_has_one_distinct_module_per_layer(policy):
    channel = RewardTransformer(policy.model, HEADS["channel"]).head
    assert isinstance(channel, RewardChannel)
    num_layers = policy.model.config.num_hidden_layers
    for modules in (channel.layer_projs, channel.layer_norms):
        assert len(modules) == num_layers
        assert len({id(m) for m in modules}) == num_layers
        assert len({m.weight.data_ptr() for m in modules}) == num_layers


def test_head_parameter_counts(policy):
    d, num_layers, r = policy.model.config.hidden_size, policy.model.config.num_hidden_layers, 16
    count = {name: _num_params(RewardTransformer(policy.model, cfg).head) for name, cfg in HEADS.items()}
    # input norm + input proj (with bias) + per layer (norm + proj with bias over [h_p ; h_r]) + head (no bias)
    assert count["channel"] == d + (d * r + r) + num_layers * ((d + r) + (d + r) * r + r) + (d + r)
    assert count["adapter-1"] == d + 1  # a linear probe
    assert count["adapter-4"] == (d * r + r) + 2 * (r * r + r) + (r + 1)
    # §5.3's sizes for Llama-3-8B (d 4096, 32 layers): the channel's 35.7M are its 32 layer projections
    # (the input projection adds 1.05M: 36.9M in all); the adapters' "4K" and 50.3M are MLPs of width d
    assert _num_params(RewardChannel(4096, 32, 256).layer_projs) == pytest.approx(35.7e6, rel=0.002)
    assert _num_params(FinalStateAdapter(4096, 1)) == 4097
    assert _num_params(FinalStateAdapter(4096, 4, hidden_size=4096)) == pytest.approx(50.3e6, rel=0.002)
    assert isinstance(RewardTransformer(policy.model, HEADS["adapter-4"]).head, FinalStateAdapter)


@pytest.mark.parametrize("head", ["channel", "adapter-4"])
def test_save_and_load_head_roundtrip(policy, input_ids, head, tmp_path):
    torch.manual_seed(0)
    model = RewardTransformer(policy.model, HEADS[head])
    model.save_head(tmp_path / head)
    loaded = RewardTransformer.from_head(policy.model, tmp_path / head)
    assert loaded.head_config == HEADS[head]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).rewards, model(input_ids).rewards)
    with pytest.raises(FileNotFoundError, match="run the reward training stage"):
        RewardTransformer.from_head(policy.model, tmp_path / "missing")


def test_policy_is_frozen_by_default(policy, input_ids):
    model = RewardTransformer(policy.model, HEADS["channel"])
    assert not any(p.requires_grad for p in model.policy.parameters())
    assert all(p.requires_grad for p in model.head.parameters())
    out = model(input_ids)
    assert out.rewards.requires_grad and not out.logits.requires_grad  # no autograd graph through the policy
