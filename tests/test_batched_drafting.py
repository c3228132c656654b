"""Batched MTP drafting and speculative sampling do O(depth) work per step, not O(batch × depth), and the decoders'
forwards keep only the last layer's hidden states (issue #31, items 10 and 11). What they produce is pinned
elsewhere, token for token (tests/test_batched.py, tests/test_mtp.py, tests/test_grpo.py); here: the number of
MTP layer forwards per draft, that the batched draws are torch.multinomial's draws exactly, that the batched
verdict is the row-by-row chain rule exactly, and that no forward holds every layer's states."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from models.engine.batched import BatchGreedy, BatchSampling, HeadsDrafter, batched_speculative_generate
from models.engine.speculative import chain_tree, prefill, speculative_cache, tree_forward
from tests.helpers import RecordingBatchDrafter, hf_greedy, perturbed_module, random_prompts
from tests.tiny import load_spiky_tiny_llama


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_spiky_tiny_llama(tiny_llama)


@pytest.fixture(scope="module")
def deep():
    """A random 6-layer Llama in float32: enough layers that keeping them all shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


class LayerCalls:
    """Counts the MTP module's shared-layer forwards and the drafter's drafts."""

    def __init__(self, drafter):
        self.layer, self.drafts = 0, 0
        drafter.module.layer.register_forward_hook(lambda *_: setattr(self, "layer", self.layer + 1))
        propose = drafter.propose

        def counted(roots):
            self.drafts += 1
            return propose(roots)

        drafter.propose = counted


@torch.no_grad()
def test_a_batched_mtp_draft_runs_the_shared_layer_once_per_depth(model):
    """6 rows, K = 3: every draft runs the MTP layer 3 times for the whole batch (one row at a time ran it 18
    times), and the output is still every row's greedy decoding."""
    from models.mtp.module import MTPBatchDrafter

    prompts = random_prompts(6, model.config.vocab_size, seed=7)
    drafter = MTPBatchDrafter(model, perturbed_module(model, 3, scale=0.05))
    calls = LayerCalls(drafter)
    outputs, _ = batched_speculative_generate(model, drafter, BatchGreedy(), prompts, 20, set())
    assert outputs == [hf_greedy(model, torch.tensor([p]), 20, set()) for p in prompts]
    assert calls.drafts > 3
    assert calls.layer == 3 * calls.drafts


@torch.no_grad()
def test_batched_mtp_sampling_is_batch_1_sampling_token_for_token_across_compactions(model, monkeypatch):
    """Speculative sampling with sampled drafts, K = 3, each prompt with its own generator: rows accept different
    numbers of drafts, which leaves masked junk in every depth's cache, moved out at every chance (the rule made
    eager). Every row's drafts, cycle by cycle, and its output are still the batch-1 drafter's and sampler's with
    that prompt's generator."""
    import models.mtp.module as mtp
    from models.engine.speculative import SamplingVerifier, speculative_generate

    compactions = []
    compact = mtp.compact_cache
    monkeypatch.setattr(mtp, "compact_cache", lambda cache, visible: compactions.append(1) or compact(cache, visible))
    monkeypatch.setattr(mtp, "too_much_junk", lambda width, longest: width > longest)

    class RecordingDrafter(mtp.MTPDrafter):
        def propose(self, room):
            draft = super().propose(room)
            drafts.append(draft.tokens[1:].tolist())
            return draft

    prompts = random_prompts(4, model.config.vocab_size, seed=9)
    module = perturbed_module(model, 3, scale=0.0)
    generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    drafter = RecordingBatchDrafter(mtp.MTPBatchDrafter(model, module, 1.0, generators))
    outputs, stats = batched_speculative_generate(model, drafter, BatchSampling(1.0, generators), prompts, 40, set())
    assert len(compactions) > 10 and len({s.accepted_drafts for s in stats}) > 1
    for i, (prompt, row_drafts) in enumerate(zip(prompts, drafter.drafts, strict=True)):
        drafts, generator = [], torch.Generator().manual_seed(i)
        tokens, _ = speculative_generate(model, RecordingDrafter(model, module, 1.0, generator),
                                         SamplingVerifier(1.0, generator), torch.tensor([prompt]), 40, set())
        assert (tokens, drafts) == (outputs[i], row_drafts)


