"""Reward-head training and evaluation (models/sla/reward_training.py) and the Prefect task (tasks/sla.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from foresight.config import parse_config
from foresight.pairs import PAIR_COLUMNS
from foresight.storage import write_table
from models.engine.config import PolicySpec
from models.engine.policy import load_pretrained, prepare_policy
from models.sla.config import RewardTraining
from models.sla.reward_training import (
    LOGPROB,
    PairRewards,
    autrc,
    collate_pairs,
    evaluate_reward_head,
    evaluate_reward_heads,
    pair_accuracy,
    pair_curves,
    pair_wins,
    score_pairs,
    token_reward_curve,
    tokenize_pairs,
    train_reward_heads,
)
from models.sla.reward_transformer import RewardHeadConfig, RewardTransformer
from tests.helpers import DPO_FAST, long_response, make_pairs, tiny_params

ROOT = Path(__file__).resolve().parent.parent

CHANNEL = RewardHeadConfig(kind="channel", hidden_size=16)
# A fast, deterministic setting for the tiny model: a high rate, since it must learn within a few steps.
FAST = dict(learning_rate=1e-2, batch_size=4, epochs=4, warmup_ratio=0.0, max_length=64,
            curve_points=10, seed=0)


@pytest.fixture(scope="module")
def policy(tiny_llama):
    return load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))


def toy_pairs(tokenizer, count: int, start: int = 0) -> pd.DataFrame:
    """Separable pairs: every chosen response mentions apples, no rejected one does (it says cookies)."""
    names = ["Ben", "Ava", "Ivy", "Omar"]
    rows = []
    for i in range(start, start + count):
        name, n = names[i % len(names)], i % 9 + 1
        question = f"{name} has {n} apples. How many apples does {name} have?"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        rows.append({"prompt_id": f"p{i}", "question": question, "prompt": prompt, "answer": str(n),
                     "chosen": f"{name} has {n} apples. The answer is {n}.",
                     "rejected": f"The answer is {n + 1} cookies.",
                     "chosen_score": 1.0, "rejected_score": 0.0, "score_gap": 1.0,
                     "chosen_sample_id": f"p{i}/0", "rejected_sample_id": f"p{i}/1"})
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def test_tokenize_masks_exactly_the_response_and_end_token(policy):
    tok = policy.tokenizer
    pairs = toy_pairs(tok, 2)
    for item, (_, pair) in zip(tokenize_pairs(tok, pairs, max_length=128), pairs.iterrows(), strict=True):
        for side in ("chosen", "rejected"):
            ids, mask = item[f"{side}_input_ids"], item[f"{side}_response_mask"]
            assert len(ids) == len(mask) and mask == sorted(mask)  # prompt zeros, then response ones
            assert tok.decode([t for t, m in zip(ids, mask) if m]) == pair[side] + tok.eos_token
            assert tok.decode([t for t, m in zip(ids, mask) if not m]) == pair["prompt"]


def test_a_pair_is_dropped_whole_when_a_side_does_not_fit_never_cut(policy):
    """A 512-token response keeps its end token at a max_length that fits it whole; at one token less the pair is
    dropped and counted, where the old rule cut the end token off that side only (a biased comparison)."""

    tok = policy.tokenizer
    pairs = toy_pairs(tok, 3)
    pairs.loc[0, "chosen"] = long_response(tok, 512)
    prompt_len = len(tok(pairs["prompt"][0], add_special_tokens=False)["input_ids"])
    fitting = prompt_len + 512 + 1  # the prompt, the response and its end token
    item = tokenize_pairs(tok, pairs, max_length=fitting)[0]
    assert len(item["chosen_input_ids"]) == fitting and item["chosen_input_ids"][-1] == tok.eos_token_id
    assert sum(item["chosen_response_mask"]) == 512 + 1
    with pytest.raises(ValueError, match="longer than max_length"):
        tokenize_pairs(tok, pairs, max_length=fitting - 1)
    from models.sla.reward_training import fitting_pairs  # here: the old code fails above, not on this import

    kept, dropped = fitting_pairs(tok, pairs, fitting - 1)
    assert dropped == 1 and kept["prompt_id"].tolist() == ["p1", "p2"]
    assert fitting_pairs(tok, pairs, fitting)[1] == 0


def test_collate_right_pads_and_padding_leaves_rewards_unchanged(policy):
    tok = policy.tokenizer
    items = tokenize_pairs(tok, toy_pairs(tok, 3), max_length=128)
    batch = collate_pairs(items, pad_token_id=tok.pad_token_id)
    lengths = [len(p["chosen_input_ids"]) for p in items] + [len(p["rejected_input_ids"]) for p in items]
    assert batch["input_ids"].shape == (6, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert ((batch["response_mask"] == 1) <= (batch["attention_mask"] == 1)).all()  # padding is never response
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tok.pad_token_id).all()
    torch.manual_seed(0)
    model = RewardTransformer(policy.model, CHANNEL)
    with torch.no_grad():
        padded = model(batch["input_ids"], attention_mask=batch["attention_mask"]).rewards  # (2B, T)
        for row, length in enumerate(lengths):
            alone = model(batch["input_ids"][row: row + 1, :length]).rewards[0]  # (T_row,)
            torch.testing.assert_close(padded[row, :length], alone, atol=1e-5, rtol=0)


def test_one_step_trains_the_head_and_leaves_the_policy_bit_identical(policy):
    pairs = toy_pairs(policy.tokenizer, 4)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    torch.manual_seed(FAST["seed"])  # train_reward_heads seeds the same way: the same initial head
    initial_head = {k: v.clone() for k, v in RewardTransformer(policy.model, CHANNEL).head.state_dict().items()}
    cfg = RewardTraining(**{**FAST, "epochs": 1})
    models, histories = train_reward_heads(policy, pairs, cfg, {"channel": CHANNEL})
    model, history = models["channel"], histories["channel"]
    assert len(history["loss"]) == 1 and len(history["train_pair_accuracy"]) == 1
    assert history["learning_rate"] == [cfg.learning_rate]
    trained = model.head.state_dict()
    assert trained.keys() == initial_head.keys()
    assert not torch.equal(trained["layer_projs.0.weight"], initial_head["layer_projs.0.weight"])
    assert not torch.equal(trained["head.weight"], initial_head["head.weight"])
    after = policy.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(p.requires_grad for p in policy.model.parameters())


def test_half_precision_policy_trains_float32_master_weights(tiny_llama):
    """At the paper's lr 5e-5, Adam's steps are below bfloat16's resolution of the weights: a bf16 head would
    keep ~75 % of its weights at their initial value. The head trains in float32 and is cast back at the end;
    then the bf16 reward transformer scores pairs and decodes with SLA (no dtype mixing anywhere)."""
    from models.engine.generation import encode_prompt
    from models.sla.config import SLASearch
    from models.sla.search import sla_generate

    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="bfloat16"))
    head_config = RewardHeadConfig(kind="channel", hidden_size=256)
    torch.manual_seed(0)
    initial = RewardTransformer(policy.model, head_config).head.state_dict()
    cfg = RewardTraining(**{**FAST, "learning_rate": 5e-5, "batch_size": 2, "epochs": 3})  # 12 steps
    models, histories = train_reward_heads(policy, toy_pairs(policy.tokenizer, 8), cfg, {"channel": head_config})
    model, history = models["channel"], histories["channel"]
    trained = model.head.state_dict()
    assert all(v.dtype == torch.bfloat16 for v in trained.values())
    changed = sum((trained[k] != v).sum().item() for k, v in initial.items())
    assert changed / sum(v.numel() for v in initial.values()) > 0.6  # measured: 0.83 (0.25 when trained in bf16)
    assert all(math.isfinite(loss) for loss in history["loss"])

    scored = evaluate_reward_head(model, policy.tokenizer, toy_pairs(policy.tokenizer, 2, start=50), cfg)
    assert 0.0 <= scored["autrc"] <= 1.0
    prompt = encode_prompt(policy, toy_pairs(policy.tokenizer, 1)["prompt"][0])
    tokens, stats = sla_generate(model, prompt, SLASearch(depth=2, width=2, step=2), 6, set())
    assert len(tokens) == 6 and stats.steps == 3


@pytest.mark.parametrize("head", [CHANNEL, RewardHeadConfig(kind="adapter", adapter_layers=1)],
                         ids=["channel", "adapter-1"])
def test_learns_a_separable_toy_preference(policy, head):
    tok = policy.tokenizer
    train, held_out = toy_pairs(tok, 8), toy_pairs(tok, 6, start=100)
    cfg = RewardTraining(**FAST)
    models, histories = train_reward_heads(policy, train, cfg, {"head": head})
    model, history = models["head"], histories["head"]
    assert history["loss"][-1] < history["loss"][0]
    evaluation = evaluate_reward_head(model, tok, held_out, cfg)
    assert evaluation["pair_accuracy"] > 0.5
    assert len(evaluation["x"]) == len(evaluation["accuracy"]) == cfg.curve_points
    assert 0.0 <= evaluation["autrc"] <= 1.0
    # the per-pair values the intervals resample average to the reported figures
    assert len(evaluation["pair_correct"]) == len(evaluation["pair_autrc"]) == len(held_out)
    assert sum(evaluation["pair_correct"]) / len(held_out) == pytest.approx(evaluation["pair_accuracy"])
    assert sum(evaluation["pair_autrc"]) / len(held_out) == pytest.approx(evaluation["autrc"])


@pytest.mark.cuda
def test_reward_heads_train_on_a_bf16_policy_on_the_gpu(tiny_llama):
    """One training step on CUDA with the policy in bf16: heads beside the policy on the GPU, float32 master
    weights under autocast, trained heads back in bf16; then held-out scoring on the GPU."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cuda", dtype="bfloat16"))
    torch.manual_seed(FAST["seed"])
    initial = {k: v.cpu().clone() for k, v in RewardTransformer(policy.model, CHANNEL).head.state_dict().items()}
    cfg = RewardTraining(**{**FAST, "epochs": 1})
    models, histories = train_reward_heads(policy, toy_pairs(policy.tokenizer, 4), cfg, {"channel": CHANNEL})
    model = models["channel"]
    assert {(p.device.type, p.dtype) for p in model.head.parameters()} == {("cuda", torch.bfloat16)}
    assert len(histories["channel"]["loss"]) == 1 and math.isfinite(histories["channel"]["loss"][0])
    trained = model.head.state_dict()
    assert any(not torch.equal(trained[k].cpu(), v) for k, v in initial.items())
    evaluation = evaluate_reward_head(model, policy.tokenizer, toy_pairs(policy.tokenizer, 2, start=50), cfg)
    assert 0.0 <= evaluation["autrc"] <= 1.0


