"""Medusa heads (models/medusa/heads.py), their self-distilled data and Medusa-1 training (models/medusa/training.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from models.common.splits import split_by_prompt
from models.engine.decoding import greedy_responses
from models.engine.policy import Policy
from models.engine.speculative import chain_tree
from models.medusa.config import MedusaTraining, RLMedusaCandidates
from models.medusa.heads import IGNORE_INDEX, MedusaDrafter, MedusaHeads, heads_for, medusa_loss
from models.medusa.rlmedusa import TrajectoryStates, sample_candidates, trajectory_candidates
from models.medusa.training import (
    HiddenStates,
    _head_targets,
    evaluate_heads,
    pass_autocast,
    self_distill,
    train_medusa_heads,
)


@pytest.fixture(scope="module")
def policy(tiny_llama) -> Policy:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()  # trainable, as load_policy returns it
    return Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_llama), device=torch.device("cpu"), name="tiny")


@pytest.fixture(scope="module")
def samples(policy) -> pd.DataFrame:
    tok = policy.tokenizer
    rows = []
    for p, question in enumerate(["Ben has 4 apples.", "Ivy has 3 cookies.", "What is 7 * 8?", "0 1 2 3"]):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
        for s, response in enumerate(["The answer is 6.", "Ben gives 2 more apples to Ava. The answer is 7."]):
            rows.append({"prompt_id": f"p{p}", "sample_index": s, "prompt": prompt, "response": response,
                         "finish_reason": "eos" if s == 0 else "length"})
    return pd.DataFrame(rows)


def test_heads_are_distinct_modules_and_start_as_the_lm_head(policy):
    heads = heads_for(policy.model, num_heads=3)
    blocks = [heads.blocks[k][0].linear for k in range(3)]
    assert len({id(b) for b in blocks}) == 3 and len({id(b.weight) for b in blocks}) == 3
    with torch.no_grad():
        blocks[0].weight.fill_(1.0)
    assert (blocks[1].weight == 0).all()  # changing one head leaves the others alone
    fresh = heads_for(policy.model, num_heads=3)
    hidden = torch.randn(5, policy.model.config.hidden_size)
    lm_head = policy.model.get_output_embeddings()
    logits = fresh(hidden, lm_head)  # (5, K, V)
    assert logits.shape == (5, 3, policy.model.config.vocab_size)
    for k in range(3):  # zero-initialised residual blocks: every head starts as the backbone's LM head
        torch.testing.assert_close(logits[:, k], lm_head(hidden), rtol=0, atol=0)
    torch.testing.assert_close(fresh(hidden, lm_head, only=2), logits[:, 2], rtol=0, atol=0)
    # shared projection: the LM head is not part of the heads' own parameters (nor of their checkpoint)
    assert not any(p is lm_head.weight for p in fresh.parameters())


def test_untied_heads_own_distinct_trainable_projections(policy):
    heads = heads_for(policy.model, num_heads=2, untie=True)
    lm_head = policy.model.get_output_embeddings()
    projections = list(heads.projections)
    assert projections[0].weight is not projections[1].weight and projections[0].weight is not lm_head.weight
    assert all(p.weight.requires_grad for p in projections)
    torch.testing.assert_close(projections[0].weight, lm_head.weight)


def test_save_and_load_round_trip(policy, tmp_path):
    lm_head = policy.model.get_output_embeddings()
    heads = heads_for(policy.model, num_heads=2, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    heads.save(tmp_path / "heads")
    loaded = MedusaHeads.load(tmp_path / "heads", lm_head)
    hidden = torch.randn(3, policy.model.config.hidden_size)
    torch.testing.assert_close(loaded(hidden, lm_head), heads(hidden, lm_head), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="train_medusa"):
        MedusaHeads.load(tmp_path / "missing", lm_head)


def test_with_fresh_head_resets_only_that_head(policy):
    lm_head = policy.model.get_output_embeddings()
    heads = heads_for(policy.model, num_heads=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    fresh = heads.with_fresh_head(0, lm_head)
    hidden = torch.randn(3, policy.model.config.hidden_size)
    torch.testing.assert_close(fresh(hidden, lm_head, only=0), lm_head(hidden), rtol=0, atol=0)
    torch.testing.assert_close(fresh(hidden, lm_head, only=1), heads(hidden, lm_head, only=1), rtol=0, atol=0)


def test_medusa_loss_against_hand_worked_numbers():
    # two positions, two heads, vocabulary 3; head 2 has no target at the second position
    head_logits = torch.tensor([[[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]],
                                [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # (N=2, K=2, V=3)
    targets = torch.tensor([[1, 0], [0, IGNORE_INDEX]])
    total, per_head = medusa_loss(head_logits, targets, decay=0.8)
    ce_uniform = math.log(3)  # −log(1/3)
    ce_peaked = -(1.0 - math.log(math.e + 2))  # −log(e / (e + 2))
    ce_head2 = -(2.0 - math.log(math.e ** 2 + 2))  # −log(e² / (e² + 2))
    head1 = (ce_uniform + ce_peaked) / 2
    assert per_head.tolist() == pytest.approx([head1, ce_head2], abs=1e-6)
    assert total.item() == pytest.approx(head1 + 0.8 * ce_head2, abs=1e-6)


def test_head_accuracies_per_rank():
    from models.medusa.training import DistilledStates, HiddenStates

    head_logits = torch.tensor([[[0.0, 3.0, 2.0, 1.0]], [[3.0, 2.0, 1.0, 0.0]], [[0.0, 1.0, 2.0, 3.0]]])  # (3, 1, 4)
    targets = torch.tensor([[1], [1], [IGNORE_INDEX]])  # rank 0 at the first position, rank 1 at the second
    data = DistilledStates(HiddenStates(torch.zeros(3, 2)), targets, torch.zeros(3, dtype=torch.long))
    lm_head = torch.nn.Linear(2, 4)
    accuracy = evaluate_heads(lambda hidden, _: head_logits[: len(hidden)], lm_head, data, top_k=2, ranks=3)
    assert accuracy == {"top1": [0.5], "top2": [1.0], "rank_accuracy": [[0.5, 0.5, 0.0]]}


def test_head_targets_shift_by_k():
    targets = _head_targets(torch.tensor([10, 11, 12, 13]), num_heads=2)
    assert targets.tolist() == [[11, 12], [12, 13], [13, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX]]


def test_sample_candidates_mix():
    gen = torch.Generator().manual_seed(0)
    vocab = 200
    probs = torch.softmax(torch.randn(40, vocab, generator=gen) * 3, dim=-1)
    candidates = sample_candidates(probs, gen, num_top=3, top_pool=50, num_random=5)
    assert candidates.shape == (40, 9)
    ranked = probs.argsort(dim=-1, descending=True)
    for row in range(40):
        c = candidates[row].tolist()
        assert len(set(c)) == 9  # all distinct
        assert c[0] == ranked[row, 0].item()  # the top-1
        assert set(c[1:4]) <= set(ranked[row, 1:50].tolist())  # 3 from ranks 2..50
        assert not set(c[4:]) & set(c[:4])  # 5 random others
    # the random draws do range over the whole vocabulary, not just the top-50
    outside = {t for row in range(40) for t in candidates[row, 4:].tolist() if t not in ranked[row, :50].tolist()}
    assert len(outside) > 50


def test_self_distill_targets_and_states_match_a_plain_forward(policy, samples, tmp_path):
    cfg = MedusaTraining(num_heads=2, distill_batch_size=3, mixed_precision="no")
    rl_cfg = RLMedusaCandidates(trajectory_tokens=4, top_candidates=2, top_pool=10, random_candidates=3)
    data = self_distill(policy, samples, cfg, tmp_path)
    rl = trajectory_candidates(data, policy.model.get_output_embeddings(), rl_cfg, seed=0, mixed_precision="no")
    from models.common.sequences import tokenize_sequence

    row, done = 0, 0
    for i, r in samples.iterrows():
        ids, mask = tokenize_sequence(policy.tokenizer, r["prompt"], r["response"], add_end=r["finish_reason"] == "eos")
        first = mask.index(1)
        n = len(ids) - first  # response tokens; positions first−1 .. len−2 predict them
        out = policy.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        greedy = out.logits[0, first - 1 : len(ids) - 1].argmax(-1)
        torch.testing.assert_close(data.hidden[row : row + n], out.hidden_states[-1][0, first - 1 : len(ids) - 1],
                                   rtol=0, atol=1e-5)
        assert data.targets[row : row + n].tolist() == _head_targets(greedy, 2).tolist()
        assert (data.sample[row : row + n] == i).all()
        # trajectory states: the first min(4, n − 1) positions, candidates scored by p(x_{t+2} | x_{≤t+1})
        steps = min(4, n - 1)
        assert rl.rows[done : done + steps].tolist() == list(range(row, row + steps))
        assert (rl.sample[done : done + steps] == i).all()
        probs = torch.softmax(out.logits[0, first : first + steps], dim=-1)
        torch.testing.assert_close(rl.probs[done : done + steps],
                                   probs.gather(1, rl.candidates[done : done + steps]), rtol=0, atol=1e-6)
        assert (rl.candidates[done : done + steps, 0] == probs.argmax(-1)).all()
        row, done = row + n, done + steps
    assert row == len(data.hidden) and done == len(rl.rows)


def _in_pass_candidates(policy: Policy, samples: pd.DataFrame, cfg: MedusaTraining, rl_cfg: RLMedusaCandidates,
                        seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLMedusa's candidates as the frozen pass drew them before the ``distill`` stage: inside the pass, from its
    batch forward's states, one response after another with one generator (rows, candidates, probabilities)."""
    from models.common.sequences import fits, padding_id, right_pad, sft_sequences

    tok, model = policy.tokenizer, policy.model
    lm_head = model.get_output_embeddings()
    generator = torch.Generator().manual_seed(seed)
    sequences = sft_sequences(tok, samples)
    kept = [i for i, sequence in enumerate(sequences) if fits(sequence, cfg.max_length)]
    rows, candidates, probabilities, rows_so_far = [], [], [], 0
    for start in range(0, len(kept), cfg.distill_batch_size):
        chunk = [sequences[i] for i in kept[start : start + cfg.distill_batch_size]]
        batch = right_pad(chunk, padding_id(tok))
        with torch.no_grad(), pass_autocast(policy.device, cfg.mixed_precision):
            hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                                      ).last_hidden_state
        for row, (ids, mask) in enumerate(chunk):
            first = mask.index(1) if 1 in mask else len(ids)
            positions = torch.arange(first - 1, len(ids) - 1)
            if len(positions) == 0:
                continue
            with torch.no_grad(), pass_autocast(policy.device, cfg.mixed_precision):
                logits = lm_head(hidden[row, positions])
            steps = min(rl_cfg.trajectory_tokens, len(positions) - 1)
            if steps > 0:
                probs = torch.softmax(logits[1 : steps + 1].float(), dim=-1)
                drawn = sample_candidates(probs, generator, rl_cfg.top_candidates, rl_cfg.top_pool,
                                          rl_cfg.random_candidates)
                rows.append(rows_so_far + torch.arange(steps))
                candidates.append(drawn)
                probabilities.append(probs.gather(1, drawn))
            rows_so_far += len(positions)
    return torch.cat(rows), torch.cat(candidates), torch.cat(probabilities)


