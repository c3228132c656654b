"""Streaming Looking-Ahead decoding (models/sla/search.py) on a tiny random Llama with a seeded random reward head.

The key test compares the cached, batched, streaming implementation with a brute-force reference
written here: an explicit tree rebuilt from scratch at every step, every sequence recomputed with a
full no-cache forward. They must agree token for token.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import pytest
import torch

from models.sla.config import SLASearch
from models.sla.reward_transformer import RewardTransformer
from models.sla.search import (
    Node,
    SLAStats,
    backup,
    greedy_generate,
    select_action,
    sla_generate,
    sla_generate_batch,
    sla_stream,
)
from tasks.sla import SPLIT_FILE, choose_setting, tuning_split
from tests.helpers import tiny_params
from tests.tiny import load_spiky_tiny_llama

QUESTIONS = ["Ben has 4 apples. How many?", "Ivy has 3 cookies and gives 1 to Omar.", "0 1 2 3", "What is 7 * 8?"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """(RewardTransformer, tokenizer, prompt ids list) on the tiny Llama with spiky weights."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    policy = load_spiky_tiny_llama(tiny_llama)
    torch.manual_seed(0)
    model = RewardTransformer(policy).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt")["input_ids"] for q in QUESTIONS]
    # One thread: a 32-wide model gains nothing from more, and on shared CPUs OpenMP threads that wait
    # for each other made this file 4× slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tok, prompts
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eos(tiny):
    """An end token the model really emits: the most frequent token of the prompts' greedy outputs."""
    model, _, prompts = tiny
    outputs = [greedy_generate(model, ids, 24, set())[0] for ids in prompts]
    token = Counter(t for out in outputs for t in out).most_common(1)[0][0]
    assert any(token in out[:-1] for out in outputs)  # some greedy run stops early on it
    return {token}


# ---------------------------------------------------------------------------------------------------
# brute-force reference: no cache, explicit tree, everything recomputed


_MEMO: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}


@torch.no_grad()
def full_forward(model, seq: list[int]):
    """Last-position logits (V,) and all rewards (T,) of a full forward without cache. Memoised per
    sequence (a pure function of it: the module uses one model), so rebuilding the tree costs nothing twice."""
    key = (id(model), *seq)
    if key not in _MEMO:
        out = model(input_ids=torch.tensor([seq]))
        _MEMO[key] = out.logits[0, -1], out.rewards[0]
    return _MEMO[key]


def ref_segment(model, seq: list[int], first: int, n: int, eos: set[int]) -> list[int]:
    tokens = [first]
    while tokens[-1] not in eos and len(tokens) < n:
        tokens.append(int(full_forward(model, seq + tokens)[0].argmax()))
    return tokens


def reference_sla(model, prompt: list[int], d: int, k: int, n: int, max_new: int, eos: set[int],
                  leaf_score: str = "mean"):
    """SLA(d, k, n) by brute force: at each step build the depth-d tree below the committed text from
    scratch, Q = best leaf below (its mean response reward, or with ``leaf_score="last"`` the reward at its last
    token), commit the argmax first-level child (first wins ties). Returns (tokens, number of finished nodes met
    in the trees)."""
    finished_seen = 0

    def q_value(path: list[int], level: int, response: list[int]) -> float:
        nonlocal finished_seen
        logits, rewards = full_forward(model, prompt + response + path)
        response_rewards = rewards[len(prompt):].tolist()
        score = sum(response_rewards) / len(response + path) if leaf_score == "mean" else response_rewards[-1]
        if path[-1] in eos:
            finished_seen += 1
            return score
        if level == d:
            return score
        seq = prompt + response + path
        return max(q_value(path + ref_segment(model, seq, t, n, eos), level + 1, response)
                   for t in logits.topk(k).indices.tolist())

    response: list[int] = []
    while True:
        seq = prompt + response
        logits, _ = full_forward(model, seq)
        children = [ref_segment(model, seq, t, n, eos) for t in logits.topk(k).indices.tolist()]
        q = [q_value(child, 1, response) for child in children]
        best = children[q.index(max(q))]  # first maximum
        response += best
        if best[-1] in eos or len(response) >= max_new:
            return response[:max_new], finished_seen


# ---------------------------------------------------------------------------------------------------


def test_greedy_matches_hf_generate_and_full_forward_rewards(tiny, eos):
    model, tok, prompts = tiny
    stopped_early = 0
    for ids in prompts:
        for eos_ids in (eos, {tok.eos_token_id}):
            tokens, rewards = greedy_generate(model, ids, 20, eos_ids)
            hf = model.policy.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                       eos_token_id=sorted(eos_ids), pad_token_id=tok.pad_token_id)
            assert tokens == hf[0, ids.shape[1]:].tolist()
            stopped_early += len(tokens) < 20
            _, full = full_forward(model, ids[0].tolist() + tokens)
            torch.testing.assert_close(torch.tensor(rewards), full[ids.shape[1]:], atol=1e-5, rtol=0)
    assert stopped_early > 0


def test_depth_zero_and_width_one_are_greedy(tiny, eos):
    model, _, prompts = tiny
    for ids in prompts[:3]:
        greedy, _ = greedy_generate(model, ids, 17, eos)
        for cfg in (SLASearch(depth=0, width=3, step=4), SLASearch(depth=0, width=1, step=1),
                    SLASearch(depth=2, width=1, step=3), SLASearch(depth=3, width=1, step=5)):
            assert sla_generate(model, ids, cfg, 17, eos)[0] == greedy, cfg