@pytest.mark.parametrize("draft_temperature", [0.0, 1.0])
@torch.no_grad()
def test_batched_speculative_sampling_draws_without_a_multinomial_per_row(model, monkeypatch, draft_temperature):
    """Under speculative sampling with each row's own generator, no draw goes through torch.multinomial (two host
    syncs per call, one call per row per depth and per verdict before): drafts and verdicts draw every row at once."""
    from models.mtp.module import MTPBatchDrafter

    calls = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(1) or multinomial(*a, **k))
    prompts = random_prompts(5, model.config.vocab_size, seed=8)
    generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    drafter = MTPBatchDrafter(model, perturbed_module(model, 2, scale=0.3), draft_temperature, generators)
    layer_calls = LayerCalls(drafter)
    outputs, stats = batched_speculative_generate(model, drafter, BatchSampling(1.0, generators), prompts, 12, set())
    assert [len(o) for o in outputs] == [12] * len(prompts) and sum(s.drafted_tokens for s in stats) > 0
    assert calls == []
    assert layer_calls.layer == 2 * layer_calls.drafts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_draw_rows_draws_what_multinomial_draws_row_by_row(device):
    """Each row's token and its generator's state afterwards are torch.multinomial's with that generator: dense laws,
    laws with zeros (a residual), one-hot laws (top-1 drafts); rows drawn together do not share noise. On the GPU
    too: the equality rests on torch's one-sample path, the same for both devices."""
    from models.engine.speculative import draw_rows

    gen = torch.Generator().manual_seed(0)
    vocab, rows = 50, 12
    laws = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1)
    laws[4:8] = (laws[4:8] - 0.02).clamp(min=0)  # unnormalised, with zeros: what a residual passes
    laws[8:] = torch.nn.functional.one_hot(laws[8:].argmax(-1), vocab).float()
    laws = laws.to(device)
    for trial in range(20):
        mine = [torch.Generator(device=device).manual_seed(100 * trial + b) for b in range(rows)]
        theirs = [torch.Generator(device=device).manual_seed(100 * trial + b) for b in range(rows)]
        tokens = draw_rows(laws, mine).tolist()
        assert tokens == [int(torch.multinomial(laws[b], 1, generator=theirs[b])) for b in range(rows)]
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs, strict=True))


def _chain_rule(drafts: list[int], draft_probs, target_probs, generator) -> tuple[int, int]:
    """Speculative sampling of one chain, a draft at a time (the loop verify_rows replaces)."""
    uniforms = torch.rand(len(drafts), generator=generator, device=target_probs.device)
    for d, token in enumerate(drafts):
        p, q = target_probs[d], draft_probs[d]
        if uniforms[d] * q[token] <= p[token]:
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        return d, int(torch.multinomial(residual / total if total > 0 else p, 1, generator=generator))
    return len(drafts), int(torch.multinomial(target_probs[-1], 1, generator=generator))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_verify_rows_is_the_chain_rule_row_by_row_exactly(depth, device):
    """Many rows at once, each with its own generator: the accepted counts, the next tokens and the generators' states
    after equal one chain at a time — sampled drafts, top-1 drafts (one-hot q), and q = p (no residual)."""
    from models.engine.speculative import verify_rows

    gen = torch.Generator().manual_seed(depth)
    vocab, rows = 7, 60
    target = torch.softmax(torch.randn(rows, depth + 1, vocab, generator=gen) * 2, dim=-1)  # (B, D+1, V)
    draft = torch.softmax(torch.randn(rows, depth, vocab, generator=gen) * 2, dim=-1)  # (B, D, V)
    draft[20:40] = torch.nn.functional.one_hot(draft[20:40].argmax(-1), vocab).float()
    draft[40:] = target[40:, :depth]
    drafts = torch.stack([torch.multinomial(draft[b], 1, generator=gen)[:, 0] if depth else torch.zeros(0).long()
                          for b in range(rows)])  # (B, D)
    drafts, draft, target = drafts.to(device), draft.to(device), target.to(device)
    mine = [torch.Generator(device=device).manual_seed(b) for b in range(rows)]
    theirs = [torch.Generator(device=device).manual_seed(b) for b in range(rows)]
    accepted, tokens = verify_rows(drafts, draft, target, mine)
    expected = [_chain_rule(drafts[b].tolist(), draft[b], target[b], theirs[b]) for b in range(rows)]
    assert list(zip(accepted.tolist(), tokens.tolist(), strict=True)) == expected
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs, strict=True))
    if depth:
        assert 0 < int(accepted.sum()) < rows * depth  # both verdicts ran