@pytest.mark.parametrize("dtype, mixed_precision", [(torch.float32, "no"), (torch.float32, "bf16"),
                                                    (torch.bfloat16, "bf16")])
def test_trajectory_candidates_are_the_in_pass_draw_bit_for_bit(tiny_llama, samples, tmp_path, dtype,
                                                                mixed_precision):
    """RLMedusa's candidates, drawn by train_rlmedusa over the frozen pass's cache, are exactly those the pass itself
    drew before (same logits: the cache's states through the LM head under the pass's autocast, each response's rows
    at once; same generator draws in the same order), whatever the policy's dtype and the autocast; the LM head of a
    float32 copy of a bf16 pass's policy (a training stage's) gives them too; responses left out only take their
    draws, the others' candidates unchanged."""
    from transformers import AutoTokenizer

    from tests.tiny import load_spiky_tiny_llama

    policy = Policy(model=load_spiky_tiny_llama(tiny_llama, dtype=dtype),
                    tokenizer=AutoTokenizer.from_pretrained(tiny_llama), device=torch.device("cpu"), name="tiny")
    cfg = MedusaTraining(num_heads=2, distill_batch_size=3, mixed_precision=mixed_precision)
    rl_cfg = RLMedusaCandidates(trajectory_tokens=4, top_candidates=2, top_pool=10, random_candidates=3)
    data = self_distill(policy, samples, cfg, tmp_path)
    rows, candidates, probs = _in_pass_candidates(policy, samples, cfg, rl_cfg, seed=5)
    heads = [policy.model.get_output_embeddings()]
    if dtype != torch.float32:
        heads.append(load_spiky_tiny_llama(tiny_llama, dtype=torch.float32).get_output_embeddings())
    for lm_head in heads:
        drawn = trajectory_candidates(data, lm_head, rl_cfg, seed=5, mixed_precision=mixed_precision)
        assert torch.equal(drawn.rows, rows) and torch.equal(drawn.candidates, candidates)
        assert torch.equal(drawn.probs, probs)
        wanted = torch.tensor([1, 4, 6])
        some = trajectory_candidates(data, lm_head, rl_cfg, seed=5, mixed_precision=mixed_precision, samples=wanted)
        keep = torch.isin(drawn.sample, wanted)
        assert 0 < int(keep.sum()) < len(keep) and torch.equal(some.sample, drawn.sample[keep])
        assert torch.equal(some.rows, rows[keep]) and torch.equal(some.candidates, candidates[keep])
        assert torch.equal(some.probs, probs[keep])
    other = trajectory_candidates(data, heads[0], rl_cfg, seed=6, mixed_precision=mixed_precision)
    assert not torch.equal(other.candidates, candidates)  # rlmedusa.seed seeds the draw