@pytest.mark.parametrize(("d", "k", "n", "leaf_score"), [(2, 2, 3, "mean"), (1, 3, 2, "mean"), (3, 2, 2, "mean"),
                                                        (2, 3, 4, "mean"), (2, 2, 3, "last"), (1, 3, 2, "last")])
def test_sla_equals_brute_force_reference(tiny, eos, d, k, n, leaf_score):
    """Caching, batching, cache re-indexing and subtree reuse against a from-scratch reference, under either leaf
    score."""
    model, tok, prompts = tiny
    finished = 0
    never = {tok.eos_token_id}  # never emitted by this model: full-length trees only
    runs = [(ids, eos) for ids in prompts] + [(ids, never) for ids in prompts[2:]]
    cfg = SLASearch(depth=d, width=k, step=n, leaf_score=leaf_score)
    for ids, eos_ids in runs:
        expected, seen = reference_sla(model, ids[0].tolist(), d, k, n, 20, eos_ids, leaf_score)
        finished += seen
        assert sla_generate(model, ids, cfg, 20, eos_ids)[0] == expected
    assert finished > 0  # trees with finished (end-token) branches were exercised


def test_leaf_scores_differ_and_change_the_output(tiny, eos):
    """The two leaf scores are different searches: some prompt decodes differently (a random head)."""
    model, _, prompts = tiny
    outputs = {how: [sla_generate(model, ids, SLASearch(depth=2, width=2, step=3, leaf_score=how), 14, eos)[0]
                     for ids in prompts] for how in ("mean", "last")}
    assert outputs["mean"] != outputs["last"]



@pytest.mark.parametrize(("d", "k", "n"), [(2, 2, 3), (1, 3, 2), (0, 2, 4)])
def test_a_batch_of_prompts_decodes_as_each_prompt_alone(tiny, eos, d, k, n):
    """Prompts of four lengths searched in lockstep (left padding, masks and positions re-indexed with the cache,
    prompts dropping out when done) give each prompt's one-prompt output, token for token (float32)."""
    model, tok, prompts = tiny
    assert len({ids.shape[1] for ids in prompts}) == len(prompts)  # every prompt is padded but the longest
    cfg = SLASearch(depth=d, width=k, step=n)
    alone = [sla_generate(model, ids, cfg, 20, eos)[0] for ids in prompts]
    assert len({len(tokens) for tokens in alone}) > 1  # some prompts stop early on the end token, some do not
    stats = SLAStats()
    assert sla_generate_batch(model, prompts, cfg, 20, eos, tok.pad_token_id or 0, stats) == alone
    assert stats.committed_tokens == sum(len(tokens) for tokens in alone)
    with pytest.raises(ValueError, match="non-empty list"):
        sla_generate_batch(model, [], cfg, 20, eos, 0)

def test_backup_takes_the_best_leaf_and_ties_go_to_the_likelier_child():
    def node(total, count, *children, finished=False):
        return Node(tokens=[0], reward_sum=total, reward_count=count, finished=finished, children=list(children))

    root = node(0.0, 0,
                node(1.0, 2, node(1.0, 4), node(3.0, 4)),  # Q = 0.75 (deepest leaves), not its own 0.5
                node(3.0, 4, finished=True),  # a finished node is a leaf: Q = 0.75, a tie → index 0 wins
                node(0.0, 2, node(2.0, 4), node(-1.0, 4)))  # Q = 0.5
    assert [backup(c) for c in root.children] == [0.75, 0.75, 0.5]
    assert select_action(root) == 0
    root.children[1].reward_sum = 3.2
    assert select_action(root) == 1


def test_last_token_leaf_score_by_hand():
    """Mean R' over the response against R' at the last token: child 0's leaves average higher, child 1 ends on the
    highest reward, so the two scorings choose different actions."""
    def node(total, count, last, *children):
        return Node(tokens=[0], reward_sum=total, reward_count=count, last_reward=last, children=list(children))

    root = node(0.0, 0, 0.0,
                node(2.0, 2, 0.5, node(4.0, 4, 0.2)),  # mean 1.0 at its leaf, last reward 0.2
                node(0.4, 2, 0.1, node(0.8, 4, 0.9), node(1.2, 4, 0.4)))  # means 0.2 / 0.3; last 0.9 / 0.4
    assert [backup(c) for c in root.children] == pytest.approx([1.0, 0.3])
    assert [backup(c, "last") for c in root.children] == [0.2, 0.9]
    assert (select_action(root), select_action(root, "last")) == (0, 1)


def test_search_changes_the_output(tiny, eos):
    """Not a no-op: with a random head, SLA departs from greedy on some prompt."""
    model, _, prompts = tiny
    cfg = SLASearch(depth=2, width=2, step=3)
    assert any(sla_generate(model, ids, cfg, 14, eos)[0] != greedy_generate(model, ids, 14, eos)[0] for ids in prompts)


