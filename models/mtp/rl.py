"""GRPO with MTP-drafted rollouts and the advantage-aware MTP loss (MTP-RL §3.2, eq. 2–5, docs/mtp.md),
and the paper's baselines (§2.2, Table 1) in one harness.

One RL step (of :func:`train_variant`): sample G rollouts per prompt at temperature T — by plain sampling (vanilla
GRPO) or speculatively with K chained MTP drafts and speculative sampling, which leaves the rollouts'
distribution exactly the policy's — score them all with the reward function given (:data:`RewardFunction`: the
configured labeler's ``score``, the verifiable answer check on prompts with known answers or a reward model
such as ArmoRM on open prompts, :mod:`models.labeling.labelers`), normalise advantages within each group, then
one update:

    L_main = L_GRPO + L_Adv          L_MTP = L_Adv          L_Adv = w·KL(π_main ‖ π_MTP) + β·CE     (eq. 4, 5)

with w = 1[A ≥ 0] per sample (eq. 2). One backward of L_GRPO + L_Adv reaches both: the policy through the
GRPO term, through the KL's π_main and through the hidden states and shared embedding / head the module
reads; the module through L_Adv. The baselines change one thing each (:class:`Variant`): no drafts
(``vanilla``), a module that never trains (``frozen_mtp``), CE alone (``ce_only``), or L_Adv cut off from
the policy (``no_backprop``: the module reads detached states and the policy's parameters are frozen while
its loss is built). Ours, ``mtp_rl_detached``: MTP-RL with the KL's target π_main detached, so that the KL pulls
the module toward the policy but not the policy toward the module (L_Adv still reaches the policy through the
hidden states the module reads): at a learning rate that moves a 135M policy, the paper's reading let the KL drag
the policy onto its module's worse predictions (docs/mtp.md, "MTP-RL's collapse").

Rollouts are sampled as batches (a step's prompts × G rows, ``rollout_batch_size``), as RL systems sample them:
vanilla by HF batched sampling, the drafting variants by the batched speculative engine
(:mod:`models.engine.batched`: MTP's chained drafts and speculative sampling batched over the rows, each rollout
with its own seeded stream, so every variant draws from the same streams).

Why a compact trainer rather than TRL's ``GRPOTrainer``: MTP-RL needs (a) rollouts from our own batched
speculative sampler, timed per batch, with per-batch acceptance counters, and (b) a second model (the MTP
module) trained in the same backward from the policy's hidden states. TRL's trainer owns generation and the
loss; bending both would take more code than the ~100 lines of GRPO here, whose pieces
(:mod:`models.mtp.grpo`) are tested on hand-worked numbers against TRL's definitions.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from models.common.curves import log_step
from models.common.lora import adapters_disabled, is_lora, memory_saving, merged
from models.common.sequences import padding_id, right_pad
from models.common.training import float32_master_weights, half_dtype, step_precision
from models.engine.batched import BatchSampling, batched_speculative_generate
from models.engine.config import DynamicTree
from models.engine.policy import Policy
from models.engine.speculative import AdaptiveDrafting, SpeculativeStats, last_hidden_forward
from models.labeling.answers import cut_by_length
from models.mtp.config import MTPRLTraining, VariantName
from models.mtp.dynamic_tree import MTPBatchTreeDrafter
from models.mtp.grpo import group_advantages, grpo_loss, token_logps, zero_std_groups
from models.mtp.module import (
    MTPBatchDrafter,
    MTPModule,
    advantage_aware_kl,
    advantage_mask,
    depth_targets,
    draft_parts,
    mtp_cross_entropy,
)

if TYPE_CHECKING:
    from accelerate import Accelerator


RewardFunction = Callable[..., list[float]]
"""``reward_fn(questions, responses, answers, truncated=...) -> rewards``, one finite reward per response: a
labeler's bound ``score`` fits. ``answers``: the prompts' known answers, None where a prompt has none (a reward
model needs none); ``truncated``: per response, whether ``max_new_tokens`` cut it before an end token (the
verifiable labeler then credits only a marked answer, :mod:`models.labeling.answers`)."""


@dataclass(frozen=True)
class Variant:
    """What one RL run does with the MTP module."""

    name: VariantName
    drafts: bool  # rollouts drafted by the module (else plain sampling)
    trains_module: bool  # the module gets an optimizer and L_Adv
    kl: bool  # L_Adv includes the advantage-aware KL
    ce_weight: float  # weight of the module's CE in L_Adv
    backprop_into_policy: bool  # L_Adv's gradient reaches the policy
    kl_moves_policy: bool = False  # the KL's target π_main takes gradient too (pulls the policy toward the module)


def variant(name: VariantName, cfg: MTPRLTraining) -> Variant:
    """The named variant with its loss weights from ``cfg`` (what each changes: the module docstring)."""
    variants = {
        "vanilla": Variant("vanilla", drafts=False, trains_module=False, kl=False, ce_weight=0.0,
                           backprop_into_policy=False),
        "mtp_rl": Variant("mtp_rl", drafts=True, trains_module=True, kl=True, ce_weight=cfg.beta,
                          backprop_into_policy=True, kl_moves_policy=True),
        "mtp_rl_detached": Variant("mtp_rl_detached", drafts=True, trains_module=True, kl=True, ce_weight=cfg.beta,
                                   backprop_into_policy=True),
        "frozen_mtp": Variant("frozen_mtp", drafts=True, trains_module=False, kl=False, ce_weight=0.0,
                              backprop_into_policy=False),
        "ce_only": Variant("ce_only", drafts=True, trains_module=True, kl=False, ce_weight=cfg.ce_only_weight,
                           backprop_into_policy=True),
        "no_backprop": Variant("no_backprop", drafts=True, trains_module=True, kl=True, ce_weight=cfg.beta,
                               backprop_into_policy=False),
    }
    if name not in variants:
        raise ValueError(f"unknown MTP-RL variant {name!r}; choose from {sorted(variants)}")
    return variants[name]


@dataclass(frozen=True)
class RolloutCounts:
    """One rollout batch's counters: the unit the intervals of rollout speed, τ and α resample (a step's totals hide
    how much batches vary). Batches of the same place in the run hold the same prompts and sampling streams in
    every variant."""

    seconds: float  # wall time of sampling the batch; the phase's set-up (the draft copies) counts in its first
    tokens: int
    cycles: int  # draft–verify cycles, one per row per cycle (0 for plain sampling)
    cycle_tokens: int  # tokens those cycles produced, each cycle's bonus token included
    drafted: int  # draft tokens offered for verification
    accepted: int  # of which accepted
    # the policy forwards each row took part in, summed over the rows (prefills included; plain sampling: one per
    # token): tokens / forwards = tokens per target forward, plain steps and draft–verify cycles alike
    forwards: int
    rows: int = 1  # rollouts in the batch


@dataclass
class Rollouts:
    """One step's completions, group by group (G consecutive rows per prompt)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor  # (N·G,): the reward function's
    seconds: float  # wall time of the rollout phase (sampling; scoring not included)
    stats: SpeculativeStats  # draft counters over every rollout (empty for plain sampling)
    reward_seconds: float = 0.0  # wall time of scoring the rollouts
    counts: list[RolloutCounts] = field(default_factory=list)  # per rollout batch, in order