def test_self_distill_drops_responses_longer_than_max_length_and_counts_them(policy, samples, tmp_path):
    """A sequence longer than medusa.max_length gives no positions at all (the old rule kept its first tokens, cut
    end and all); the others keep every position, with their row of the samples table; the cache counts the dropped."""
    from models.common.sequences import tokenize_sequence
    from models.medusa.training import too_long_responses

    lengths = [len(tokenize_sequence(policy.tokenizer, r.prompt, r.response, add_end=r.finish_reason == "eos")[0])
               for r in samples.itertuples()]
    max_length = sorted(set(lengths))[-2]  # the longest sequences do not fit
    cfg = MedusaTraining(num_heads=2, distill_batch_size=3, mixed_precision="no", max_length=max_length)
    data = self_distill(policy, samples, cfg, tmp_path)
    fitting = [i for i, length in enumerate(lengths) if length <= max_length]
    assert 0 < len(fitting) < len(samples) and too_long_responses(tmp_path) == len(samples) - len(fitting)
    assert sorted(set(data.sample.tolist())) == fitting
    positions = {i: int((data.sample == i).sum()) for i in fitting}
    prompt_lengths = [len(policy.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in samples["prompt"]]
    assert positions == {i: lengths[i] - prompt_lengths[i] for i in fitting}  # whole responses


def test_greedy_responses_are_the_policys_greedy_decoding(policy):
    prompts = pd.DataFrame({"prompt_id": ["a", "b", "c"], "question": ["Ben has 4 apples.", "What is 7 * 8?", "0 1"]})
    responses = greedy_responses(policy, prompts, max_new_tokens=6, batch_size=2)
    assert responses["prompt_id"].tolist() == ["a", "b", "c"] and (responses["sample_index"] == 0).all()
    for question, prompt, response in zip(prompts["question"], responses["prompt"], responses["response"]):
        assert question in prompt and prompt.endswith("<|im_start|>assistant\n")
        ids = policy.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        out = policy.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                    pad_token_id=policy.tokenizer.pad_token_id)
        assert response == policy.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert set(responses["finish_reason"]) <= {"eos", "length"}


def test_split_by_prompt_and_subset(policy, samples, tmp_path):
    cfg = MedusaTraining(num_heads=2, distill_batch_size=4, mixed_precision="no")
    data = self_distill(policy, samples, cfg, tmp_path)
    rl = trajectory_candidates(data, policy.model.get_output_embeddings(), RLMedusaCandidates(trajectory_tokens=3,
                               top_pool=10), seed=0, mixed_precision="no")
    train_rows, eval_rows = split_by_prompt(samples, eval_fraction=0.25, seed=0)
    assert len(eval_rows) == 2 and samples.iloc[eval_rows.tolist()]["prompt_id"].nunique() == 1
    assert not set(samples.iloc[train_rows.tolist()]["prompt_id"]) & set(samples.iloc[eval_rows.tolist()]["prompt_id"])
    held_out = data.subset(eval_rows)
    assert set(held_out.sample.tolist()) == set(eval_rows.tolist())
    expected = data.hidden[torch.isin(data.sample, eval_rows)]
    torch.testing.assert_close(held_out.hidden[:], expected, rtol=0, atol=0)
    # the held-out trajectory states: those of the held-out responses, rows of the whole cache
    held_out_states = rl.subset(eval_rows)
    assert set(held_out_states.sample.tolist()) == set(eval_rows.tolist())
    assert torch.equal(data.sample[held_out_states.rows], held_out_states.sample)
    torch.testing.assert_close(held_out_states.states(data)[:], data.hidden[held_out_states.rows], rtol=0, atol=0)


def test_training_changes_the_heads_not_the_backbone_and_lowers_the_loss(policy, samples, tmp_path):
    cfg = MedusaTraining(num_heads=2, epochs=4, batch_size=8, learning_rate=1e-2, distill_batch_size=4,
                       mixed_precision="no", warmup_ratio=0.0)
    data = self_distill(policy, samples, cfg, tmp_path)
    backbone = {k: v.clone() for k, v in policy.model.state_dict().items()}
    lm_head = policy.model.get_output_embeddings()
    before = evaluate_heads(heads_for(policy.model, 2), lm_head, data)
    heads, history = train_medusa_heads(policy, data, cfg)
    assert any((p != 0).any() for p in heads.parameters())  # the zero-initialised blocks moved
    assert all(torch.equal(v, policy.model.state_dict()[k]) for k, v in backbone.items())
    assert all(p.grad is None for p in policy.model.parameters())  # no gradient was even computed for it
    assert len(history["loss"]) == cfg.epochs * math.ceil(len(data.hidden) / cfg.batch_size)
    assert history["loss"][-1] < history["loss"][0]
    after = evaluate_heads(heads, lm_head, data)
    assert after["top1"][0] > before["top1"][0]  # head 1 fits its (training) targets better


def test_drafter_precision_only_changes_the_drafts(policy):
    heads = heads_for(policy.model, num_heads=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.1)
    hidden = torch.randn(policy.model.config.hidden_size)
    exact = MedusaDrafter(policy.model, heads, chain_tree(2)).logits(hidden, 0)
    cheap = MedusaDrafter(policy.model, heads, chain_tree(2), torch.bfloat16).logits(hidden, 0)
    assert exact.dtype == torch.float32 and cheap.dtype == torch.bfloat16 and exact.shape == cheap.shape == (2, policy.model.config.vocab_size)
    torch.testing.assert_close(cheap.float(), exact, rtol=0.05, atol=0.05)
    assert policy.model.get_output_embeddings().weight.dtype == torch.float32  # the policy is untouched