def test_stream_determinism_stopping_and_stats(tiny, eos):
    model, _, prompts = tiny
    cfg = SLASearch(depth=2, width=2, step=3)
    for ids in prompts:
        tokens, stats = sla_generate(model, ids, cfg, 13, eos)
        assert sla_generate(model, ids, cfg, 13, eos) == (tokens, stats)  # deterministic
        live = SLAStats()
        chunks = list(sla_stream(model, ids, cfg, 13, eos, live))
        assert [t for c in chunks for t in c] == tokens and live == stats
        assert all(len(c) == 3 for c in chunks[:-1]) and 1 <= len(chunks[-1]) <= 3
        assert not any(t in eos for t in tokens[:-1])  # nothing after an end token
        assert len(tokens) == 13 or tokens[-1] in eos  # exactly max_new_tokens, or stopped on eos
        assert stats.committed_tokens == len(tokens) and stats.steps == len(chunks)

    # exact truncation at max_new_tokens (not a multiple of n), no end token at all
    tokens, stats = sla_generate(model, prompts[0], cfg, 7, set())
    assert len(tokens) == 7 and stats.steps == 3
    # the stop path: some prompt ends on the end token before max_new_tokens
    assert any(sla_generate(model, ids, cfg, 40, eos)[0][-1] in eos for ids in prompts)
    assert sla_generate(model, prompts[0], cfg, 0, eos)[0] == []


def test_work_grows_with_depth(tiny):
    model, _, prompts = tiny
    ids = prompts[1]
    runs = {d: sla_generate(model, ids, SLASearch(depth=d, width=2, step=4), 16, set())[1] for d in (0, 1, 2, 3)}
    greedy = SLAStats()
    greedy_generate(model, ids, 16, set(), greedy)
    assert runs[0].forward_calls == greedy.forward_calls == 17  # prefill + one forward per token
    assert runs[0].tokens_processed == greedy.tokens_processed == ids.shape[1] + 16
    for d in (1, 2, 3):
        # one level of n one-token forwards per committed step, plus d − 1 extra levels to build the first tree
        assert runs[d].forward_calls == 1 + 4 * (4 + d - 1)
        assert runs[d].tokens_processed == ids.shape[1] + 4 * sum(min(2 ** d, 2 ** (s + 1)) for s in range(4 + d - 1))
        assert runs[d].steps == 4 and runs[d].committed_tokens == 16
    assert [runs[d].tokens_processed for d in range(4)] == sorted(runs[d].tokens_processed for d in range(4))


# ---------------------------------------------------------------------------------------------------
# precision, devices and the benchmark