def rollout_generator(seed: int, step: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The sampling stream of rollout ``index`` of ``step``: the same for every variant.

    On the policy's ``device``: ``torch.multinomial`` draws only with a generator on its probabilities' device, so
    a CPU stream fails on a CUDA policy. A CUDA stream gives other numbers than a CPU one of the same seed; every
    variant still draws from the same streams."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step * 1_009 + index)


@torch.no_grad()
def sample_plainly(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_ids: set[int],
                   temperature: float, generator: torch.Generator) -> list[list[int]]:
    """Vanilla rollouts: HF ``generate`` of the batch (left-padded), pure temperature sampling, seeded from
    ``generator`` (the batch's first rollout's stream); each completion cut after its end token."""
    device = generator.device
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding: every row's next token comes after the same column
        input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, device=device)
        attention_mask[row, width - len(prompt):] = 1
    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator, device=device)))
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                         eos_token_id=sorted(eos_token_ids), pad_token_id=sorted(eos_token_ids)[0])
    completions = []
    for new in out[:, width:].tolist():
        ended = next((i for i, t in enumerate(new) if t in eos_token_ids), None)
        completions.append(new if ended is None else new[: ended + 1])
    return completions


def sample_speculatively(model, draft_base, draft_module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         eos_token_ids: set[int], temperature: float, draft_temperature: float,
                         generators: Sequence[torch.Generator], drafting: AdaptiveDrafting | None = None,
                         tree: DynamicTree | None = None) -> tuple[list[list[int]], list[SpeculativeStats]]:
    """Each prompt's completion sampled at ``temperature`` by batched speculative sampling with the MTP module's
    chained drafts (``draft_base`` / ``draft_module``: :func:`models.mtp.module.draft_parts`' copies) — or, with
    ``tree`` (its budget a number), each row's EAGLE-2 dynamic tree of the module's top-k tokens — row i drawing
    from ``generators[i]``: the distribution :func:`sample_plainly` samples from. ``drafting``: the adaptive
    decision state (None: always draft). Returns the tokens and each row's counters."""
    drafter = (MTPBatchDrafter(draft_base, draft_module, draft_temperature, generators) if tree is None
               else MTPBatchTreeDrafter(draft_base, draft_module, tree, tree.budget))
    return batched_speculative_generate(model, drafter, BatchSampling(temperature, generators), prompts,
                                        max_new_tokens, eos_token_ids, drafting)