def test_prompt_sets_are_the_held_out_prompts_the_general_set_and_each_prompt_file(tmp_path):
    from foresight.config import parse_config
    from foresight.prompts import general_instructions
    from tasks.speculative_benchmark import _prompt_sets

    (tmp_path / "data/prompts").mkdir(parents=True)
    pd.DataFrame({"question": ["q1", "q2", "q3"]}).to_json(tmp_path / "data/prompts/eval.jsonl", orient="records",
                                                           lines=True)
    pd.DataFrame({"text": ["a", "b"]}).to_csv(tmp_path / "mine.csv", index=False)
    cfg = parse_config({"medusa_benchmark": {"num_prompts": 2, "general_prompts": 3,
                                             "prompt_files": [{"path": "mine.csv", "text_column": "text"}]}},
                       root=tmp_path)
    general = general_instructions("eval")["question"].tolist()
    sets = _prompt_sets(cfg)
    assert sets["held_out"] == ["q1", "q2"] and sets["general"] == general[:3]
    assert list(sets) == ["held_out", "general", "mine"] and sorted(sets["mine"]) == ["a", "b"]  # drawn, in any order
    without = parse_config({"medusa_benchmark": {"general_prompts": 0}}, root=tmp_path)
    assert list(_prompt_sets(without)) == ["held_out"]
    (tmp_path / "empty.csv").write_text("")
    bad = parse_config({"medusa_benchmark": {"prompt_files": [{"path": "empty.csv"}]}}, root=tmp_path)
    with pytest.raises(ValueError, match="empty.csv is empty"):
        _prompt_sets(bad)


def _mapped_files(tensor: torch.Tensor) -> set[str]:
    """The files whose memory mapping holds ``tensor``'s storage (Linux ``/proc/self/maps``)."""
    address = tensor.untyped_storage().data_ptr()
    files = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address range, permissions, offset, device, inode[, path]
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high and len(fields) == 6:
            files.add(fields[5])
    return files


def _medusa_end_to_end(policy: Policy, samples: pd.DataFrame, folder: Path) -> None:
    """Distil → Medusa-1 heads → save/load → r(e, h) → RL head 1 → tree decoding with both head sets, in the
    policy's dtype and on its device (bf16 on the CPU; bf16 on a GPU in the cuda test)."""
    from accelerate import Accelerator

    from models.engine.speculative import TreeVerifier, build_tree, speculative_generate
    from models.medusa.config import RLMedusaTraining
    from models.medusa.rlmedusa import (
        evaluate_reward_model,
        fit_reward_model,
        train_rl_head,
    )

    dtype, device = policy.model.dtype, policy.device
    lm_head, embedding = policy.model.get_output_embeddings(), policy.model.get_input_embeddings()
    accelerator = Accelerator(cpu=device.type == "cpu")
    assert accelerator.device.type == device.type
    cfg = MedusaTraining(num_heads=2, epochs=1, batch_size=16, learning_rate=1e-2, distill_batch_size=4,
                         mixed_precision="no")
    data = self_distill(policy, samples, cfg, folder / "cache")
    # the cache keeps the policy's dtype on disk and is read through a memory map, not loaded into RAM
    assert data.hidden.dtype == dtype and data.hidden[:2].dtype == dtype
    hidden_size = policy.model.config.hidden_size
    assert (folder / "cache" / "hidden.bin").stat().st_size == len(data.hidden) * hidden_size * dtype.itemsize
    if Path("/proc/self/maps").is_file():
        assert str(folder / "cache" / "hidden.bin") in _mapped_files(data.hidden.table)

    heads, history = train_medusa_heads(policy, data, cfg, accelerator)
    assert all(p.dtype == dtype and p.device.type == device.type for p in heads.parameters())
    assert any((p != 0).any() for p in heads.parameters()) and all(math.isfinite(x) for x in history["loss"])
    heads.save(folder / "supervised")
    loaded = MedusaHeads.load(folder / "supervised", lm_head)
    assert all(p.dtype == dtype and p.device.type == device.type for p in loaded.parameters())
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), heads.state_dict().values(), strict=True))

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        return embedding(tokens.to(embedding.weight.device))

    rl_cfg = RLMedusaTraining(reward_width=16, reward_epochs=2, reward_batch_size=8, num_actions=4, batch_size=8,
                              epochs=1, learning_rate=1e-2)
    rl = trajectory_candidates(data, lm_head, RLMedusaCandidates(trajectory_tokens=4, top_pool=10), rl_cfg.seed,
                               cfg.mixed_precision)
    reward_model, losses = fit_reward_model(rl.states(data), embed, rl.candidates, rl.probs, rl_cfg, accelerator)
    evaluation = evaluate_reward_model(reward_model, rl.states(data), embed, rl.candidates, rl.probs)
    assert math.isfinite(evaluation["mse"]) and all(math.isfinite(x) for x in losses)
    rl_heads, rl_history = train_rl_head(loaded, lm_head, reward_model, embed, rl.states(data), rl_cfg, accelerator)
    assert all(p.dtype == dtype and p.device.type == device.type for p in rl_heads.parameters())
    assert not torch.equal(rl_heads.blocks[0][0].linear.weight, loaded.blocks[0][0].linear.weight)  # head 1 learned
    assert torch.equal(rl_heads.blocks[1][0].linear.weight, loaded.blocks[1][0].linear.weight)
    assert all(math.isfinite(x) for x in rl_history["loss"])

    tok = policy.tokenizer
    ids = tok(samples["prompt"][0], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    greedy = policy.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                   pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    for drafting in (loaded, rl_heads):
        drafter = MedusaDrafter(policy.model, drafting, build_tree([[0], [1], [0, 0]]), torch.bfloat16)
        tokens, stats = speculative_generate(policy.model, drafter, TreeVerifier(), ids, 8, {tok.eos_token_id})
        # the root comes from the same prompt forward as greedy's first token; later ones may differ by bf16 ties
        assert 0 < len(tokens) <= 8 and tokens[0] == greedy[0] and 1 <= stats.forwards <= len(tokens)


def test_medusa_and_rlmedusa_run_end_to_end_on_a_bfloat16_policy(tiny_llama, samples, tmp_path):
    """bf16 heads train (float32 master weights under autocast), RL head 1 trains (it once met bf16 states with
    float32 heads and no autocast: a dtype error), the cache stays bf16 and memory-mapped, loading keeps bf16."""
    from transformers import AutoTokenizer

    from tests.tiny import load_spiky_tiny_llama

    model = load_spiky_tiny_llama(tiny_llama, dtype=torch.bfloat16)
    policy = Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_llama), device=torch.device("cpu"),
                    name="tiny-bf16")
    _medusa_end_to_end(policy, samples, tmp_path)


@pytest.mark.cuda
def test_medusa_and_rlmedusa_run_end_to_end_on_cuda_in_bfloat16(tiny_llama, samples, tmp_path):
    """On the GPU: the cache comes back to the CPU, the heads load onto the LM head's device, the reward model and
    the RL head read states on the accelerator's device, and both Medusa decoders run there."""
    from accelerate.state import AcceleratorState
    from transformers import AutoTokenizer

    from tests.tiny import load_spiky_tiny_llama

    model = load_spiky_tiny_llama(tiny_llama, dtype=torch.bfloat16).to("cuda")
    policy = Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_llama), device=torch.device("cuda"),
                    name="tiny-bf16")
    AcceleratorState._reset_state(True)  # earlier tests made a CPU-only state; this one needs the GPU's
    try:
        _medusa_end_to_end(policy, samples, tmp_path)
    finally:
        AcceleratorState._reset_state(True)