def _inputs(model, batch: int = 3, length: int = 9) -> dict:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0  # a right-padded row
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def test_the_last_hidden_state_forward_equals_output_hidden_states_bit_for_bit(deep):
    """float32: the same logits (all positions, or ``logits_to_keep``), the same final hidden state as
    ``output_hidden_states=True``'s last, and the same gradients through both."""
    from models.engine.speculative import last_hidden_forward

    inputs = _inputs(deep)
    for keep in (0, 2, torch.tensor([1, 4, 8])):
        deep.zero_grad()
        old = deep(**inputs, logits_to_keep=keep, output_hidden_states=True)
        (old.logits.sum() + old.hidden_states[-1].pow(2).sum()).backward()
        old_grads = [p.grad.clone() for p in deep.parameters()]
        deep.zero_grad()
        new, hidden = last_hidden_forward(deep, **inputs, logits_to_keep=keep)
        (new.logits.sum() + hidden.pow(2).sum()).backward()
        assert new.hidden_states is None
        assert torch.equal(new.logits, old.logits) and torch.equal(hidden, old.hidden_states[-1])
        assert all(torch.equal(p.grad, g) for p, g in zip(deep.parameters(), old_grads, strict=True))
    deep.zero_grad()


def test_the_last_hidden_state_forward_finds_the_decoder_through_peft(deep):
    """A LoRA-wrapped policy (MTP-RL's with ``lora_rank`` > 0): the hook reaches its decoder; the results stay exact."""
    from peft import LoraConfig, get_peft_model

    from models.engine.speculative import last_hidden_forward

    wrapped = get_peft_model(copy.deepcopy(deep), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    inputs = _inputs(deep)
    with torch.no_grad():
        old = wrapped(**inputs, output_hidden_states=True)
        new, hidden = last_hidden_forward(wrapped, **inputs)
    assert torch.equal(new.logits, old.logits) and torch.equal(hidden, old.hidden_states[-1])


class LiveLayerStates:
    """At every LM-head call, how many decoder layers' outputs are still alive (weak references): a forward with
    ``output_hidden_states=True`` holds them all until it returns."""

    def __init__(self, model):
        self.refs, self.live = [], []
        for layer in model.model.layers:
            layer.register_forward_hook(lambda module, args, out: self.refs.append(
                weakref.ref(out if torch.is_tensor(out) else out[0])))
        model.lm_head.register_forward_pre_hook(
            lambda module, args: self.live.append(sum(ref() is not None for ref in self.refs)))


@torch.no_grad()
def test_no_decoding_forward_keeps_every_layers_hidden_states(deep):
    """The prefill and tree forward at batch 1, the batched prefill and steps (MTP's and Medusa's drafters): when the
    LM head runs, no earlier layer's output is alive any more."""
    from models.mtp.module import MTPBatchDrafter

    drafter = MTPBatchDrafter(deep, perturbed_module(deep, 2, scale=0.05))  # before the hooks (its layer is a copy)
    live = LiveLayerStates(deep)
    prompt = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = speculative_cache(deep)
    prefill(deep, prompt, cache)
    tree_forward(deep, torch.tensor([5, 6, 7]), chain_tree(2), cache)
    batched_speculative_generate(deep, drafter, BatchGreedy(), random_prompts(3, 64, seed=4), 6, set())
    heads = HeadsDrafter(chain_tree(1), lambda h, r: torch.zeros(len(h), 1, 64))
    batched_speculative_generate(deep, heads, BatchGreedy(), random_prompts(2, 64, seed=5), 4, set())
    assert len(live.live) > 6 and max(live.live) == 0


@torch.no_grad()
def test_the_mtp_rl_log_prob_forward_keeps_only_the_last_layers_states(deep):
    """The policy forward whose final states feed the MTP module's losses holds no other layer's states."""
    from models.mtp.rl import completion_logps

    live = LiveLayerStates(deep)
    inputs = _inputs(deep)
    response_mask = torch.zeros_like(inputs["input_ids"])
    response_mask[:, 5:] = 1
    out, _, _, hidden = completion_logps(deep, {**inputs, "response_mask": response_mask}, 1.0, final_hidden=True)
    assert hidden.shape == (*inputs["input_ids"].shape, deep.config.hidden_size) and out.hidden_states is None
    assert live.live == [0]
