"""GRPO with MTP-drafted rollouts and the advantage-aware MTP loss (MTP-RL §3.2, eq. 2–5, docs/mtp.md),
and the paper's baselines (§2.2, Table 1) in one harness.

One RL step (of :func:`train_variant`): sample G rollouts per prompt at temperature T — by plain sampling (vanilla
GRPO) or speculatively with K chained MTP drafts and speculative sampling, which leaves the rollouts'
distribution exactly the policy's — reward each with the verifiable arithmetic check, normalise advantages
within each group, then one update:

    L_main = L_GRPO + L_Adv          L_MTP = L_Adv          L_Adv = w·KL(π_main ‖ π_MTP) + β·CE     (eq. 4, 5)

with w = 1[A ≥ 0] per sample (eq. 2). One backward of L_GRPO + L_Adv reaches both: the policy through the
GRPO term, through the KL's π_main and through the hidden states and shared embedding / head the module
reads; the module through L_Adv. The baselines change one thing each (:class:`Variant`): no drafts
(``vanilla``), a module that never trains (``frozen_mtp``), CE alone (``ce_only``), or L_Adv cut off from
the policy (``no_backprop``: the module reads detached states and the policy's parameters are frozen while
its loss is built).

Why a compact trainer rather than TRL's ``GRPOTrainer``: MTP-RL needs (a) rollouts from our own batch-1
speculative sampler, timed per step, with per-rollout acceptance counters, and (b) a second model (the MTP
module) trained in the same backward from the policy's hidden states. TRL's trainer owns generation and the
loss; bending both would take more code than the ~100 lines of GRPO here, whose pieces
(:mod:`models.mtp.grpo`) are tested on hand-worked numbers against TRL's definitions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from models.common.sequences import padding_id, right_pad
from models.engine.policy import Policy
from models.engine.speculative import SpeculativeStats
from models.labeling.labelers import is_correct
from models.mtp.config import MTPRLTraining, VariantName
from models.mtp.grpo import group_advantages, grpo_loss, token_logps
from models.mtp.module import (
    MTPModule,
    advantage_aware_kl,
    advantage_mask,
    draft_parts,
    mtp_cross_entropy,
    mtp_generate,
)


@dataclass(frozen=True)
class Variant:
    """What one RL run does with the MTP module."""

    name: VariantName
    drafts: bool  # rollouts drafted by the module (else plain sampling)
    trains_module: bool  # the module gets an optimizer and L_Adv
    kl: bool  # L_Adv includes the advantage-aware KL
    ce_weight: float  # weight of the module's CE in L_Adv
    backprop_into_policy: bool  # L_Adv's gradient reaches the policy


def variant(name: VariantName, cfg: MTPRLTraining) -> Variant:
    """The named variant with its loss weights from ``cfg`` (what each changes: the module docstring)."""
    variants = {
        "vanilla": Variant("vanilla", drafts=False, trains_module=False, kl=False, ce_weight=0.0,
                           backprop_into_policy=False),
        "mtp_rl": Variant("mtp_rl", drafts=True, trains_module=True, kl=True, ce_weight=cfg.beta,
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


@dataclass
class Rollouts:
    """One step's completions, group by group (G consecutive rows per prompt)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: torch.Tensor  # (N·G,)
    seconds: float  # wall time of the rollout phase
    stats: SpeculativeStats  # draft counters (empty for plain sampling)


def rollout_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The sampling stream of rollout ``index`` of ``step``: the same for every variant."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + index)


@torch.no_grad()
def sample_plainly(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: set[int], temperature: float,
                   generator: torch.Generator) -> list[int]:
    """Vanilla rollout: HF ``generate`` at batch 1, pure temperature sampling, seeded from ``generator``."""
    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                         eos_token_id=sorted(eos_token_ids), pad_token_id=sorted(eos_token_ids)[0])
    new = out[0, input_ids.shape[1]:].tolist()
    ended = next((i for i, t in enumerate(new) if t in eos_token_ids), None)
    return new if ended is None else new[: ended + 1]