def _timer(tokens: list[int], seconds: list[float]):
    from foresight.benchmark import DecodeTimer

    return DecodeTimer(seconds=sum(seconds), tokens=sum(tokens), calls=len(tokens), call_seconds=seconds,
                       call_tokens=tokens)


def test_speed_rows_against_hand_worked_numbers():
    from tasks.speculative_benchmark import _speed_rows

    def record(decoder, i, tokens, forwards=None, plain=None, batch=1):
        return {"prompt_index": i, "decoder": decoder, "batch": batch, "tokens": tokens, "new_tokens": len(tokens),
                "forwards": forwards, "plain_forwards": plain}

    records = [record("greedy", 0, [1, 2, 3, 4]), record("prompt_lookup", 0, [1, 2, 3, 4]),
               record("medusa", 0, [1, 2, 3, 4], 2, 1),
               record("greedy", 1, [5, 6]), record("prompt_lookup", 1, [5, 7]), record("medusa", 1, [5, 6], 1, 0),
               # the batched decoder decodes every prompt, prompt 2 (not timed) included
               record("medusa_batched", 0, [1, 2, 3, 4], 2, 0, 40), record("medusa_batched", 1, [5, 6], 1, 0, 40),
               record("medusa_batched", 2, [7, 8, 0], 2, 0, 40)]
    timers = {"greedy": _timer([4, 2], [1.0, 0.5]), "prompt_lookup": _timer([4, 2], [0.8, 0.4]),
              "medusa": _timer([4, 2], [0.5, 0.5])}
    reference = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]  # batched greedy, every prompt
    rows = {r["decoder"]: r for r in _speed_rows("held_out", records, timers, reference)}
    assert list(rows) == ["greedy", "prompt_lookup", "medusa", "medusa_batched"]
    medusa, batched, greedy, lookup = rows["medusa"], rows["medusa_batched"], rows["greedy"], rows["prompt_lookup"]
    # τ = Σ tokens / Σ forwards = 9 / 5; per-prompt ratios 2, 2, 1.5 bound every resample's ratio
    assert batched["tau"] == pytest.approx(1.8) and 1.5 <= batched["tau_low"] <= 1.8 <= batched["tau_high"] <= 2.0
    assert batched["tau_significant"]  # above 1 on every resample
    assert batched["identical_to_greedy"] == pytest.approx(2 / 3) and batched["plain_share"] == 0
    assert (batched["batch"], batched["prompts"], batched["speed_prompts"]) == (40, 3, 0)
    assert "speedup_vs_reference" not in batched  # untimed
    # batch 1: 6 tokens in 3 forwards, one of them plain
    assert medusa["tau"] == medusa["tau_low"] == medusa["tau_high"] == pytest.approx(2.0)
    assert medusa["identical_to_greedy"] == 1.0 and medusa["plain_share"] == pytest.approx(1 / 3)
    assert (medusa["batch"], medusa["prompts"], medusa["speed_prompts"]) == (1, 2, 2)
    assert medusa["speedup_vs_reference"] == pytest.approx((6 / 1.0) / (6 / 1.5))
    assert medusa["speedup_vs_reference_low"] <= medusa["speedup_vs_reference"] <= medusa["speedup_vs_reference_high"]
    assert greedy["tau"] == greedy["tau_low"] == greedy["tau_high"] == 1.0 and not greedy["tau_significant"]
    assert greedy["identical_to_greedy"] == 1.0 and greedy["speedup_vs_reference"] == pytest.approx(1.0)
    assert math.isnan(lookup["tau"]) and math.isnan(lookup["plain_share"])  # no forward counts from HF
    assert lookup["identical_to_greedy"] == 0.5 and lookup["prompts"] == 2
    assert lookup["speedup_vs_reference"] == pytest.approx(1.25)
    # where batch-1 greedy itself differs from the batched reference (half-precision rounding), its row says so
    rounded = {r["decoder"]: r for r in _speed_rows("held_out", records, timers, [[1, 2, 3, 4], [5, 9], [7, 8, 9]])}
    assert rounded["greedy"]["identical_to_greedy"] == 0.5
    assert rounded["medusa"]["identical_to_greedy"] == 0.5
    assert rounded["medusa_batched"]["identical_to_greedy"] == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def spiky_policy_dir(tiny_llama, tmp_path_factory) -> Path:
    """A prepared policy folder (``manifest.json`` + float32 weights) of the spiky tiny Llama, whose greedy outputs
    vary from token to token."""
    import json

    from transformers import AutoTokenizer

    from tests.tiny import load_spiky_tiny_llama

    folder = tmp_path_factory.mktemp("spiky-policy")
    load_spiky_tiny_llama(tiny_llama).save_pretrained(folder / "weights")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder / "weights")
    (folder / "manifest.json").write_text(json.dumps({"kind": "folder", "path": "weights"}))
    return folder


def _policy_cfg(policy_dir: Path, root: Path, dtype: str = "float32", **sections):
    from foresight.config import parse_config

    return parse_config({"policy": {"model": str(policy_dir), "dtype": dtype, "device": "cpu"},
                         "paths": {"policy_dir": str(policy_dir)}, **sections}, root=root)


