"""Streaming Looking-Ahead decoding (models/sla/search.py) on a tiny random Llama with a seeded random reward head.

The key test compares the cached, batched, streaming implementation with a brute-force reference
written here: an explicit tree rebuilt from scratch at every step, every sequence recomputed with a
full no-cache forward. They must agree token for token.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from models.sla.config import SLASearch
from models.sla.reward_transformer import RewardTransformer
from models.sla.search import Node, SLAStats, backup, greedy_generate, select_action, sla_generate, sla_stream
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


def reference_sla(model, prompt: list[int], d: int, k: int, n: int, max_new: int, eos: set[int]):
    """SLA(d, k, n) by brute force: at each step build the depth-d tree below the committed text from
    scratch, Q = best leaf (mean response reward) below, commit the argmax first-level child (first wins
    ties). Returns (tokens, number of finished nodes met in the trees)."""
    finished_seen = 0

    def q_value(path: list[int], level: int, response: list[int]) -> float:
        nonlocal finished_seen
        logits, rewards = full_forward(model, prompt + response + path)
        score = sum(rewards[len(prompt):].tolist()) / len(response + path)
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


@pytest.mark.parametrize(("d", "k", "n"), [(2, 2, 3), (1, 3, 2), (3, 2, 2), (2, 3, 4)])
def test_sla_equals_brute_force_reference(tiny, eos, d, k, n):
    """Caching, batching, cache re-indexing and subtree reuse against a from-scratch reference."""
    model, tok, prompts = tiny
    finished = 0
    never = {tok.eos_token_id}  # never emitted by this model: full-length trees only
    runs = [(ids, eos) for ids in prompts] + [(ids, never) for ids in prompts[2:]]
    for ids, eos_ids in runs:
        expected, seen = reference_sla(model, ids[0].tolist(), d, k, n, 20, eos_ids)
        finished += seen
        assert sla_generate(model, ids, SLASearch(depth=d, width=k, step=n), 20, eos_ids)[0] == expected
    assert finished > 0  # trees with finished (end-token) branches were exercised


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


def test_forward_overhead_times_each_forward_between_synchronisations(tiny, monkeypatch):
    """CUDA kernels run asynchronously: without a synchronise on both sides a timing measures the launches.
    On the CPU the order of the calls is what can be checked."""
    import tasks.sla

    model, _, prompts = tiny
    events = []
    monkeypatch.setattr(tasks.sla, "synchronize", lambda: events.append("sync"))
    hook = model.policy.register_forward_hook(lambda *_: events.append("forward"))
    try:
        overhead = tasks.sla.forward_overhead(model, prompts[0], repeats=3)
    finally:
        hook.remove()
    # per timed function: one warm-up forward, then each repeat bracketed
    assert events == (["forward"] + ["sync", "forward", "sync"] * 3) * 2
    assert overhead["policy_forward_ms"] > 0 and overhead["reward_transformer_forward_ms"] > 0


def test_benchmark_decodes_the_classical_decoders_in_batches(tiny_llama, tmp_path, monkeypatch):
    """The held-out prompts go to ``generate`` at most ``sla_benchmark.batch_size`` at a time (all of them at
    once ran out of GPU memory as ``num_prompts`` grew, beam search most), and every prompt is decoded."""
    from transformers import GenerationMixin

    from foresight.config import component, parse_config
    from models.engine.config import PolicySpec
    from models.engine.policy import load_policy, prepare_policy
    from models.sla.reward_transformer import RewardHeadConfig
    from tasks.sla import _decode_all
    from tests.conftest import tiny_params

    benchmark = {"num_prompts": 5, "batch_size": 2, "max_new_tokens": 3, "decoders": ["greedy", "beam", "sla"]}
    cfg = parse_config(tiny_params(tmp_path, tiny_llama, sla_benchmark=benchmark), root=tmp_path)
    spec = component(PolicySpec, cfg.policy)
    prepare_policy(spec, cfg.path(cfg.paths.policy_dir))
    policy = load_policy(spec, cfg.path(cfg.paths.policy_dir))
    RewardTransformer(policy.model, RewardHeadConfig(hidden_size=8)).save_head(
        cfg.path(cfg.paths.reward_dir) / "base" / "channel")

    batches = []  # rows of every generate call, as the model received them
    generate = GenerationMixin.generate

    def recording_generate(self, *args, **kwargs):
        batches.append(kwargs["input_ids"].shape[0])
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording_generate)
    questions = [f"What is {i} + {i}?" for i in range(5)]
    records, _ = _decode_all(cfg, "base", questions, {"sla": SLASearch(depth=1, width=2, step=2)},
                             time_sampling=False)
    # greedy and beam: 2 + 2 + 1 prompts each; then HF greedy timed at batch 1 on the speed prompt
    assert batches == [2, 2, 1] * 2 + [1] * cfg.sla_benchmark.speed_prompts
    decoded = Counter(r["decoder"] for r in records)
    assert decoded == {"greedy": 5, "beam": 5, "sla": 5}