def collect_rollouts(policy: Policy, module: MTPModule | None, prompts: Sequence[torch.Tensor],
                     answers: Sequence[str], cfg: MTPRLTraining, step: int, eos_token_ids: set[int],
                     on_rollout: Callable[[], None] | None = None) -> Rollouts:
    """G rollouts per prompt at batch 1 (plain sampling when ``module`` is None) and their 0/1 rewards."""
    model = policy.model.eval()
    started = time.perf_counter()
    stats = SpeculativeStats()
    if module is not None:
        draft_dtype = getattr(torch, cfg.draft_dtype)
        draft_base, draft_module = draft_parts(model, module.eval(), draft_dtype)
    prompt_ids, completions, rewards = [], [], []
    for p, (ids, answer) in enumerate(zip(prompts, answers, strict=True)):
        for g in range(cfg.group_size):
            generator = rollout_generator(cfg.seed, step, p * cfg.group_size + g)
            if module is None:
                tokens = sample_plainly(model, ids, cfg.max_new_tokens, eos_token_ids, cfg.temperature, generator)
            else:
                tokens = mtp_generate(model, draft_base, draft_module, ids, cfg.max_new_tokens, eos_token_ids,
                                      cfg.temperature, generator, stats, cfg.draft_temperature)
            prompt_ids.append(ids[0].tolist())
            completions.append(tokens)
            response = policy.tokenizer.decode(tokens, skip_special_tokens=True)
            rewards.append(1.0 if is_correct(response, answer) else 0.0)
            if on_rollout is not None:
                on_rollout()
    return Rollouts(prompt_ids, completions, torch.tensor(rewards), time.perf_counter() - started, stats)


def rollout_batch(rollouts: Rollouts, pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Prompt + completion of every rollout, right-padded: ``input_ids``, ``attention_mask`` and ``response_mask``
    (the completion tokens), each (B, T) on ``device``."""
    batch = right_pad([(p + c, [0] * len(p) + [1] * len(c)) for p, c in
                       zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)], pad_token_id)
    return {key: value.to(device) for key, value in batch.items()}


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


def mtp_rl_step_loss(model, policy: Policy, module: MTPModule | None, rollouts: Rollouts, advantages: torch.Tensor,
                     old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None, var: Variant, cfg: MTPRLTraining,
                     weights: Sequence[float], backward: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, dict]:
    """Build (and back-propagate, through ``backward``) one update's loss; returns this pass's token log-probs
    (detached: π_old of later passes) and the step's numbers. ``model``: the policy's model as accelerate
    prepared it (what the forward runs through); ``policy.model``: the plain model, whose embedding, norm and
    head the module shares. ``old_logps`` None: this pass's own log-probs, detached (the first pass)."""
    base = policy.model
    device = policy.device
    batch = rollout_batch(rollouts, padding_id(policy.tokenizer), device)
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    response_mask = batch["response_mask"]  # (B, T): completion tokens
    # (B, T): position i predicts a completion token
    completion_mask = torch.nn.functional.pad(response_mask[:, 1:], (0, 1))
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=var.trains_module)
    logps = token_logps(out.logits, input_ids, cfg.temperature)  # (B, T)
    old = logps.detach() if old_logps is None else old_logps
    advantages = advantages.to(device)
    loss, stats = grpo_loss(logps, old, advantages, completion_mask, cfg.epsilon_low, cfg.epsilon_high, ref_logps,
                            cfg.kl_beta)
    if not var.trains_module:
        backward(loss)
        return logps.detach(), stats
    hidden, main_logits = out.hidden_states[-1], out.logits
    if not var.backprop_into_policy:  # the RL loss alone reaches the policy; L_Adv only the module
        backward(loss)
        hidden, main_logits = hidden.detach(), main_logits.detach()
    with contextlib.nullcontext() if var.backprop_into_policy else frozen(base):
        states = module(base, input_ids, hidden)
        ce, ce_per_depth = mtp_cross_entropy(base, states, input_ids, response_mask, weights)
        mtp_loss = var.ce_weight * ce
        kl_per_depth = [float("nan")] * len(states)
        if var.kl:
            kl, kl_per_depth = advantage_aware_kl(base, states, main_logits, response_mask,
                                                  advantage_mask(advantages), weights)
            mtp_loss = mtp_loss + kl
    backward(loss + mtp_loss if var.backprop_into_policy else mtp_loss)
    stats |= {"mtp_loss": mtp_loss.item(), **{f"mtp_ce_{k}": v for k, v in enumerate(ce_per_depth, start=1)},
              **{f"mtp_kl_{k}": v for k, v in enumerate(kl_per_depth, start=1)}}
    return logps.detach(), stats