def test_divergences_report_the_margin_at_the_first_differing_token(spiky_policy_dir, tmp_path):
    """A bf16 policy: the margins come from its own forward over prompt + common prefix, the float32 check from the
    float32 weights on disk — each compared with an independent forward over the whole greedy output."""
    from models.engine.decoding import GREEDY, hf_decode
    from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
    from tasks.common import load_stage_policy
    from tasks.speculative_benchmark import _DivergenceChecks

    cfg = _policy_cfg(spiky_policy_dir, tmp_path, dtype="bfloat16")
    policy = load_stage_policy(cfg, "base")
    float32 = load_stage_policy(_policy_cfg(spiky_policy_dir, tmp_path), "base").model
    assert policy.model.dtype == torch.bfloat16 and float32.dtype == torch.float32
    prompts = [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, ["Ben has 4 apples.", "0 1 2"])]
    greedy = [hf_decode(policy, [p[0].tolist()], GREEDY, 8, end_token_ids(policy), batch_size=1)[0] for p in prompts]
    assert len(greedy[0]) > 4
    vocab = policy.model.config.vocab_size
    changed = [*greedy[0][:3], (greedy[0][3] + 1) % vocab]  # differs at position 3
    records = [{"decoder": "greedy", "prompt_index": i, "tokens": g} for i, g in enumerate(greedy)]
    checks = _DivergenceChecks(cfg, policy)
    assert checks("held_out", records + [{"decoder": "medusa", "prompt_index": 1, "tokens": greedy[1]}], prompts,
                  greedy) == []
    assert checks.float32 is None  # loaded only when a divergence needs it
    first_differs = [(greedy[1][0] + 1) % vocab, *greedy[1][1:]]  # no common prefix: the prompt alone is the context
    rows = checks("held_out", records + [{"decoder": "medusa", "prompt_index": 0, "tokens": changed},
                                         {"decoder": "medusa", "prompt_index": 1, "tokens": greedy[1][:2]},
                                         {"decoder": "other", "prompt_index": 1, "tokens": first_differs}], prompts,
                  greedy)
    assert [(r["prompt_index"], r["position"]) for r in rows] == [(0, 3), (1, 2), (1, 0)]
    assert rows[2]["decoder_token"] == first_differs[0] and rows[2]["float32_choice"] in ("greedy", "other")
    assert "margin" not in rows[1]  # a shorter output has no token of its own there
    row, g, d = rows[0], greedy[0][3], changed[3]
    assert (row["greedy_token"], row["decoder_token"]) == (g, d)
    assert row["greedy_text"] == policy.tokenizer.decode([g])
    full = torch.cat([prompts[0][0], torch.tensor(greedy[0])])[None]
    at = prompts[0].shape[1] + 3 - 1  # the logits that choose output position 3
    with torch.no_grad():
        logits = policy.model(input_ids=full).logits[0, at].float()
        exact = float32(input_ids=full).logits[0, at]
    assert row["margin"] == pytest.approx(float(logits[g] - logits[d]), abs=0.25)  # bf16: one logit ulp or two
    top2 = logits.topk(2).values
    assert row["top2_margin"] == pytest.approx(float(top2[0] - top2[1]), abs=0.25)
    assert row["float32_margin"] == pytest.approx(float(exact[g] - exact[d]), abs=1e-4)
    assert row["float32_choice"] == ("greedy" if int(exact.argmax()) == g else "other")
    assert row["argmax"] in ("greedy", "other") and row["margin"] > -0.25
    assert checks.float32 is not None and checks.float32.dtype == torch.float32