def test_training_and_scoring_compute_the_logits_of_one_position_only(policy):
    """The reward loss needs the policy's hidden states, not its (2B, T, V) logits: at 8B with a 128k
    vocabulary those were the largest tensor of every training batch. Read off the LM head's real outputs."""
    shapes = []
    hook = policy.model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(out.shape))
    try:
        pairs = toy_pairs(policy.tokenizer, 4)
        cfg = RewardTraining(**{**FAST, "epochs": 1})
        models, _ = train_reward_heads(policy, pairs, cfg, {"channel": CHANNEL})
        evaluate_reward_head(models["channel"], policy.tokenizer, pairs, cfg)
    finally:
        hook.remove()
    assert len(shapes) == 2  # one training batch, one scoring batch
    assert all(shape[1] == 1 for shape in shapes), shapes


def test_cached_policy_states_train_the_heads_as_the_policy_forward_does(policy):
    """The frozen policy's states of the distinct training sequences, computed once (a response sits in several pairs
    and every epoch), give the heads the losses and weights a policy forward at every step gives; with
    ``state_cache_gb`` 0 the policy runs at every step instead."""
    pairs = toy_pairs(policy.tokenizer, 4)
    pairs = pd.concat([pairs, pairs.assign(rejected=pairs["rejected"][::-1].to_numpy())], ignore_index=True)
    cfg = RewardTraining(**{**FAST, "epochs": 2})  # 8 pairs, 12 distinct sequences: 2 × 2 steps
    adapter = RewardHeadConfig(kind="adapter", adapter_layers=2, hidden_size=8)
    forwards = []
    hook = policy.model.register_forward_hook(lambda module, args, kwargs_out: forwards.append(1))
    try:
        cached, cached_histories = train_reward_heads(policy, pairs, cfg, {"channel": CHANNEL, "adapter": adapter})
        cached_forwards = len(forwards)
        forwards.clear()
        fresh, fresh_histories = train_reward_heads(policy, pairs, cfg.model_copy(update={"state_cache_gb": 0.0}),
                                                    {"channel": CHANNEL, "adapter": adapter})
    finally:
        hook.remove()
    assert (cached_forwards, len(forwards)) == (2, 4)  # 12 sequences in batches of 8 once; a forward per step
    for name in ("channel", "adapter"):
        assert cached_histories[name]["loss"] == pytest.approx(fresh_histories[name]["loss"], abs=1e-5)
        for key, value in fresh[name].head.state_dict().items():
            if key == "mlp.2.bias":  # the adapter's output bias: the BT loss sees reward differences only, so its
                continue  # gradient is 0 in exact arithmetic and Adam turns the rounding noise into full steps
            torch.testing.assert_close(cached[name].head.state_dict()[key], value, atol=1e-5, rtol=1e-4)