@torch.no_grad()
def reference_logps(reference, rollouts: Rollouts, policy: Policy, temperature: float) -> torch.Tensor:
    """The reference policy's token log-probs of the rollouts (for the k3 KL)."""
    batch = rollout_batch(rollouts, padding_id(policy.tokenizer), policy.device)
    out = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return token_logps(out.logits, batch["input_ids"], temperature)


def train_variant(policy: Policy, module: MTPModule | None, var: Variant, prompts: Sequence[torch.Tensor],
                  answers: Sequence[str], cfg: MTPRLTraining, weights: Sequence[float], eos_token_ids: set[int],
                  accelerator=None,
                  reference=None, on_step: Callable[[int, dict], None] | None = None,
                  on_rollout: Callable[[], None] | None = None) -> list[dict]:
    """``cfg.steps`` RL steps of one variant on ``prompts`` (``cfg.prompts_per_step`` per step, in order).
    ``weights``: λ_1 … λ_K of the module's CE and KL. The policy (and the module, when the variant trains it) are
    updated in place. Returns one dict per step."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    needed = cfg.steps * cfg.prompts_per_step
    if len(prompts) < needed:
        raise ValueError(f"{cfg.steps} steps × {cfg.prompts_per_step} prompts need {needed} training prompts, "
                         f"got {len(prompts)}")
    if var.drafts and module is None:
        raise ValueError(f"variant {var.name!r} drafts with the MTP module: pass one")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)
    model = policy.model.requires_grad_(True)
    groups = [{"params": list(model.parameters()), "lr": cfg.learning_rate}]
    if var.trains_module:
        module.requires_grad_(True)
        groups.append({"params": list(module.parameters()), "lr": cfg.mtp_learning_rate})
    elif module is not None:
        module.requires_grad_(False)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.0)
    # the module is not prepared: it is called with the policy as an argument, and prepare would wrap it for DDP
    model, optimizer = accelerator.prepare(model, optimizer)
    policy.model = accelerator.unwrap_model(model)  # rollouts and the module use the plain model
    history = []
    for step in range(cfg.steps):
        step_prompts = prompts[step * cfg.prompts_per_step : (step + 1) * cfg.prompts_per_step]
        step_answers = answers[step * cfg.prompts_per_step : (step + 1) * cfg.prompts_per_step]
        rollouts = collect_rollouts(policy, module if var.drafts else None, step_prompts, step_answers, cfg, step,
                                    eos_token_ids, on_rollout)
        advantages = group_advantages(rollouts.rewards, cfg.group_size, cfg.advantage_epsilon)
        ref_logps = reference_logps(reference, rollouts, policy, cfg.temperature) if cfg.kl_beta > 0 else None
        update_started = time.perf_counter()
        model.train()
        old_logps = None  # π_old: the log-probs of the first pass, before any update of this step
        for _ in range(cfg.iterations):
            with accelerator.autocast():
                logps, stats = mtp_rl_step_loss(model, policy, module, rollouts, advantages, old_logps, ref_logps,
                                                var, cfg, weights, accelerator.backward)
            old_logps = logps if old_logps is None else old_logps
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        completion_tokens = sum(len(c) for c in rollouts.completion_ids)
        record = {"step": step + 1, "rollout_seconds": rollouts.seconds,
                  "update_seconds": time.perf_counter() - update_started,
                  "rollout_tokens": completion_tokens, "rollout_tokens_per_s": completion_tokens / rollouts.seconds,
                  "reward": rollouts.rewards.mean().item(), "accuracy": rollouts.rewards.mean().item(),
                  "positive_advantage_share": advantage_mask(advantages).mean().item(),
                  "cycles": len(rollouts.stats.accepted_lengths) if var.drafts else completion_tokens,
                  "tau": rollouts.stats.tokens_per_cycle if var.drafts else 1.0,
                  "acceptance_rate": rollouts.stats.acceptance_rate if var.drafts else 0.0, **stats}
        history.append(record)
        if on_step is not None:
            on_step(step + 1, record)
    policy.model = accelerator.unwrap_model(model).requires_grad_(False).eval()
    if module is not None:
        module.requires_grad_(False).eval()
    return history