def test_medusa_stages_distil_the_general_set_and_benchmark_each_prompt_set(spiky_policy_dir, tmp_path):
    """distill and train_medusa on task + general prompts, then benchmark_medusa on a float32 policy: each prompt set
    reported separately, every drafter side by side, τ from the decoded outputs, greedy-verified (adaptive, a fixed
    cycle cost: deterministic) Medusa and MTP drafting — chain and dynamic tree, batch 1 and batched — identical to
    HF greedy everywhere; the dynamic tree's budget calibrated at the start."""
    from foresight.prompts import general_instructions
    from models.medusa.rlmedusa import trajectory_candidates
    from models.mtp.dynamic_tree import pool_size
    from tasks.common import load_stage_policy
    from tasks.distilled import drafter_split, sft_responses
    from tasks.distill import distill_task
    from tasks.medusa import load_distilled, train_medusa_task, train_rlmedusa_task
    from tasks.speculative_benchmark import benchmark_medusa_task, candidate_tree
    from tests.helpers import perturbed_module

    prompts = tmp_path / "data/prompts"
    prompts.mkdir(parents=True)
    for split, questions in {"train": ["Ben has 4 apples.", "Ivy has 3 cookies.", "What is 7 * 8?", "0 1 2 3"],
                             "eval": ["Ava has 2 marbles.", "What is 3 + 5?", "9 8 7"]}.items():
        pd.DataFrame({"prompt_id": [f"{split}{i}" for i in range(len(questions))], "question": questions,
                      "answer": None, "source": "arithmetic"}).to_json(prompts / f"{split}.jsonl", orient="records",
                                                                       lines=True)
    cfg = _policy_cfg(
        spiky_policy_dir, tmp_path,
        distill={"batch_size": 4, "task_prompts": 6, "general_prompts": 3, "max_new_tokens": 8, "eval_fraction": 0.4},
        medusa={"num_heads": 2, "epochs": 1, "batch_size": 16, "distill_batch_size": 4, "mixed_precision": "no"},
        rlmedusa={"trajectory_tokens": 4, "top_pool": 10},
        medusa_benchmark={"tree": [[0], [1], [0, 0]], "num_prompts": 3, "speed_prompts": 2, "general_prompts": 2,
                          "max_new_tokens": 8, "curve_batch_sizes": [1, 2], "curve_batches": 2,
                          "curve_sets": ["held_out", "general"], "adaptation": {"cycle_cost": 1.0}})
    assert cfg.medusa_benchmark.decoders == ["greedy", "prompt_lookup", "medusa_supervised", "mtp_chain", "mtp_tree"]

    distilled = distill_task.fn(cfg)
    trained = train_medusa_task.fn(cfg)
    responses = pd.read_parquet(tmp_path / "data/distill/responses.parquet")
    general = general_instructions("train", 3)["question"].tolist()
    # the 4 training prompts, 2 further arithmetic problems (task_prompts 6), then the general instructions
    assert responses["prompt_set"].tolist() == ["task"] * 6 + ["general"] * 3
    assert responses["further_prompt"].tolist() == [False] * 4 + [True] * 2 + [False] * 3
    assert all(q in p for q, p in zip(general, responses["prompt"][6:], strict=True))
    assert all("'The answer is <number>.'" in p for p in responses["prompt"][4:6])
    assert responses["prompt"][6].startswith("<|im_start|>user\n") and responses["prompt"][6].endswith("assistant\n")
    assert (distilled.metrics["num_task_responses"], distilled.metrics["num_general_responses"]) == (6, 3)
    assert trained.metrics["num_responses"] == 9 and trained.metrics["num_responses_dropped_too_long"] == 0
    # prompts over the prompt limit: none here, counted per set all the same
    assert distilled.metrics["dropped_long_prompts.further"] == distilled.metrics["dropped_long_prompts.general"] == 0
    # the further prompts' responses are the heads' alone: COrAL and the MTP module fine-tune on the others
    assert sft_responses(cfg, "distilled", "coral.data")["prompt_id"].tolist() == (
        responses["prompt_id"][~responses["further_prompt"]].tolist())
    # one held-out split for every drafter: the further prompts' responses all train; COrAL's and the MTP module's
    # held-out sequences are exactly Medusa's
    _, medusa_train, medusa_eval = load_distilled(cfg)
    assert responses["further_prompt"][medusa_eval.tolist()].eq(False).all() and len(medusa_eval) > 0
    assert set(responses.index[responses["further_prompt"]]) <= set(medusa_train.tolist())
    shared = sft_responses(cfg, "distilled", "mtp.data")
    _, drafter_eval = drafter_split(cfg, shared, 0.9, 123)  # eval_fraction and seed play no part for distilled data
    assert shared["distilled_row"][drafter_eval.tolist()].tolist() == medusa_eval.tolist()
    evaluation = json.loads((tmp_path / "data/medusa/supervised/evaluation.json").read_text())
    assert evaluation["held_out_by_prompt_set"] and set(evaluation["held_out_by_prompt_set"]) <= {"task", "general"}
    # the auto tree: the paths held-out drafts were accepted on most often, measured jointly, most frequent first
    paths = evaluation["path_acceptance"]
    frequencies = [entry["acceptance"] for entry in paths]
    assert paths and frequencies == sorted(frequencies, reverse=True) and 0 < frequencies[-1] <= frequencies[0] <= 1
    # RLMedusa too learns from the training split's responses to training prompts and general instructions only
    rl = train_rlmedusa_task.fn(cfg.model_copy(update={"rlmedusa": cfg.rlmedusa.model_copy(
        update={"reward_epochs": 1, "epochs": 1, "inits": ["supervised"]})}))
    data, train_rows, _ = load_distilled(cfg)
    kept = torch.tensor([row for row in train_rows.tolist() if not responses["further_prompt"][row]])
    assert 0 < len(kept) < len(train_rows)  # further prompts' responses are among the training split's, left out
    states = trajectory_candidates(data, load_stage_policy(cfg, "base").model.get_output_embeddings(), cfg.rlmedusa,
                                   cfg.rlmedusa.seed, cfg.medusa.mixed_precision)
    assert rl.metrics["num_trajectory_states"] == int(torch.isin(states.sample, kept).sum()) > 0
    auto = cfg.model_copy(update={"medusa_benchmark": cfg.medusa_benchmark.model_copy(update={"tree": "auto",
                                                                                              "tree_size": 2})})
    assert [list(choice) for choice in candidate_tree(auto).choices] == sorted(
        (entry["path"] for entry in paths[:2]), key=lambda path: (len(path), path))

    # the MTP module the mtp_* decoders draft with (train_mtp's output): its initial copy of the last layer, whose
    # drafts are sometimes right here
    perturbed_module(load_stage_policy(cfg, "base").model, 2, scale=0.0).save(tmp_path / "data/mtp/module")
    result = benchmark_medusa_task.fn(cfg)
    assert result.metrics["dropped_long_prompts.held_out"] == result.metrics["dropped_long_prompts.general"] == 0
    out = tmp_path / "data/benchmarks/medusa"
    table = pd.read_csv(out / "table.csv")
    timed = ["greedy", "prompt_lookup", "medusa_supervised", "mtp_chain", "mtp_tree"]
    assert table["prompt_set"].tolist() == ["held_out"] * 8 + ["general"] * 8
    # every drafter side by side, batch 1 and batched (the dynamic tree: each row its own)
    assert table["decoder"].tolist() == [*timed, "medusa_supervised_batched", "mtp_chain_batched",
                                         "mtp_tree_batched"] * 2
    assert table["batch"].tolist() == [1, 1, 1, 1, 1, 40, 40, 40] * 2
    assert "lossless" not in table.columns
    by = table.set_index(["prompt_set", "decoder"])
    # batch 1 on the timed prompts only; batched on the whole set, untimed
    assert (table.loc[table["batch"] == 1, "prompts"] == 2).all()
    assert (table["speed_prompts"] == [2, 2, 2, 2, 2, 0, 0, 0] * 2).all()
    assert by.loc[("held_out", "medusa_supervised_batched"), "prompts"] == 3
    assert by.loc[("general", "mtp_chain_batched"), "prompts"] == 2
    assert by["speedup_vs_reference"].isna().tolist() == [False] * 5 + [True] * 3 + [False] * 5 + [True] * 3
    # float32: every greedy-verified drafter's output is HF greedy's, token for token
    assert (table.loc[table["decoder"] != "prompt_lookup", "identical_to_greedy"] == 1.0).all()
    outputs = pd.read_parquet(out / "outputs.parquet")
    tree_rows = outputs[outputs["decoder"] == "mtp_tree"]
    assert tree_rows["forwards"].sum() < tree_rows["new_tokens"].sum()  # drafts were accepted: identity is no accident
    for (prompt_set, decoder), mine in outputs[outputs["decoder"].str.startswith(("medusa", "mtp"))].groupby(
            ["prompt_set", "decoder"]):
        row = by.loc[(prompt_set, decoder)]
        assert row["tau"] == pytest.approx(mine["new_tokens"].sum() / mine["forwards"].sum())
        assert row["tau_low"] <= row["tau"] <= row["tau_high"] and 0 <= row["plain_share"] <= 1
    assert pd.read_parquet(out / "divergences.parquet").empty
    report = (out / "report.md").read_text()
    assert "## Prompt set `held_out`" in report and "## Prompt set `general`" in report and " [" in report
    assert result.metrics["divergences"] == 0 and "general.medusa_supervised.tau_low" in result.metrics
    # the speed curve: every set, batch size and decoder; batched Medusa equal to HF batched greedy row for row
    curve = pd.read_csv(out / "speed_curve.csv")
    assert list(zip(curve["prompt_set"], curve["batch"], curve["decoder"], strict=True)) == [
        (prompt_set, batch, decoder) for prompt_set in ("held_out", "general") for batch in (1, 2)
        for decoder in ("greedy", "medusa_supervised", "mtp_chain", "mtp_tree")]
    drafting = curve[curve["decoder"] != "greedy"]
    assert (drafting["identical_to_reference"] == 1.0).all() and drafting["tokens_per_forward"].notna().all()
    assert (drafting["speedup_vs_reference_low"] <= drafting["speedup_vs_reference_high"]).all()
    assert curve.loc[curve["decoder"] == "greedy", "speedup_vs_reference"].isna().all()  # no ratio to itself
    assert (out / "speed_curve.png").is_file() and "## Speed against batch size" in report
    assert "held_out.medusa_supervised.batch2.speedup_vs_reference_low" in result.metrics
    assert "general.mtp_chain.batch2.speedup_vs_reference" in result.metrics
    # budget: auto, calibrated at the start: costs by width up to the whole pool, τ and the expected speedup of each
    # budget, its plot, and the budget of the highest expected speedup
    costs = pd.read_csv(out / "verification_cost.csv")
    pool = pool_size(cfg.medusa_benchmark.dynamic_tree)
    assert costs["width"].tolist() == [w for w in (1, 4, 8, 16, 24, 32, 48) if w <= pool] + [pool + 1]
    assert costs["cost_vs_one_token"].iloc[0] == 1.0 and costs["tau"].iloc[1:].is_monotonic_increasing
    best = costs.loc[costs["expected_speedup"].idxmax()]
    assert result.metrics["mtp_tree.budget"] == best["nodes"]
    assert result.metrics["mtp_tree.budget_expected_speedup"] == pytest.approx(best["expected_speedup"])
    assert (out / "verification_cost.png").is_file() and "## The dynamic tree's budget and depth" in report
    # and its depth: the depth of the highest expected speedup, each depth at its best budget
    depths = pd.read_csv(out / "draft_depth.csv")
    assert depths["depth"].tolist() == list(range(1, cfg.medusa_benchmark.dynamic_tree.depth + 1))
    assert result.metrics["mtp_tree.depth"] == depths.loc[depths["expected_speedup"].idxmax(), "depth"]
    assert depths["expected_speedup"].max() == pytest.approx(best["expected_speedup"])
    assert {"held_out.mtp_tree.speedup_vs_reference", "general.mtp_tree.speedup_vs_reference"} <= set(result.metrics)