def test_joint_training_equals_training_each_head_alone(policy, tiny_llama):
    """One shared policy pass per batch: each head gets exactly its own gradient, Adam is element-wise; and one
    scores exactly as it does alone."""
    pairs = toy_pairs(policy.tokenizer, 6)
    cfg = RewardTraining(**{**FAST, "epochs": 2})
    adapter = RewardHeadConfig(kind="adapter", adapter_layers=2, hidden_size=8)
    joint, joint_histories = train_reward_heads(policy, pairs, cfg, {"channel": CHANNEL, "adapter": adapter})
    alone, alone_histories = train_reward_heads(policy, pairs, cfg, {"channel": CHANNEL})
    for key, value in alone["channel"].head.state_dict().items():
        torch.testing.assert_close(joint["channel"].head.state_dict()[key], value, atol=1e-6, rtol=1e-5)
    assert joint_histories["channel"]["loss"] == pytest.approx(alone_histories["channel"]["loss"], abs=1e-6)
    assert joint["adapter"].head is not joint["channel"].head and joint["adapter"].policy is policy.model

    # evaluated together (one policy pass per batch), each head scores exactly as it does alone
    held_out = toy_pairs(policy.tokenizer, 3, start=50)
    torch.manual_seed(0)
    heads = {**joint, "untrained": RewardTransformer(policy.model, RewardHeadConfig(kind="adapter", adapter_layers=1))}
    together = evaluate_reward_heads(heads, policy.tokenizer, held_out, cfg)
    for name, model in heads.items():
        assert together[name] == evaluate_reward_head(model, policy.tokenizer, held_out, cfg)
    assert together["untrained"] != together["channel"]  # each head its own column, not one head's scores twice
    other = RewardTransformer(load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32")).model, CHANNEL)
    with pytest.raises(ValueError, match="share one policy"):
        evaluate_reward_heads({"a": joint["channel"], "b": other}, policy.tokenizer, held_out, cfg)


def test_logprob_ranker_scores_each_response_token_by_the_policys_log_prob(policy):
    """score_pairs(logprobs=True) gives, from the reward forward itself, log π(y_t | x, y_<t) of exactly the response
    tokens (end token included), as a plain one-sequence forward computes them, in padded batches, and the same
    rewards as without; pair_wins then compares their means; evaluate_reward_heads reports that ranker beside the
    heads from the same forwards."""
    pairs = toy_pairs(policy.tokenizer, 3)
    model = RewardTransformer(policy.model, CHANNEL)
    scored = score_pairs(model, policy.tokenizer, pairs, max_length=64, batch_size=2, logprobs=True)
    tokenized = tokenize_pairs(policy.tokenizer, pairs, 64)
    for p, item in enumerate(tokenized):
        for side, got in (("chosen", scored.logprobs.chosen[p]), ("rejected", scored.logprobs.rejected[p])):
            ids, mask = torch.tensor(item[f"{side}_input_ids"]), torch.tensor(item[f"{side}_response_mask"]).bool()
            with torch.no_grad():
                logps = policy.model(input_ids=ids[None]).logits[0].float().log_softmax(-1)  # (T, V)
            positions = mask.nonzero()[:, 0]  # response tokens, each predicted from the position before it
            torch.testing.assert_close(got, logps[positions - 1, ids[positions]], atol=1e-5, rtol=0)
    rewards_only = score_pairs(model, policy.tokenizer, pairs, max_length=64, batch_size=2)
    assert rewards_only.logprobs is None
    for got, want in zip(scored.rewards.chosen + scored.rewards.rejected,
                         rewards_only.rewards.chosen + rewards_only.rewards.rejected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    wins = pair_wins(scored.logprobs)
    assert wins.tolist() == [float(c.mean() > r.mean()) for c, r in zip(scored.logprobs.chosen,
                                                                         scored.logprobs.rejected)]
    cfg = RewardTraining(**FAST)
    evaluation = evaluate_reward_heads({"channel": model}, policy.tokenizer, pairs, cfg, logprobs=True)
    assert evaluation[LOGPROB]["pair_correct"] == wins.tolist()
    assert evaluation["channel"] == evaluate_reward_head(model, policy.tokenizer, pairs, cfg)


def test_reward_curve_and_autrc_by_hand():
    scored = PairRewards(
        chosen=[torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([5.0])],
        rejected=[torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0, 9.0, 0.0])],
    )
    xs, accuracies = token_reward_curve(scored, points=4)
    assert xs == [0.25, 0.5, 0.75, 1.0]
    # prefix lengths ⌈x·T⌉: pair 1 chosen 1,2,3,4 vs rejected 1,1,2,2 → 0>1 F, 1>1 F, 2>1 T, 3>1 T
    #                       pair 2 chosen 1,1,1,1 vs rejected 1,2,3,4 → 5>0 T, 5>0 T, 5>9 F, 5>0 T
    assert pair_curves(scored, points=4)[1].tolist() == [[0, 0, 1, 1], [1, 1, 0, 1]]
    assert accuracies == [0.5, 0.5, 0.5, 1.0]
    # trapezoid: 0.25 · (0.5 + 0.5 + 0.75) = 0.4375 over the width 0.75
    assert autrc(xs, accuracies) == pytest.approx(0.4375 / 0.75)
    # per pair: 0.25 · (0 + 0.5 + 1) / 0.75 = 0.5 and 0.25 · (1 + 0.5 + 0.5) / 0.75 = 2/3; their mean is the AuTRC
    assert [autrc(xs, [0, 0, 1, 1]), autrc(xs, [1, 1, 0, 1])] == [pytest.approx(0.5), pytest.approx(2 / 3)]
    assert (0.5 + 2 / 3) / 2 == pytest.approx(0.4375 / 0.75)
    assert pair_accuracy(scored) == 1.0 and pair_wins(scored).tolist() == [1.0, 1.0]  # 1.5 > 1.0, 5.0 > 2.25
    tie = PairRewards(chosen=[torch.tensor([1.0, 2.0])], rejected=[torch.tensor([1.0, 2.0])])
    assert pair_accuracy(tie) == 0.0 and token_reward_curve(tie, points=3)[1] == [0.0, 0.0, 0.0]
    assert autrc([0.01, 1.0], [1.0, 1.0]) == pytest.approx(1.0)