def rollout_rewards(reward_fn: RewardFunction, questions: Sequence[str], answers: Sequence[str | None],
                    responses: Sequence[str], group_size: int,
                    truncated: Sequence[bool] | None = None) -> torch.Tensor:
    """(N·G,): every rollout's reward from one call of ``reward_fn`` (a reward model scores in batches), each
    prompt's question and answer repeated for its G consecutive rollouts; ``truncated``: per rollout, whether the
    length limit cut it (None: none was). A reward that is not a finite number would poison its whole group's
    advantages: an error."""
    rewards = reward_fn([q for q in questions for _ in range(group_size)], list(responses),
                        [a for a in answers for _ in range(group_size)], truncated=truncated)
    if len(rewards) != len(responses):
        raise ValueError(f"the reward function returned {len(rewards)} rewards for {len(responses)} rollouts")
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"the reward function returned non-finite rewards {[rewards[i] for i in bad[:5]]} for "
                         f"rollouts {bad[:10]} of {len(rewards)}: GRPO's group advantages need finite rewards")
    return torch.tensor(rewards, dtype=torch.float32)


def rollout_drafting(cfg: MTPRLTraining) -> AdaptiveDrafting | None:
    """A fresh decision state for drafted rollouts under ``cfg.adaptive`` (draft only while it pays, by the rule
    ``cfg.adaptation``; the rollouts' distribution stays exact either way), else None (always draft)."""
    return AdaptiveDrafting(cfg.adaptation) if cfg.adaptive else None