class _Handed(Exception):
    """Raised by a stand-in for model code: the task got as far as handing it its config."""


def _handed_to(handed: dict, name: str):
    """A stand-in for model code ``name`` that keeps its arguments in ``handed[name]`` and stops the task."""
    def stand_in(*args):
        handed[name] = args
        raise _Handed(name)
    return stand_in


def test_medusa_sections_are_their_components_and_their_keys_reach_the_model_code(policy, samples, monkeypatch,
                                                                                  tmp_path):
    """Each section is-a component its task hands to the model code (no copy that could drop a key): a params.yaml
    key naming a component field reaches the object the model code gets."""
    import tasks.medusa as task
    from foresight.config import load_config
    from models.engine.config import TypicalAcceptance
    from models.medusa.config import MedusaBenchmarkConfig, MedusaConfig, RLMedusaConfig, RLMedusaTraining

    assert issubclass(MedusaConfig, MedusaTraining) and issubclass(MedusaBenchmarkConfig, TypicalAcceptance)
    assert issubclass(RLMedusaConfig, RLMedusaCandidates) and issubclass(RLMedusaConfig, RLMedusaTraining)
    cfg = load_config(Path(__file__).resolve().parent.parent / "params.yaml", {
        "paths.medusa_dir": str(tmp_path / "medusa"), "medusa.num_heads": 3, "medusa.mixed_precision": "no",
        "rlmedusa.top_pool": 7, "rlmedusa.beta": 0.25, "rlmedusa.seed": 3, "medusa_benchmark.acceptance": "typical",
        "medusa_benchmark.typical_alpha": 0.5})
    handed = {}
    monkeypatch.setattr(task, "load_stage_policy", lambda *args, **kwargs: policy)

    # train_medusa: the frozen pass gets medusa (MedusaTraining)
    monkeypatch.setattr(task, "shared_distilled_responses", lambda *args, **kwargs: samples.assign(further_prompt=False))
    monkeypatch.setattr(task, "self_distill", _handed_to(handed, "self_distill"))
    with pytest.raises(_Handed):
        task.train_medusa_task.fn(cfg)
    _, _, medusa, _ = handed["self_distill"]
    assert isinstance(medusa, MedusaTraining) and medusa.num_heads == 3

    # train_rlmedusa: the candidates' draw gets rlmedusa (RLMedusaCandidates), its seed and the pass's autocast; the
    # reward model's fit gets rlmedusa (RLMedusaTraining)
    heads_for(policy.model, 3).save(tmp_path / "medusa" / "supervised")
    data = type("Distilled", (), {"subset": lambda self, rows: self, "hidden": HiddenStates(torch.zeros(2, 4))})()
    monkeypatch.setattr(task, "load_distilled", lambda *args: (data, torch.tensor([0]), torch.tensor([1])))
    monkeypatch.setattr(task, "shared_distilled_responses", lambda *args: pd.DataFrame(index=[0, 1]))

    def draw(data, lm_head, candidates, seed, mixed_precision, samples):
        handed["trajectory_candidates"] = candidates, seed, mixed_precision
        return TrajectoryStates(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.long),
                                torch.zeros(2, 2))

    monkeypatch.setattr(task, "trajectory_candidates", draw)
    monkeypatch.setattr(task, "fit_reward_model", _handed_to(handed, "fit_reward_model"))
    with pytest.raises(_Handed):
        task.train_rlmedusa_task.fn(cfg)
    candidates, seed, mixed_precision = handed["trajectory_candidates"]
    assert isinstance(candidates, RLMedusaCandidates) and candidates.top_pool == 7
    assert (seed, mixed_precision) == (3, "no")
    rl = handed["fit_reward_model"][4]
    assert isinstance(rl, RLMedusaTraining) and rl.beta == 0.25


def test_the_benchmarks_adaptation_and_typical_acceptance_come_from_params(policy, monkeypatch, tmp_path):
    """``medusa_benchmark.adaptation`` is the rule of every AdaptiveDrafting the benchmark builds (batch 1 and the
    speed curve), and the section itself, with its ``typical_*`` knobs, the typical verifier's rule."""
    import tasks.speculative_benchmark as task
    from foresight.config import load_config

    from models.mtp.module import MTPModule, MTPModuleConfig

    cfg = load_config(Path(__file__).resolve().parent.parent / "params.yaml", {
        "paths.medusa_dir": str(tmp_path / "medusa"), "paths.mtp_dir": str(tmp_path / "mtp"),
        "medusa_benchmark.adaptation.window": 5, "medusa_benchmark.acceptance": "typical",
        "medusa_benchmark.typical_alpha": 0.5})
    heads_for(policy.model, 2).save(tmp_path / "medusa" / "supervised")
    MTPModule(policy.model, MTPModuleConfig(2)).save(tmp_path / "mtp" / "module")
    rules, verifiers = [], []
    monkeypatch.setattr(task, "AdaptiveDrafting", lambda adaptation: rules.append(adaptation))
    monkeypatch.setattr(task, "TreeVerifier", lambda acceptance: verifiers.append(acceptance))
    dynamic = cfg.medusa_benchmark.dynamic_tree.model_copy(update={"budget": 3})
    decoders, drafters = task._medusa_decoders(cfg, policy, chain_tree(2), task._mtp_draft_parts(cfg, policy), dynamic)
    # the default decoders: every drafter side by side, batch 1 and batched
    assert list(decoders) == ["greedy", "prompt_lookup", "medusa_supervised", "mtp_chain", "mtp_tree"]
    assert list(drafters) == ["medusa_supervised", "mtp_chain", "mtp_tree"] and len(rules) == 3
    assert verifiers == [cfg.medusa_benchmark] and verifiers[0].typical_alpha == 0.5

    def each_once(decoders, prompts, decode, *args):
        for decoder in decoders[1:]:
            decode(decoder, prompts[:1], 2)
        return []

    monkeypatch.setattr(task, "batch_speed_curve", each_once)
    monkeypatch.setattr(task, "batched_speculative_generate", lambda *args: ([[]], []))
    task._speed_curve(cfg, policy, drafters, [[1, 2, 3]], set(), "held_out")
    assert len(rules) == 6 and all(rule.window == 5 and rule == cfg.medusa_benchmark.adaptation for rule in rules)