def test_intervals_resample_prompts_not_pairs():
    """Held-out pairs of one prompt share its responses: the intervals are a bootstrap over prompts."""
    from foresight.statistics import ratio_of_means
    from tasks.sla import with_intervals

    evaluation = {"pair_accuracy": 0.75, "pair_correct": [1.0, 1.0, 0.0, 1.0], "x": [1.0], "accuracy": [0.75]}
    result = with_intervals(evaluation, ["a", "a", "b", "c"], {"pair_accuracy": "pair_correct"})
    # per prompt (right, pairs): a (2, 2), b (0, 1), c (1, 1)
    expected = ratio_of_means([2.0, 0.0, 1.0], [2.0, 1.0, 1.0])
    assert (result["pair_accuracy"], result["pair_accuracy_low"], result["pair_accuracy_high"]) == (
        0.75, expected.low, expected.high)
    assert result["pair_accuracy_significant"] == expected.excludes(0.5)
    assert (result["num_pairs"], result["num_prompts"]) == (4, 3) and "pair_correct" not in result


@pytest.fixture()
def reward_cfg(tiny_llama, tmp_path):
    """A tiny project under tmp_path: prepared policy and 8 toy pairs."""
    cfg = parse_config(tiny_params(tmp_path, tiny_llama, reward={**FAST, "hidden_size": 16, "epochs": 1},
                                   paths={"dpo_dir": str(tiny_llama)}), root=tmp_path)
    spec = cfg.policy
    prepare_policy(spec, cfg.path(cfg.paths.policy_dir))
    tokenizer = load_pretrained(tiny_llama, spec).tokenizer
    write_table(toy_pairs(tokenizer, 8), cfg.path(cfg.paths.pairs))
    return cfg