def _prompts_and_model(tiny_llama, **load):
    """The spiky tiny policy loaded with ``load`` (device_map / dtype), a seeded random channel, and the
    prompts' ids on the CPU."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    torch.manual_seed(0)
    model = RewardTransformer(load_spiky_tiny_llama(tiny_llama, **load)).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_tensors="pt")["input_ids"] for q in QUESTIONS]
    return model, prompts


def test_bf16_policy_decodes_with_sla(tiny_llama):
    """A bf16 policy and head (no dtype mixing): width 1 is greedy token for token (the same one-token
    forwards), and the search runs to length. Equality with a float32 run is not asserted: bf16 rounds near-ties."""
    model, prompts = _prompts_and_model(tiny_llama, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for ids in prompts[:2]:
        greedy, rewards = greedy_generate(model, ids, 9, set())
        assert len(greedy) == 9 and all(math.isfinite(r) for r in rewards)
        assert sla_generate(model, ids, SLASearch(depth=2, width=1, step=3), 9, set())[0] == greedy
        tokens, stats = sla_generate(model, ids, SLASearch(depth=2, width=2, step=3), 9, set())
        assert len(tokens) == 9 and stats.steps == 3


@pytest.mark.cuda
def test_sla_and_greedy_decode_on_the_gpu_in_bf16(tiny_llama):
    """On CUDA in bf16, from prompt ids left on the CPU: the forwards take the ids to the model's device and
    the cache re-indexing (``reorder_cache``) gets its rows there. Not compared with greedy token for token:
    on the GPU argmax and top-k may break bf16 ties differently."""
    model, prompts = _prompts_and_model(tiny_llama, dtype=torch.bfloat16, device_map="cuda")
    assert next(model.head.parameters()).device.type == "cuda"
    for ids in prompts[:2]:
        greedy, rewards = greedy_generate(model, ids, 9, set())
        assert len(greedy) == 9 and all(math.isfinite(r) for r in rewards)
        cfg = SLASearch(depth=2, width=2, step=3)
        tokens, stats = sla_generate(model, ids, cfg, 9, set())
        assert len(tokens) == 9 and stats.steps == 3 and stats.forward_calls == 1 + 3 * (3 + 1)
        assert sla_generate(model, ids, cfg, 9, set())[0] == tokens  # deterministic


def test_forward_overhead_times_interleaved_pairs_between_synchronisations(tiny, monkeypatch):
    """CUDA kernels run asynchronously: without a synchronise on both sides a timing measures the launches.
    On the CPU the order of the calls is what can be checked: warm-up pairs, then pairs of (policy alone,
    policy + channel) whose order alternates, each decode step on a fresh copy of the prompt's cache."""
    import tasks.sla

    model, _, prompts = tiny
    ids = prompts[0]
    events, inputs = [], []
    monkeypatch.setattr(tasks.sla, "synchronize", lambda: events.append("sync"))

    def record_inputs(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers ≥ 5.24, before
        inputs.append((kwargs["input_ids"].shape[1], cache.get_seq_length() if cache is not None else 0))

    hooks = [model.policy.register_forward_hook(lambda *_: events.append("forward")),
             model.head.register_forward_hook(lambda *_: events.append("channel")),
             model.policy.register_forward_pre_hook(record_inputs, with_kwargs=True)]
    try:
        rows = tasks.sla.forward_overhead(model, ids, repeats=3, warm_up=2)
    finally:
        for hook in hooks:
            hook.remove()
    policy, joint = ["sync", "forward", "sync"], ["sync", "forward", "channel", "sync"]
    pairs = [policy + joint if repeat % 2 == 0 else joint + policy for repeat in range(-2, 3)]
    per_forward = [event for pair in pairs for event in pair]
    assert events == ["forward"] + per_forward * 2  # the prompt's cache once, then decode steps and prompts
    length = ids.shape[1]
    assert inputs == [(length - 1, 0)] + [(1, length - 1)] * 10 + [(length, 0)] * 10
    assert [row["forward"] for row in rows] == ["decode step", "prompt"]
    for row in rows:
        assert row["repeats"] == 3 and row["policy_ms"] > 0 and row["reward_transformer_ms"] > 0
        assert row["overhead"] == pytest.approx(row["reward_transformer_ms"] / row["policy_ms"] - 1)
        assert row["overhead_low"] <= row["overhead"] <= row["overhead_high"]


def test_forward_overhead_detects_a_slow_channel(tiny):
    """A channel that costs 5 ms more than the tiny policy's forward: an overhead far above 0, significant."""
    from tasks.sla import forward_overhead

    model, _, prompts = tiny
    hook = model.head.register_forward_pre_hook(lambda *_: time.sleep(0.005))
    try:
        rows = forward_overhead(model, prompts[0], repeats=8)
    finally:
        hook.remove()
    for row in rows:
        assert row["overhead_low"] > 0.5 and row["overhead_significant"], row
        assert row["reward_transformer_ms"] - row["policy_ms"] >= 4.5  # sleep may overshoot on a busy machine


def _sla_project(tmp_path, tiny_llama, **benchmark):
    """A tiny project for the SLA benchmark: the prepared tiny policy (also as the "DPO" policy), a random
    reward channel for each, and held-out prompts with answers."""
    import pandas as pd

    from foresight.config import parse_config
    from foresight.prompts import PROMPT_COLUMNS
    from foresight.storage import write_table
    from models.engine.policy import load_policy, prepare_policy
    from models.sla.reward_transformer import RewardHeadConfig

    cfg = parse_config(tiny_params(tmp_path, tiny_llama, policy={"dtype": "float32"}, sla_benchmark=benchmark,
                                   paths={"dpo_dir": str(tiny_llama)}), root=tmp_path)
    spec = cfg.policy
    prepare_policy(spec, cfg.path(cfg.paths.policy_dir))
    policy = load_policy(spec, cfg.path(cfg.paths.policy_dir))
    for which, seed in (("base", 0), ("dpo", 1)):
        torch.manual_seed(seed)
        RewardTransformer(policy.model, RewardHeadConfig(hidden_size=8)).save_head(
            cfg.path(cfg.paths.reward_dir) / which / "channel")
    questions = [f"What is {i} + {i + 1}?" for i in range(6)]
    table = pd.DataFrame({"prompt_id": [f"eval{i}" for i in range(6)], "question": questions,
                          "answer": [str(2 * i + 1) for i in range(6)], "source": "file"})
    write_table(table[PROMPT_COLUMNS], cfg.path(cfg.paths.prompts_dir) / "eval.jsonl")
    # training prompts: train0 and train1 were trained on (split.json), train2 repeats a held-out question
    train = pd.DataFrame({"prompt_id": [f"train{i}" for i in range(6)],
                          "question": [f"What is {i} * 2?" for i in range(6)], "answer": [str(2 * i) for i in range(6)],
                          "source": "file"})
    train.loc[2, "question"] = questions[0]
    write_table(train[PROMPT_COLUMNS], cfg.path(cfg.paths.prompts_dir) / "train.jsonl")
    (cfg.path(cfg.paths.reward_dir) / "base" / SPLIT_FILE).write_text(json.dumps(
        {"train_prompt_ids": ["train0", "train1"], "held_out_prompt_ids": ["train5"]}))
    return cfg


def _tuning(**overrides) -> dict:
    """A small tuning grid for the tiny project: (1, 3, 8) decodes but cannot be chosen (n > 4)."""
    return {"tuning_prompts": 2, "tuning_grid": [[1, 2, 2], [2, 2, 2], [1, 3, 8]], "tuning_max_step": 4, **overrides}


def test_benchmark_decodes_each_prompt_once_timed_prompts_interleaved(tiny_llama, tmp_path, monkeypatch):
    """The speed prompts are decoded at batch 1 by every timed decoder in turn (after one warm-up call each),
    the rest untimed: the classical decoders ``sla_benchmark.batch_size`` prompts per ``generate`` call (all at
    once ran out of GPU memory as ``num_prompts`` grew, beam search most), SLA as many prompts per search. Each
    (decoder, prompt) is decoded once; beam search, not in ``timed_decoders``, decodes every prompt in batches."""
    from transformers import GenerationMixin

    import tasks.sla
    from tasks.sla import _decode_all, _load

    cfg = _sla_project(tmp_path, tiny_llama, num_prompts=5, speed_prompts=2, batch_size=2, max_new_tokens=3,
                       overhead_repeats=2, timed_decoders=["sla"])  # greedy, the reference, is timed anyway
    calls = []  # (decoder, rows) of every decoding call, in order
    generate, sla_generate = GenerationMixin.generate, tasks.sla.sla_generate
    sla_generate_batch = tasks.sla.sla_generate_batch

    def recording_generate(self, *args, **kwargs):
        calls.append(("beam" if kwargs.get("num_beams", 1) > 1 else "greedy", kwargs["input_ids"].shape[0]))
        return generate(self, *args, **kwargs)

    def recording_sla(model, ids, *args):
        calls.append(("sla", ids.shape[0]))
        return sla_generate(model, ids, *args)

    def recording_sla_batch(model, prompts, *args):
        calls.append(("sla", len(prompts)))
        return sla_generate_batch(model, prompts, *args)

    monkeypatch.setattr(GenerationMixin, "generate", recording_generate)
    monkeypatch.setattr(tasks.sla, "sla_generate", recording_sla)
    monkeypatch.setattr(tasks.sla, "sla_generate_batch", recording_sla_batch)
    questions = [f"What is {i} + {i}?" for i in range(5)]
    records, speed = _decode_all(cfg, _load(cfg, "base"), "base", questions, ["greedy", "beam", "sla"],
                                 {"sla": SLASearch(depth=1, width=2, step=2)})
    batch_1 = [("greedy", 1), ("sla", 1)]  # warm-up, prompt 0, prompt 1
    assert calls == batch_1 * 3 + [("greedy", 2), ("greedy", 1), ("beam", 2), ("beam", 2), ("beam", 1),
                                   ("sla", 2), ("sla", 1)]
    assert Counter((r["decoder"], r["prompt_index"]) for r in records) == {
        (d, i): 1 for d in ("greedy", "beam", "sla") for i in range(5)}
    assert {(r["decoder"], r["prompt_index"]) for r in records if r["timed"]} == {
        (d, i) for d in ("greedy", "sla") for i in range(2)}
    assert {name: timer.calls for name, timer in speed["timers"].items()} == {"greedy": 2, "sla": 2}
    assert [r["new_tokens"] for r in records if r["decoder"] == "greedy" and r["timed"]] == (
        speed["timers"]["greedy"].call_tokens)
    assert [row["forward"] for row in speed["overhead"]] == ["decode step", "prompt"]
    # an untimed policy (the DPO policy unless sla_benchmark.dpo_timed): every prompt in batches, no timer, no overhead
    calls.clear()
    records, speed = _decode_all(cfg, _load(cfg, "dpo"), "dpo", questions, ["greedy", "sla"],
                                 {"sla": SLASearch(depth=1, width=2, step=2)}, timed=False)
    assert calls == [("greedy", 2), ("greedy", 2), ("greedy", 1), ("sla", 2), ("sla", 2), ("sla", 1)]
    assert speed == {"timers": {}, "overhead": []} and not any(r["timed"] for r in records)


def test_a_setting_under_two_names_is_searched_once(tiny_llama, tmp_path, monkeypatch):
    """When tuning chooses the paper's setting, ``sla_tuned`` reuses ``sla``'s outputs and its timer (the search is
    deterministic): searched and timed once; the leaf-score ablation is another search and runs, untimed."""
    import tasks.sla
    from tasks.sla import _decode_all, _load

    cfg = _sla_project(tmp_path, tiny_llama, num_prompts=3, speed_prompts=1, max_new_tokens=3, overhead_repeats=2)
    searches = []  # prompts per batched SLA search
    sla_generate_batch = tasks.sla.sla_generate_batch

    def recording_sla_batch(model, prompts, *args):
        searches.append(len(prompts))
        return sla_generate_batch(model, prompts, *args)

    sla_generate = tasks.sla.sla_generate

    def recording_sla(model, ids, *args):
        searches.append("batch 1")
        return sla_generate(model, ids, *args)

    monkeypatch.setattr(tasks.sla, "sla_generate_batch", recording_sla_batch)
    monkeypatch.setattr(tasks.sla, "sla_generate", recording_sla)
    paper = SLASearch(depth=1, width=2, step=2)
    settings = {"sla": paper, "sla_tuned": paper,
                "sla_tuned_last": SLASearch(depth=1, width=2, step=2, leaf_score="last")}
    records, speed = _decode_all(cfg, _load(cfg, "base"), "base", [f"What is {i} + 1?" for i in range(3)],
                                 ["greedy", "sla"], settings, untimed=frozenset({"sla_tuned_last"}))
    # sla timed once at batch 1 (warm-up, prompt 0), then on the 2 untimed prompts; sla_tuned_last on all 3
    assert searches == ["batch 1", "batch 1", 2, 3]
    assert set(speed["timers"]) == {"greedy", "sla", "sla_tuned"} and speed["timers"]["sla_tuned"] is speed["timers"]["sla"]
    by = {(r["decoder"], r["prompt_index"]): r["response"] for r in records}
    assert all(by[("sla", i)] == by[("sla_tuned", i)] for i in range(3))


def test_table_intervals_and_significance_by_hand():
    """10 prompts: SLA right on 9 where greedy is right on 1 (and ties on the other): accuracy, mean reward and
    win rate all differ significantly; the DPO policy's greedy equals base greedy: nothing differs."""
    import pandas as pd

    from foresight.benchmark import DecodeTimer
    from tasks.sla import _metrics, _table

    greedy = [1.0] + [0.0] * 9
    sla = [1.0] * 9 + [0.0]
    outputs = pd.DataFrame([{"policy": p, "decoder": d, "prompt_index": i, "score": v, "correct": bool(v),
                             "truncated": not v}
                            for p, d, values in (("base", "greedy", greedy), ("base", "sla", sla),
                                                 ("dpo", "greedy", greedy), ("dpo", "sla", greedy))
                            for i, v in enumerate(values)])
    outputs["correct"] = outputs["correct"].astype("boolean")

    def timer(seconds):
        return DecodeTimer(seconds=sum(seconds), tokens=20, calls=2, call_seconds=seconds, call_tokens=[10, 10])

    timers = {"greedy": timer([1.0, 1.0]), "sla": timer([2.0, 1.5])}
    speed = {p: {"timers": timers, "overhead": [{"forward": "decode step", "overhead": 0.05, "overhead_low": 0.02,
                                                 "overhead_high": 0.08, "overhead_significant": True}]}
             for p in ("base", "dpo")}
    rows = {(r["policy"], r["decoder"], r["versus"]): r for r in _table(outputs, speed)}
    assert list(rows) == [("base", "greedy", "base+greedy"), ("base", "sla", "base+greedy"),
                          ("dpo", "greedy", "base+greedy"), ("dpo", "sla", "base+greedy"), ("dpo", "sla", "dpo+greedy")]
    better = rows[("base", "sla", "base+greedy")]
    # outcomes: prompt 0 a tie (½), prompts 1–8 wins, prompt 9 a tie → (8 + 1) / 10
    assert (better["win"], better["tie"], better["loss"], better["win_rate"]) == (0.8, 0.2, 0.0, 0.9)
    assert better["win_rate_low"] > 0.5 and better["win_rate_significant"]
    assert better["accuracy"] == 0.9 and better["accuracy_low"] < 0.9 < better["accuracy_high"]
    assert better["accuracy_significant"] and better["mean_reward_significant"]
    assert better["truncated"] == pytest.approx(0.1)
    assert better["latency_vs_reference"] == pytest.approx(3.5 / 2)
    assert better["latency_vs_reference_low"] == pytest.approx(1.5) and better["latency_vs_reference_high"] == 2.0
    same = rows[("dpo", "greedy", "base+greedy")]
    assert (same["win_rate"], same["win_rate_low"], same["win_rate_high"]) == (0.5, 0.5, 0.5)
    assert not (same["win_rate_significant"] or same["accuracy_significant"] or same["mean_reward_significant"])
    assert same["accuracy"] == 0.1 and same["accuracy_low"] == 0.0  # resamples without prompt 0 exist
    metrics = _metrics(list(rows.values()), speed)
    assert metrics["base_sla.win_rate"] == 0.9 and metrics["base_sla.accuracy_significant"] is True
    assert metrics["dpo_sla_vs_dpo_greedy.win_rate"] == 0.5
    assert metrics["base_sla.latency_vs_greedy_high"] == 2.0
    assert (metrics["base.reward_channel_overhead"], metrics["base.reward_channel_overhead_low"]) == (0.05, 0.02)


def test_benchmark_task_reports_intervals_everywhere(tiny_llama, tmp_path, monkeypatch):
    """The stage end to end on the tiny model: table.csv, metrics, report, Prefect table and plots carry the
    intervals, the DPO policy runs only ``dpo_decoders``, and the figures match the decoded outputs."""
    import pandas as pd
    from prefect.logging import disable_run_logger

    from foresight.benchmark import win_tie_loss
    import tasks.sla
    from models.labeling import answers, labelers
    from tasks import common
    from tasks.sla import benchmark_sla_task

    cfg = _sla_project(tmp_path, tiny_llama, num_prompts=6, speed_prompts=2, max_new_tokens=4, overhead_repeats=3,
                       decoders=["greedy", "top_k", "sla"], dpo_decoders=["greedy", "sla"], dpo_timed=True,
                       leaf_score_ablation=True, **_tuning())
    def fake_is_correct(response, answer, truncated=False):
        return len(response) % 2 == 0

    # every binding: the labeler module and the task module hold their own (imported by name), and one patched only
    # in ``answers`` while the labeler module is first imported would stay behind in it and judge later tests
    monkeypatch.setattr(answers, "is_correct", fake_is_correct)
    monkeypatch.setattr(labelers, "is_correct", fake_is_correct)
    monkeypatch.setattr(tasks.sla, "is_correct", fake_is_correct)
    common.PENDING_ARTIFACTS.clear()
    with disable_run_logger():
        result = benchmark_sla_task.fn(cfg)
    out = cfg.path(cfg.paths.benchmarks_dir) / "sla"
    assert {p.name for p in out.iterdir()} == {"outputs.parquet", "table.csv", "overhead.csv", "win_rate.png",
                                               "latency.png", "report.md", "tuning.csv", "tuning_outputs.parquet"}
    outputs = pd.read_parquet(out / "outputs.parquet")
    assert sorted(set(zip(outputs["policy"], outputs["decoder"]))) == [
        ("base", "greedy"), ("base", "sla"), ("base", "sla_tuned"), ("base", "sla_tuned_last"), ("base", "top_k"),
        ("dpo", "greedy"), ("dpo", "sla"), ("dpo", "sla_tuned")]
    # tuning: on training prompts nothing trained on and no held-out prompt shares, never on the held-out prompts
    tuning_outputs = pd.read_parquet(out / "tuning_outputs.parquet")
    assert sorted(set(tuning_outputs["prompt_id"])) == ["train3", "train4"]
    assert not set(tuning_outputs["question"]) & set(outputs["question"])
    tuning = pd.read_csv(out / "tuning.csv").set_index("decoder")
    assert list(tuning.index) == ["greedy", "sla_d1_k2_n2", "sla_d2_k2_n2", "sla_d1_k3_n8"]
    assert list(tuning["streaming"]) == [False, True, True, False] and tuning["chosen"].sum() == 1
    chosen = tuning[tuning["chosen"]].iloc[0]
    assert chosen.name == choose_setting(tuning.reset_index().to_dict("records"), {
        "sla_d1_k2_n2": SLASearch(depth=1, width=2, step=2), "sla_d2_k2_n2": SLASearch(depth=2, width=2, step=2),
        "sla_d1_k3_n8": SLASearch(depth=1, width=3, step=8)}, 4)
    m = result.metrics
    assert (m["sla_tuned.depth"], m["sla_tuned.width"], m["sla_tuned.step"]) == (
        chosen["depth"], chosen["width"], chosen["step"])
    assert m["tuning.num_prompts"] == 2
    for key in ("tuning_sla_d2_k2_n2.win_rate", "tuning_sla_d1_k3_n8.accuracy", "base_sla_tuned.win_rate",
                "base_sla_tuned_last.win_rate", "dpo_sla_tuned.win_rate", "dpo_sla_tuned_vs_dpo_greedy.win_rate"):
        assert m[f"{key}_low"] <= m[key] <= m[f"{key}_high"], key
    assert 0.0 <= m["base_sla_tuned.truncated"] <= 1.0
    assert "base_sla_tuned_last.latency_vs_greedy" not in m and "base_sla_tuned.latency_vs_greedy" in m
    table = pd.read_csv(out / "table.csv")
    for column in ("win_rate", "mean_reward", "accuracy", "latency_vs_reference"):
        rows = table.dropna(subset=[column])
        assert (rows[f"{column}_low"] <= rows[column] + 1e-12).all(), column
        assert (rows[column] <= rows[f"{column}_high"] + 1e-12).all(), column
    timed = table.set_index(["policy", "decoder", "versus"])["latency_vs_reference"].notna()
    assert timed[("base", "sla", "base+greedy")] and timed[("dpo", "sla", "dpo+greedy")]
    assert not timed[("base", "top_k", "base+greedy")]  # not in timed_decoders: decoded in batches, untimed
    base = outputs[outputs["policy"] == "base"].pivot(index="prompt_index", columns="decoder", values="score")
    correct = outputs[outputs["policy"] == "base"].pivot(index="prompt_index", columns="decoder", values="correct")
    sla_row = table[(table["policy"] == "base") & (table["decoder"] == "sla")].iloc[0]
    assert sla_row["win_rate"] == pytest.approx(win_tie_loss(base["sla"].tolist(), base["greedy"].tolist())["win_rate"])
    assert sla_row["accuracy"] == pytest.approx(correct["sla"].astype(float).mean())
    m = result.metrics
    for key in ("base_sla.win_rate", "base_sla.accuracy", "base_sla.latency_vs_greedy", "dpo_sla_vs_dpo_greedy.win_rate",
                "base.reward_channel_overhead", "dpo.reward_channel_overhead", "base.reward_channel_overhead_prompt"):
        assert m[f"{key}_low"] <= m[key] <= m[f"{key}_high"], key
    assert "dpo.reward_channel_overhead_prompt" not in m  # the prefill is timed once, on the base policy
    report = (out / "report.md").read_text()
    assert "6 held-out prompts" in report and "first 2" in report and "on 3 interleaved pairs" in report
    assert "## SLA tuning" in report and "chosen on 2 training prompts" in report
    assert "`*` marks" in report and " [" in report
    (artifact,) = [a for a in common.PENDING_ARTIFACTS if a.get("key") == "sla-benchmark"]
    cells = {(row["policy"], row["decoder"], row["versus"]): row for row in artifact["table"]}
    assert cells[("base", "sla", "base+greedy")]["win_rate"].startswith(f"{sla_row['win_rate']:.3g} [")


def test_tuning_split_holds_no_trained_on_or_held_out_prompt():
    """Tuning prompts: training prompts in order, without those the reward heads / DPO trained on and without any
    whose question is a held-out one; disjoint from the held-out prompts."""
    import pandas as pd

    held_out = pd.DataFrame({"prompt_id": ["e0", "e1"], "question": ["What is 1 + 2?", "What is 2 + 3?"]})
    train = pd.DataFrame({"prompt_id": [f"t{i}" for i in range(6)],
                          "question": ["What is 1 + 2?", "What is 1 * 2?", "What is 2 * 2?", "What is 3 * 2?",
                                       "What is 4 * 2?", "What is 5 * 2?"]})
    split = tuning_split(train, held_out, trained_on={"t1", "t3"}, count=3)
    assert split["prompt_id"].tolist() == ["t2", "t4", "t5"]
    assert not set(split["question"]) & set(held_out["question"])
    assert not set(split["prompt_id"]) & set(held_out["prompt_id"])
    assert len(tuning_split(train, held_out, set(), count=10)) == 5


def test_the_chosen_setting_is_the_best_streaming_one_on_the_tuning_scores():
    """Hand-made tuning scores: the non-streaming setting wins but cannot be chosen (n > max_step); of the rest the
    highest win rate wins, a tie goes to accuracy, a full tie to the first in grid order; greedy is never chosen."""
    settings = {"sla_d2_k2_n10": SLASearch(depth=2, width=2, step=10),
                "sla_d1_k4_n16": SLASearch(depth=1, width=4, step=16),
                "sla_d2_k3_n8": SLASearch(depth=2, width=3, step=8),
                "sla_d1_k4_n64": SLASearch(depth=1, width=4, step=64)}

    def rows(*scores):
        return [{"decoder": "greedy", "win_rate": 0.5, "accuracy": 0.9}] + [
            {"decoder": name, "win_rate": w, "accuracy": a} for name, (w, a) in zip(settings, scores, strict=True)]

    assert choose_setting(rows((0.5, 0.3), (0.7, 0.5), (0.6, 0.6), (0.9, 0.8)), settings, 16) == "sla_d1_k4_n16"
    assert choose_setting(rows((0.5, 0.3), (0.7, 0.5), (0.6, 0.6), (0.9, 0.8)), settings, 64) == "sla_d1_k4_n64"
    assert choose_setting(rows((0.7, 0.3), (0.7, 0.5), (0.6, 0.6), (0.9, 0.8)), settings, 16) == "sla_d1_k4_n16"
    assert choose_setting(rows((0.7, 0.5), (0.7, 0.5), (0.6, 0.6), (0.9, 0.8)), settings, 16) == "sla_d2_k2_n10"
    assert choose_setting(rows((0.4, 0.3), (0.4, 0.5), (0.3, 0.6), (0.9, 0.8)), settings, 10) == "sla_d2_k2_n10"
    with pytest.raises(ValueError, match="step ≤ 4"):
        choose_setting(rows((0.5, 0.3), (0.7, 0.5), (0.6, 0.6), (0.9, 0.8)), settings, 4)


@pytest.mark.parametrize(("params", "message"), [
    ({"sla": {"leaf_score": "first"}}, "sla.leaf_score"),
    ({"sla_benchmark": {"tuning_grid": [[2, 0, 10]]}}, "sla_benchmark.tuning_grid.0.1"),
    ({"sla_benchmark": {"tuning_grid": [[2, 2]]}}, "sla_benchmark.tuning_grid.0"),
    ({"sla_benchmark": {"tuning_grid": []}}, "sla_benchmark.tuning_grid"),
    ({"sla_benchmark": {"tuning_grid": [[1, 4, 64]], "tuning_max_step": 16}}, "no setting with step ≤ tuning_max"),
    ({"sla_benchmark": {"tuning_prompts": -1}}, "sla_benchmark.tuning_prompts"),
])
def test_new_sla_keys_are_validated(params, message):
    from foresight.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(params)


def test_new_sla_keys_defaults_and_streaming_only_grids():
    from foresight.config import parse_config

    cfg = parse_config({"sla_benchmark": {"tuning_grid": [[1, 4, 64]], "tuning_prompts": 0}})  # no tuning: no check
    assert cfg.sla_benchmark.tuning_grid == [(1, 4, 64)]
    defaults = parse_config({})
    assert defaults.sla.leaf_score == "mean" and defaults.sla.model_dump() == SLASearch().model_dump()
    assert all(step <= defaults.sla_benchmark.tuning_max_step for _, _, step in defaults.sla_benchmark.tuning_grid)


def test_a_params_key_reaches_the_component_the_task_hands_to_the_model_code(monkeypatch):
    """Each SLA section is the component its task hands to the model code (no copy that could drop a key): an
    override of ``sla.step`` reaches every SLA setting the benchmark searches with (the paper's and the sweep's), and
    one of ``sla_benchmark.num_beams`` the beam search's ``generate`` arguments."""
    import tasks.sla
    from foresight.config import load_config
    from models.engine.config import ClassicalDecoding
    from models.sla.config import (
        DPOConfig,
        DPOTraining,
        RewardConfig,
        RewardTraining,
        SLABenchmarkConfig,
        SLAConfig,
    )
    from tasks.sla import _decode_batched, _sla_settings

    assert issubclass(RewardConfig, RewardTraining) and issubclass(DPOConfig, DPOTraining)
    assert issubclass(SLAConfig, SLASearch) and issubclass(SLABenchmarkConfig, ClassicalDecoding)
    cfg = load_config("params.yaml", {"sla.step": 7, "sla.leaf_score": "last", "sla_benchmark.sweep_depth": [1],
                                      "sla_benchmark.num_beams": 3})
    settings = _sla_settings(cfg)
    assert list(settings) == ["sla", "sla_d1_k2_n7"]
    assert all(isinstance(s, SLASearch) and (s.step, s.leaf_score) == (7, "last") for s in settings.values())
    handed = []
    monkeypatch.setattr(tasks.sla, "end_token_ids", lambda policy: set())
    monkeypatch.setattr(tasks.sla, "hf_decode", lambda policy, prompts, kwargs, *args, **options:
                        handed.append(kwargs) or [[] for _ in prompts])
    _decode_batched(cfg, None, None, [torch.tensor([[1, 2]])], "beam", None, seed=0, max_new_tokens=4)
    assert handed == [{"do_sample": False, "num_beams": 3, "early_stopping": True}]


def test_onpolicy_pairs_are_every_correct_incorrect_pair_of_distinct_base_outputs():
    """Prompt 0: greedy and beam wrong with the same text, SLA right → one pair; prompt 1: all right → none; the
    DPO policy's outputs and unknown correctness take no part."""
    import pandas as pd

    from tasks.sla import onpolicy_pairs

    outputs = pd.DataFrame({
        "policy": ["base"] * 6 + ["dpo", "base"],
        "decoder": ["greedy", "beam", "sla", "greedy", "beam", "sla", "greedy", "top_k"],
        "prompt_index": [0, 0, 0, 1, 1, 1, 0, 2],
        "prompt_id": ["p0", "p0", "p0", "p1", "p1", "p1", "p0", "p2"],
        "response": ["The answer is 5.", "The answer is 5.", "The answer is 7.", "7", "7.", "seven",
                     "The answer is 9.", "x"],
        "correct": pd.array([False, False, True, True, True, True, False, None], dtype="boolean"),
    })
    pairs = onpolicy_pairs(outputs, ["<prompt 0>", "<prompt 1>", "<prompt 2>"])
    assert pairs.to_dict("records") == [{"prompt_id": "p0", "prompt": "<prompt 0>", "chosen": "The answer is 7.",
                                         "rejected": "The answer is 5."}]