def collect_rollouts(model, tokenizer, module: MTPModule | None, prompts: Sequence[torch.Tensor],
                     questions: Sequence[str], answers: Sequence[str | None], reward_fn: RewardFunction,
                     cfg: MTPRLTraining, step: int, eos_token_ids: set[int], first_prompt: int = 0,
                     on_rollout: Callable[[], None] | None = None,
                     drafting: AdaptiveDrafting | None = None) -> Rollouts:
    """G rollouts per prompt, sampled in batches of ``cfg.rollout_batch_size`` rows (None: all in one) — by HF
    batched sampling when ``module`` is None, else by batched speculative sampling with the module's chained
    drafts, each rollout with its own sampling stream — then their rewards from ``reward_fn`` in one call.
    ``questions`` / ``answers``: each prompt's question text and known answer (None: none). ``first_prompt``: the
    index of ``prompts[0]`` among the step's prompts (a process's share starts there), which picks each rollout's
    sampling stream. ``drafting``: under ``cfg.adaptive``, the state that decides when a batch drafts, carried on
    from earlier steps (None: a fresh one for these rollouts)."""
    model.eval()
    device = model.get_output_embeddings().weight.device
    started = time.perf_counter()
    stats = SpeculativeStats()
    if module is not None:
        draft_dtype = getattr(torch, cfg.draft_dtype)
        draft_base, draft_module = draft_parts(model, module.eval(), draft_dtype)
        drafting = drafting if drafting is not None else rollout_drafting(cfg)  # one state for every batch
    prompt_ids = [ids[0].tolist() for ids in prompts for _ in range(cfg.group_size)]
    generators = [rollout_generator(cfg.seed, step, first_prompt * cfg.group_size + i, device)
                  for i in range(len(prompt_ids))]
    size = cfg.rollout_batch_size or len(prompt_ids)
    completions, counts = [], []
    batch_started = started  # the first batch carries the phase's set-up (the draft copies)
    for start in range(0, len(prompt_ids), size):
        rows = slice(start, start + size)
        if module is None:
            tokens = sample_plainly(model, prompt_ids[rows], cfg.max_new_tokens, eos_token_ids, cfg.temperature,
                                    generators[start])
            rows_stats = [SpeculativeStats(forwards=len(t), generated_tokens=len(t)) for t in tokens]
        else:
            tokens, rows_stats = sample_speculatively(model, draft_base, draft_module, prompt_ids[rows],
                                                      cfg.max_new_tokens, eos_token_ids, cfg.temperature,
                                                      cfg.draft_temperature, generators[rows], drafting,
                                                      cfg.dynamic_tree)
        # the tokens are lists: the batch's device work is done when the clock is read
        counts.append(RolloutCounts(time.perf_counter() - batch_started, sum(map(len, tokens)),
                                    *_batch_counters(rows_stats), rows=len(tokens)))
        for row in rows_stats:
            stats.accepted_lengths += row.accepted_lengths
            stats.drafted_tokens += row.drafted_tokens
            stats.accepted_drafts += row.accepted_drafts
            stats.forwards += row.forwards
        completions += tokens
        for _ in tokens:
            if on_rollout is not None:
                on_rollout()
        batch_started = time.perf_counter()
    scoring = time.perf_counter()
    responses = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in completions]
    cut = [cut_by_length(tokens, eos_token_ids, cfg.max_new_tokens) for tokens in completions]
    rewards = rollout_rewards(reward_fn, questions, answers, responses, cfg.group_size, cut)
    return Rollouts(prompt_ids, completions, rewards, scoring - started, stats, time.perf_counter() - scoring, counts)


def _batch_counters(rows: Sequence[SpeculativeStats]) -> tuple[int, int, int, int, int]:
    """The cycles, cycle tokens, drafted and accepted drafts and forwards of a batch's rows, summed
    (:class:`RolloutCounts`)."""
    return (sum(len(s.accepted_lengths) for s in rows), sum(sum(s.accepted_lengths) for s in rows),
            sum(s.drafted_tokens for s in rows), sum(s.accepted_drafts for s in rows), sum(s.forwards for s in rows))