def test_task_writes_heads_curves_plots_and_metrics(reward_cfg):
    from tasks.sla import train_reward_task

    out_dir = reward_cfg.path(reward_cfg.paths.reward_dir) / "base"
    result = train_reward_task.fn(reward_cfg, "base", out_dir)
    heads = ["channel", "adapter-1", "adapter-4"]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        heads + ["curves.json", "history.json", "split.json", "autrc.png", "loss.png"])
    m = result.metrics
    assert (m["num_train_pairs"], m["num_eval_pairs"]) == (6, 2)  # eval_fraction 0.25 of 8 prompts
    assert (m["num_train_pairs_dropped_too_long"], m["num_eval_pairs_dropped_too_long"]) == (0, 0)
    split = json.loads((out_dir / "split.json").read_text())  # what the SLA benchmark must not tune on
    assert len(split["train_prompt_ids"]) == 6 and len(split["held_out_prompt_ids"]) == 2
    assert not set(split["train_prompt_ids"]) & set(split["held_out_prompt_ids"])
    # the policy's own log-prob ranks the same held-out pairs, with its interval over their prompts
    assert m["pair_accuracy_logprob_low"] <= m["pair_accuracy_logprob"] <= m["pair_accuracy_logprob_high"]
    assert isinstance(m["pair_accuracy_logprob_significant"], bool)
    for key in ("channel", "adapter1", "adapter4"):
        assert 0.0 <= m[f"pair_accuracy_{key}"] <= 1.0 and 0.0 <= m[f"autrc_{key}"] <= 1.0
        for figure in (f"pair_accuracy_{key}", f"autrc_{key}"):  # intervals over the 2 held-out prompts
            assert m[f"{figure}_low"] <= m[figure] <= m[f"{figure}_high"], figure
            assert isinstance(m[f"{figure}_significant"], bool)
        assert m[f"{key}_params"] > 0
    assert m["train_seconds"] > 0  # all heads train in one pass
    assert m["adapter1_params"] == 32 + 1 and m["channel_params"] > m["adapter1_params"]  # tiny Llama: d = 32
    curves = json.loads((out_dir / "curves.json").read_text())
    assert set(curves) == set(heads) and len(curves["channel"]["accuracy"]) == reward_cfg.reward.curve_points
    assert {"autrc_low", "autrc_high", "pair_accuracy_low", "pair_accuracy_high"} <= set(curves["channel"])
    assert (curves["channel"]["num_pairs"], curves["channel"]["num_prompts"]) == (2, 2)
    assert "pair_correct" not in curves["channel"] and "pair_autrc" not in curves["channel"]
    assert set(json.loads((out_dir / "history.json").read_text())) == set(heads)
    assert result.artifacts == {"reward": out_dir}
    policy = load_pretrained(reward_cfg.policy.model, reward_cfg.policy)
    assert RewardTransformer.from_head(policy.model, out_dir / "adapter-4").head_config.adapter_layers == 4


def test_task_on_the_dpo_policy_writes_all_or_nothing(reward_cfg, monkeypatch):
    import tasks.sla
    from tasks.sla import train_reward_task

    out_dir = reward_cfg.path(reward_cfg.paths.reward_dir) / "dpo"
    out_dir.mkdir(parents=True)
    (out_dir / "previous.txt").write_text("the last good result")

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tasks.sla, "plot_losses", fail)  # the last write: everything else is done
    with pytest.raises(RuntimeError, match="disk full"):
        train_reward_task.fn(reward_cfg.model_copy(update={"reward": reward_cfg.reward.model_copy(
            update={"adapter_layers": []})}), "dpo", out_dir)
    assert [p.name for p in out_dir.iterdir()] == ["previous.txt"]
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_task_fails_clearly_on_too_few_pairs_or_an_unknown_source(reward_cfg):
    from tasks.sla import train_reward_task

    out_dir = reward_cfg.path(reward_cfg.paths.reward_dir) / "base"
    with pytest.raises(ValueError, match="policy_source"):
        train_reward_task.fn(reward_cfg, "sft", out_dir)
    pairs_path = reward_cfg.path(reward_cfg.paths.pairs)
    write_table(pd.read_parquet(pairs_path).head(1), pairs_path)
    with pytest.raises(ValueError, match="needs at least 2"):
        train_reward_task.fn(reward_cfg, "base", out_dir)
    assert not out_dir.exists()


# ---------------------------------------------------------------------------------------------------
# several processes: one launch of 2 CPU processes checks the reward heads and DPO