def rollout_batch(rollouts: Rollouts, pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Prompt + completion of every rollout, right-padded: ``input_ids``, ``attention_mask`` and ``response_mask``
    (the completion tokens), each (B, T) on ``device``."""
    batch = right_pad([(p + c, [0] * len(p) + [1] * len(c)) for p, c in
                       zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)], pad_token_id)
    return {key: value.to(device) for key, value in batch.items()}


def predicts_completion(response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T): the positions whose next token is a completion token."""
    return torch.nn.functional.pad(response_mask[:, 1:], (0, 1))


def first_completion_position(response_mask: torch.Tensor) -> int:
    """The first position of the batch that predicts a completion token (the shortest prompt's last one): the
    logits before it are never read."""
    prompt_lengths = (response_mask.cumsum(dim=1) == 0).sum(dim=1)  # (B,): leading non-completion tokens
    return max(0, int(prompt_lengths.min()) - 1)


def completion_logps(model, batch: dict[str, torch.Tensor], temperature: float, final_hidden: bool = False):
    """One forward over the batch with logits for the completion positions only (``logits_to_keep``): at 8B with a
    128k vocabulary the prompts' logits would be most of the activation memory. Returns the output, the token
    log-probs (B, T), the first position whose logits it holds, and with ``final_hidden`` the final hidden states
    (B, T, H) the MTP module reads (else None) — the last layer's alone
    (:func:`models.engine.speculative.last_hidden_forward`: ``output_hidden_states`` would keep every layer's)."""
    input_ids = batch["input_ids"]
    first = first_completion_position(batch["response_mask"])
    inputs = {"input_ids": input_ids, "attention_mask": batch["attention_mask"],
              "logits_to_keep": input_ids.shape[1] - first}
    out, hidden = last_hidden_forward(model, **inputs) if final_hidden else (model(**inputs), None)
    return out, token_logps(out.logits, input_ids, temperature, first), first, hidden


@dataclass(frozen=True)
class BatchTotals:
    """Counts over a step's whole batch — every process's share — that the losses divide by, so the processes'
    losses are shares that sum to the loss of the global batch."""

    completion_tokens: torch.Tensor  # scalar: the GRPO token mean's denominator
    depth_targets: list[torch.Tensor]  # per depth of the module: its valid targets (the CE's denominators)
    samples: int  # rollouts (the advantage-aware KL's sample mean)


def batch_totals(batch: dict[str, torch.Tensor], num_depths: int, accelerator: Accelerator) -> BatchTotals:
    """:class:`BatchTotals` of this process's ``batch`` summed over every process."""
    response_mask = batch["response_mask"]
    local = torch.stack([predicts_completion(response_mask).sum(), torch.tensor(len(response_mask)).to(response_mask),
                         *[depth_targets(response_mask, response_mask, k)[1].sum()
                           for k in range(1, num_depths + 1)]])
    total = accelerator.reduce(local, "sum")
    return BatchTotals(total[0].clamp(min=1), list(total[2:]), int(total[1]))


@contextlib.contextmanager
def frozen(model: torch.nn.Module):
    """The model's parameters take no gradient inside the block (their flags are restored after)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def mtp_rl_step_loss(model, base, module, batch: dict[str, torch.Tensor], advantages: torch.Tensor,
                     old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None, var: Variant, cfg: MTPRLTraining,
                     weights: Sequence[float], backward: Callable[[torch.Tensor], None],
                     totals: BatchTotals | None = None) -> tuple[torch.Tensor, dict]:
    """Build (and back-propagate, through ``backward``) one update's loss; returns this pass's token log-probs
    (detached: π_old of later passes) and the step's numbers. ``model``: the policy's model as accelerate
    prepared it (what the forward runs through); ``base``: the plain model, whose embedding, norm and head the
    module shares; ``module``: the MTP module as prepared (None for variants that do not train it); ``batch``:
    :func:`rollout_batch`. ``old_logps`` None: this pass's own log-probs, detached (the first pass).
    ``totals``: the global batch's counts when ``batch`` is one process's share (the loss and its numbers are
    then that share); default: this batch's own."""
    input_ids, response_mask = batch["input_ids"], batch["response_mask"]  # (B, T); response: completion tokens
    out, logps, first, hidden = completion_logps(model, batch, cfg.temperature, final_hidden=var.trains_module)
    old = logps.detach() if old_logps is None else old_logps
    advantages = advantages.to(input_ids.device)
    loss, stats = grpo_loss(logps, old, advantages, predicts_completion(response_mask), cfg.epsilon_low,
                            cfg.epsilon_high, ref_logps, cfg.kl_beta, totals.completion_tokens if totals else None)
    if not var.trains_module:
        backward(loss)
        return logps.detach(), stats
    main_logits = out.logits
    if not var.backprop_into_policy:  # the RL loss alone reaches the policy; L_Adv only the module
        backward(loss)
        hidden, main_logits = hidden.detach(), main_logits.detach()
    with contextlib.nullcontext() if var.backprop_into_policy else frozen(base):
        states = module(base, input_ids, hidden)
        ce, ce_per_depth = mtp_cross_entropy(base, states, input_ids, response_mask, weights,
                                             totals.depth_targets if totals else None)
        mtp_loss = var.ce_weight * ce
        kl_per_depth = [float("nan")] * len(states)
        if var.kl:
            target = main_logits if var.kl_moves_policy else main_logits.detach()
            kl, kl_per_depth = advantage_aware_kl(base, states, target, response_mask, advantage_mask(advantages),
                                                  weights, first, totals.samples if totals else None)
            mtp_loss = mtp_loss + kl
    backward(loss + mtp_loss if var.backprop_into_policy else mtp_loss)
    stats |= {"mtp_loss": mtp_loss.item(), **{f"mtp_ce_{k}": v for k, v in enumerate(ce_per_depth, start=1)},
              **{f"mtp_kl_{k}": v for k, v in enumerate(kl_per_depth, start=1)}}
    return logps.detach(), stats


@torch.no_grad()
def reference_logps(reference, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """The reference policy's token log-probs of the rollouts (for the k3 KL): ``reference`` is the LoRA policy,
    run with its adapters off, or a frozen copy of the starting policy."""
    with adapters_disabled(reference):
        return completion_logps(reference, batch, temperature)[1]


def process_share(prompts_per_step: int, accelerator: Accelerator) -> slice:
    """This process's equal share of a step's prompts (each process rolls out its own)."""
    processes = accelerator.num_processes
    if prompts_per_step % processes:
        raise ValueError(f"mtp_rl.prompts_per_step ({prompts_per_step}) must be a multiple of the number of "
                         f"processes ({processes}): each process rolls out an equal share of a step's prompts")
    share = prompts_per_step // processes
    return slice(accelerator.process_index * share, (accelerator.process_index + 1) * share)


def step_record(step: int, rollouts: Rollouts, advantages: torch.Tensor, group_size: int,
                stats: dict[str, float], drafts: bool, update_seconds: float, accelerator: Accelerator) -> dict:
    """The step's numbers over every process: rollout counts summed, the rollout and scoring phases' wall times
    the slowest process's, the loss terms (each process's share) summed. ``reward``: the mean reward;
    ``nonzero_advantage_share``: the share of groups whose rewards differ (the others give no gradient);
    ``tokens_per_forward``: rollout tokens per policy forward of a row (1 for plain sampling). ``rollouts``: every
    rollout batch's :class:`RolloutCounts`, the processes' in process order (so in prompt order)."""
    from accelerate.utils import gather_object

    counters = rollouts.stats
    flat = zero_std_groups(rollouts.rewards, group_size)  # (N,)
    local = torch.tensor([rollouts.rewards.sum().item(), len(rollouts.rewards),
                          sum(len(c) for c in rollouts.completion_ids), advantage_mask(advantages).sum().item(),
                          len(flat), int((~flat).sum()), counters.forwards,
                          len(counters.accepted_lengths), sum(counters.accepted_lengths), counters.drafted_tokens,
                          counters.accepted_drafts, *stats.values()], dtype=torch.float64, device=accelerator.device)
    (reward, count, tokens, positive, groups, mixed, forwards, cycles, cycle_tokens, drafted, accepted, *terms) = \
        accelerator.reduce(local, "sum").tolist()
    seconds, reward_seconds = accelerator.gather(torch.tensor([[rollouts.seconds, rollouts.reward_seconds]],
                                                              device=accelerator.device)).max(dim=0).values.tolist()
    nan = float("nan")
    return {"step": step, "rollout_seconds": seconds, "reward_seconds": reward_seconds,
            "update_seconds": update_seconds, "rollout_tokens": int(tokens), "rollout_tokens_per_s": tokens / seconds,
            "reward": reward / count, "positive_advantage_share": positive / count,
            "nonzero_advantage_share": mixed / groups, "tokens_per_forward": tokens / forwards,
            "cycles": int(cycles) if drafts else int(tokens),
            "tau": (cycle_tokens / cycles if cycles else nan) if drafts else 1.0,
            "acceptance_rate": (accepted / drafted if drafted else nan) if drafts else 0.0,
            **dict(zip(stats, terms, strict=True)),
            "rollouts": gather_object([asdict(c) for c in rollouts.counts])}


def train_variant(policy: Policy, module: MTPModule | None, var: Variant, prompts: Sequence[torch.Tensor],
                  questions: Sequence[str], answers: Sequence[str | None], reward_fn: RewardFunction,
                  cfg: MTPRLTraining, weights: Sequence[float], eos_token_ids: set[int],
                  accelerator: Accelerator | None = None, on_step: Callable[[int, dict], None] | None = None,
                  on_rollout: Callable[[], None] | None = None,
                  on_trained: Callable[[torch.nn.Module], None] | None = None) -> list[dict]:
    """``cfg.steps`` RL steps of one variant on ``prompts`` (``cfg.prompts_per_step`` per step, in order; each
    process rolls out its share and scores it with ``reward_fn``). ``questions`` / ``answers``: each prompt's
    question text and known answer (None: none), what ``reward_fn`` reads. ``weights``: λ_1 … λ_K of the
    module's CE and KL. The policy (and the module, when the variant trains it) are updated in place, back in
    their own dtypes at the end (with ``lora_rank`` > 0 the adapters are merged into the policy). ``on_trained``
    gets the trained policy (its LoRA wrapper) before the merge. Returns one dict per step, over every process."""
    from accelerate import Accelerator

    if not len(prompts) == len(questions) == len(answers):
        raise ValueError(f"{len(prompts)} prompts, {len(questions)} questions and {len(answers)} answers: give one "
                         "question and one answer (None: unknown) per prompt")
    needed = cfg.steps * cfg.prompts_per_step
    if len(prompts) < needed:
        raise ValueError(f"{cfg.steps} steps × {cfg.prompts_per_step} prompts need {needed} training prompts, "
                         f"got {len(prompts)}")
    if var.drafts and module is None:
        raise ValueError(f"variant {var.name!r} drafts with the MTP module: pass one")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    share = process_share(cfg.prompts_per_step, accelerator)
    with memory_saving(policy.model, cfg.lora_rank, cfg.gradient_checkpointing) as trained:
        history = _train(trained, policy.tokenizer, module, var, prompts, questions, answers, reward_fn, cfg, weights,
                         eos_token_ids, accelerator, share, on_step, on_rollout)
        if on_trained is not None:
            on_trained(trained)
    policy.model = merged(trained).requires_grad_(False).eval()
    if module is not None:
        module.requires_grad_(False).eval()
    return history


def _train(trained, tokenizer, module: MTPModule | None, var: Variant, prompts: Sequence[torch.Tensor],
           questions: Sequence[str], answers: Sequence[str | None], reward_fn: RewardFunction, cfg: MTPRLTraining,
           weights: Sequence[float], eos_token_ids: set[int], accelerator: Accelerator, share: slice,
           on_step: Callable[[int, dict], None] | None, on_rollout: Callable[[], None] | None) -> list[dict]:
    """:func:`train_variant`'s loop on the model to train (the policy, or its LoRA wrapper)."""
    from accelerate.utils import set_seed

    set_seed(cfg.seed)
    if not is_lora(trained):  # LoRA trains its adapters only (PEFT froze the rest)
        trained.requires_grad_(True)
    # The KL's reference: the LoRA policy with its adapters off, or (full fine-tuning) a frozen starting copy
    reference = (copy.deepcopy(trained).requires_grad_(False).eval() if cfg.kl_beta > 0 and not is_lora(trained)
                 else trained)
    half = half_dtype(trained)
    policy_params = [p for p in trained.parameters() if p.requires_grad]
    module_params = list(module.requires_grad_(True).parameters()) if var.trains_module else []
    if module is not None and not var.trains_module:
        module.requires_grad_(False)
    num_depths = module.config.num_depths if var.trains_module else 0

    def backward(loss: torch.Tensor) -> None:
        # DDP averages the processes' gradients, and each process's loss is its share of the global batch's loss
        accelerator.backward(loss * accelerator.num_processes)

    history = []
    with float32_master_weights(policy_params + module_params) as masters:
        groups = [{"params": policy_params, "lr": cfg.learning_rate}]
        groups += [{"params": module_params, "lr": cfg.mtp_learning_rate}] if module_params else []
        optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.0)
        # every trained model is prepared: under DDP its gradients are all-reduced (the module reads the plain
        # policy's shared embedding and head; their gradients reach the policy's own DDP reducer)
        model, *prepared, optimizer = accelerator.prepare(trained, *([module] if module_params else []), optimizer)
        trained_module = prepared[0] if prepared else None
        device = accelerator.device
        # when to draft is learned once per variant: a step's rollouts start from what the last step's measured
        drafting = rollout_drafting(cfg) if var.drafts else None
        for step in range(cfg.steps):
            this_step = slice(step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step)
            step_prompts, step_questions, step_answers = (items[this_step][share]
                                                          for items in (prompts, questions, answers))
            with masters.in_own_dtypes():  # sampled in the policy's dtype, as an inference engine would
                rollouts = collect_rollouts(trained, tokenizer, module if var.drafts else None, step_prompts,
                                            step_questions, step_answers, reward_fn, cfg, step, eos_token_ids,
                                            share.start, on_rollout, drafting)
            advantages = group_advantages(rollouts.rewards, cfg.group_size, cfg.advantage_epsilon)
            batch = rollout_batch(rollouts, padding_id(tokenizer), device)
            totals = batch_totals(batch, num_depths, accelerator)
            # micro-batches of the update: every loss is normalised by the step's global counts (``totals``), so
            # their gradients add up to the whole batch's, as the processes' shares do
            size = cfg.update_batch_size or len(advantages)
            parts = [slice(start, start + size) for start in range(0, len(advantages), size)]
            micro = [{key: value[part] for key, value in batch.items()} for part in parts]
            ref_logps = ([reference_logps(reference, rows, cfg.temperature) for rows in micro] if cfg.kl_beta > 0
                         else [None] * len(parts))
            update_started = time.perf_counter()
            model.train()
            old_logps = [None] * len(parts)  # π_old: the log-probs of the first pass, before any update of this step
            for _ in range(cfg.iterations):
                stats = {}
                for i, (part, rows) in enumerate(zip(parts, micro, strict=True)):
                    with step_precision(accelerator, half):
                        logps, part_stats = mtp_rl_step_loss(model, trained, trained_module, rows, advantages[part],
                                                             old_logps[i], ref_logps[i], var, cfg, weights, backward,
                                                             totals)
                    old_logps[i] = logps if old_logps[i] is None else old_logps[i]
                    stats = {key: stats.get(key, 0.0) + value for key, value in part_stats.items()}
                optimizer.step()
                optimizer.zero_grad()
            model.eval()
            record = step_record(step + 1, rollouts, advantages, cfg.group_size, stats, var.drafts,
                                 time.perf_counter() - update_started, accelerator)
            history.append(record)
            if on_step is not None:
                on_step(step + 1, record)
            if accelerator.is_main_process:  # live curves: the step's numbers (every process holds the same record)
                log_step({key: value for key, value in record.items() if isinstance(value, (int, float))}, step + 1)
    return history