TWO_RANKS = RewardTraining(**{**FAST, "batch_size": 2, "epochs": 2})  # per process: 2 × 2 = one 4-pair batch
TWO_RANKS_DPO = DPO_FAST.model_copy(update={"batch_size": 1, "epochs": 1})  # per process: 2 × 1 = one 2-pair batch


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in tensors])


def _train_on_two_ranks(tiny_llama: str, out_dir: str) -> None:
    """Run by each of 2 processes: reward heads, then DPO, each on this rank's share of the batches; the
    trained parameters must be identical on both ranks (gradients all-reduced). The main process keeps what
    the test compares with a 1-process run."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from models.sla import dpo

    AcceleratorState._reset_state(True)  # the forked process inherits the parent's single-process state
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    policy = load_pretrained(Path(tiny_llama), PolicySpec(device="cpu", dtype="float32"))

    models, histories = train_reward_heads(policy, toy_pairs(policy.tokenizer, 8), TWO_RANKS, {"channel": CHANNEL},
                                           accelerator)
    head = _flat(models["channel"].head.parameters())
    assert torch.equal(*accelerator.gather(head[None])), "the reward heads differ between the ranks"

    saved = []  # the model train_dpo saves on this rank (only the main process writes it)
    real_trained_policy = dpo.trained_policy

    def keep(trainer, initial):
        model, state_dict = real_trained_policy(trainer, initial)
        saved.append(model)
        return model, state_dict

    dpo.trained_policy = keep
    dpo.cpu_has_bf16_units = lambda: False  # float32, as in the 1-process run: exact equality is a float32 property
    metrics = dpo.train_dpo(policy, make_pairs(policy.tokenizer, 4), TWO_RANKS_DPO, Path(out_dir) / "dpo")
    weights = _flat(saved[0].parameters())
    assert torch.equal(*accelerator.gather(weights[None])), "the DPO policies differ between the ranks"
    if accelerator.is_main_process:
        torch.save({"head": head, "loss": histories["channel"]["loss"], "dpo": metrics}, Path(out_dir) / "ranks.pt")


def test_reward_heads_and_dpo_train_identically_on_two_processes(policy, tiny_llama, tmp_path, monkeypatch):
    """2 processes with B pairs each train exactly what 1 process trains with 2B pairs per batch: the same
    parameters on both ranks, equal to the 1-process run (gradients averaged across processes = the mean over
    the global batch), and DPO's folder written once, by the main process.

    The ranks are forked from a fresh interpreter (as in tests/test_training_loop.py): forked from this test
    process they would inherit whatever ran before (threads of a Prefect test server, say).
    """
    from safetensors.torch import load_file

    from models.sla.dpo import train_dpo

    launch = ("from accelerate import debug_launcher; from tests.test_reward_training import _train_on_two_ranks; "
              f"debug_launcher(_train_on_two_ranks, args=({str(tiny_llama)!r}, {str(tmp_path)!r}), num_processes=2)")
    result = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = torch.load(tmp_path / "ranks.pt")

    models, histories = train_reward_heads(policy, toy_pairs(policy.tokenizer, 8),
                                           TWO_RANKS.model_copy(update={"batch_size": 4}), {"channel": CHANNEL})
    torch.testing.assert_close(_flat(models["channel"].head.parameters()), ranks["head"], atol=1e-6, rtol=0)
    assert ranks["loss"] == pytest.approx(histories["channel"]["loss"], abs=1e-6)

    monkeypatch.setattr("models.sla.dpo.cpu_has_bf16_units", lambda: False)  # float32 in both runs (see the ranks)
    metrics = train_dpo(policy, make_pairs(policy.tokenizer, 4), TWO_RANKS_DPO.model_copy(update={"batch_size": 2}),
                        tmp_path / "dpo-one-process")
    assert metrics["steps"] == ranks["dpo"]["steps"] == 2
    assert ranks["dpo"]["train_loss"] == pytest.approx(metrics["train_loss"], abs=1e-6)
    one, two = (load_file(tmp_path / folder / "model.safetensors") for folder in ("dpo-one-process", "dpo"))
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        # Adam divides by √v: where a gradient is ~0, float noise of the padding (each process pads its own
        # batch, to its own length) moved one weight by 3e-6; a gradient not averaged moves weights by ~lr 1e-3
        torch.testing.assert_close(two[name], tensor, atol=1e-5, rtol=0)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no second writer's leftovers
