"""RLMedusa done right: a learned token reward r(e, h) and a policy-gradient-trained t + 2 head (docs/medusa.md).

"RLMedusa: Reinforcement Learning for Multiple Decoding Heads to Accelerate LLM Inference" (ICLR 2025 Workshop
on Sparsity in LLMs; "Methodology", and the authors' blog post). RLMedusa's p₂ — "the second decoding head",
which predicts x_{t+2} from the state after x_{≤t} — is Medusa head k = 1 here (the backbone's LM head is p₁).

1. **Reward model** ("Training methodology and data collection"): r(e, h) ∈ (0, 1), a nonlinear
   feed-forward network over the context's final hidden state h_t and a candidate token's embedding e,
   fitted by MSE to p₁(x_{t+2} = e | x_{≤t+1}) on 9 candidates per step (top-1, 3 of the top-50,
   5 random; :func:`sample_candidates`) along 20-token trajectories of the policy's own responses
   (:func:`trajectory_candidates`, over the states of :func:`models.medusa.training.self_distill`'s frozen pass).
2. **Policy gradient** ("Overview of reinforcement learning approach", eq. 1: R = r − β·KL, with p₂
   initialised to p₁): head 1 is the policy over the vocabulary in state h_t. It *samples* G tokens per
   state; each is rewarded r(e_a, h_t) − β·(log p₂(a) − log p_ref(a)) (the usual per-sample KL estimate
   against the head at its start, which keeps it near where it began); REINFORCE with the group-mean
   baseline pushes up the log-probability of above-average tokens.

What the published code gets wrong and this module does not (docs/medusa.md): its "action" is an argmax under
``no_grad`` (zero policy gradient: only the KL term trained), its reward model is linear in [e; h] (the
same best token for every context), and its reward and policy read contexts one token apart. Decoding
with the trained head goes through greedy verification (:mod:`models.engine.speculative`), so output stays
exactly greedy — no "The The symptoms symptoms".
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from models.common.config import MixedPrecision
from models.common.training import GeneratorState, train
from models.medusa.config import RLMedusaCandidates, RLMedusaTraining
from models.medusa.heads import MedusaHeads
from models.medusa.training import DistilledStates, HiddenStates, StateDataset, pass_autocast

if TYPE_CHECKING:
    from accelerate import Accelerator


def _candidate_draws(generator: torch.Generator, rows: int, vocab: int, top_pool: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers :func:`sample_candidates` draws for ``rows`` rows over ``vocab`` tokens, in its order:
    (rows, top_pool − 1) to pick among ranks 2..top_pool, then (rows, vocab) to pick the random tokens."""
    draw = partial(torch.rand, generator=generator, device=generator.device)
    return draw(rows, top_pool - 1), draw(rows, vocab)


def sample_candidates(probs: torch.Tensor, generator: torch.Generator, num_top: int = 3, top_pool: int = 50,
                      num_random: int = 5) -> torch.Tensor:
    """RLMedusa's candidate mix per row of ``probs`` (R, V): the top-1 token, ``num_top`` distinct tokens
    drawn from ranks 2..``top_pool``, and ``num_random`` distinct tokens drawn uniformly from the rest of
    the vocabulary. Returns (R, 1 + num_top + num_random) token ids on ``probs``' device, all distinct
    within a row. The random numbers come from ``generator`` on its own device (a CPU generator gives the
    same candidates whichever device ``probs`` lives on)."""
    rows, vocab = probs.shape
    picks, scores = _candidate_draws(generator, rows, vocab, top_pool)
    ranked = probs.topk(top_pool, dim=-1).indices  # (R, top_pool)
    pick = picks.argsort(dim=-1)[:, :num_top].to(probs.device) + 1  # (R, num_top)
    chosen = torch.cat([ranked[:, :1], ranked.gather(1, pick)], dim=1)  # (R, 1 + num_top)
    scores = scores.to(probs.device)  # (R, V)
    scores.scatter_(1, chosen, -1.0)  # never re-draw a chosen token
    return torch.cat([chosen, scores.topk(num_random, dim=-1).indices], dim=1)


@dataclass
class TrajectoryStates:
    """RLMedusa's data ("Training methodology and data collection"): the trajectory states among the frozen
    pass's positions, and per state the candidate tokens for position t + 2 with the base model's probability of
    each there."""

    rows: torch.Tensor  # (R,) rows of the pass's hidden states (the whole cache's) that are trajectory states
    sample: torch.Tensor  # (R,) row of the responses table each state comes from
    candidates: torch.Tensor  # (R, C) candidate tokens for position t + 2
    probs: torch.Tensor  # (R, C) p₁(candidate = x_{t+2} | x_{≤t+1})

    def subset(self, samples: torch.Tensor) -> TrajectoryStates:
        """The trajectory states of the given sample rows, in their order."""
        keep = torch.isin(self.sample, samples)
        return TrajectoryStates(self.rows[keep], self.sample[keep], self.candidates[keep], self.probs[keep])

    def states(self, data: DistilledStates) -> HiddenStates:
        """The states (R, H) among ``data``'s (the whole cache, as :func:`trajectory_candidates` read it), as a
        view."""
        return data.hidden.subset(self.rows)


@torch.no_grad()
def trajectory_candidates(data: DistilledStates, lm_head: nn.Module, cfg: RLMedusaCandidates, seed: int,
                          mixed_precision: MixedPrecision, samples: torch.Tensor | None = None) -> TrajectoryStates:
    """Along each response's first ``trajectory_tokens`` positions of the frozen pass's cache ``data`` (the whole
    cache, as :func:`models.medusa.training.load_distilled` reads it): the candidates of :func:`sample_candidates`
    and their probabilities as the token two steps ahead. t + 2 must still be a response token, so a response of n
    positions has min(trajectory_tokens, n − 1) states, and p(x_{t+2} | x_{≤t+1}) is the logits of position t + 1.

    The logits are the pass's own, bit for bit: the LM head (in the cache's dtype, the policy's in the pass;
    ``mixed_precision`` as the pass ran it: ``medusa.mixed_precision``) over each response's positions, all of
    them at once as the pass computed them. The random numbers come from a CPU generator seeded with ``seed``,
    response after response in the cache's order (the same candidates on any device); the responses outside
    ``samples`` (rows of the responses table; None: all) take their draws without their logits being computed,
    so every other response's candidates stay what they are when all are drawn."""
    generator = torch.Generator().manual_seed(seed)
    device, dtype = lm_head.weight.device, data.hidden.dtype
    weight = lm_head.weight.to(dtype)  # a training stage's float32 copy of a bf16 pass's head: cast back, exactly
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.to(dtype)
    parts: dict[str, list[torch.Tensor]] = {"rows": [], "sample": [], "candidates": [], "probs": []}
    responses, counts = torch.unique_consecutive(data.sample, return_counts=True)
    wanted = None if samples is None else set(samples.tolist())
    start = 0
    for sample_row, n in zip(responses.tolist(), counts.tolist(), strict=True):
        steps = min(cfg.trajectory_tokens, n - 1)
        if steps > 0 and wanted is not None and sample_row not in wanted:
            _candidate_draws(generator, steps, weight.shape[0], cfg.top_pool)
        elif steps > 0:
            states = data.hidden[start : start + n].to(device)  # (n, H)
            with pass_autocast(device, mixed_precision):
                logits = F.linear(states, weight, bias)  # (n, V)
            probs = torch.softmax(logits[1 : steps + 1].float(), dim=-1)  # (steps, V)
            candidates = sample_candidates(probs, generator, cfg.top_candidates, cfg.top_pool, cfg.random_candidates)
            parts["rows"].append(start + torch.arange(steps))
            parts["sample"].append(torch.full((steps,), sample_row))
            parts["candidates"].append(candidates.cpu())
            parts["probs"].append(probs.gather(1, candidates).cpu())
        start += n
    if not parts["rows"]:
        width = 1 + cfg.top_candidates + cfg.random_candidates
        return TrajectoryStates(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                torch.zeros(0, width, dtype=torch.long), torch.zeros(0, width))
    return TrajectoryStates(*(torch.cat(parts[name]) for name in ("rows", "sample", "candidates", "probs")))



class TokenRewardModel(nn.Module):
    """r(e, h) = σ(MLP([LayerNorm(h) ; LayerNorm(e)])): how likely token e is two steps after state h.

    Each input is normalised on its own: hidden states and embeddings live on very different scales, and
    one norm over the concatenation would drown the token in the context. Inputs are cast to the model's own
    dtype (float32: a small network trained from scratch), whatever the policy's (bf16 on a GPU).
    """

    def __init__(self, hidden_size: int, embedding_size: int, width: int = 512):
        super().__init__()
        self.hidden_norm = nn.LayerNorm(hidden_size)
        self.embedding_norm = nn.LayerNorm(embedding_size)
        self.net = nn.Sequential(
            nn.Linear(hidden_size + embedding_size, width), nn.SiLU(),
            nn.Linear(width, width), nn.SiLU(),
            nn.Linear(width, 1),
        )

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``hidden`` (N, H) with ``embeddings`` (N, C, E) → rewards (N, C)."""
        dtype = self.hidden_norm.weight.dtype
        states = self.hidden_norm(hidden.to(dtype))[:, None, :].expand(-1, embeddings.shape[1], -1)  # (N, C, H)
        inputs = torch.cat([states, self.embedding_norm(embeddings.to(dtype))], dim=-1)  # (N, C, H + E)
        return torch.sigmoid(self.net(inputs)).squeeze(-1)  # (N, C)


def fit_reward_model(hidden: HiddenStates | torch.Tensor, candidate_embeddings: Callable[[torch.Tensor], torch.Tensor],
                     candidates: torch.Tensor, probs: torch.Tensor, cfg: RLMedusaTraining,
                     accelerator: Accelerator) -> tuple[TokenRewardModel, list[float]]:
    """MSE fit of r(e, h) to the base model's probabilities. ``hidden`` (R, H) (read a batch at a time),
    ``candidates`` and ``probs`` (R, C); ``candidate_embeddings`` maps token ids to (frozen) input embeddings.
    The model ends on ``accelerator.device``."""
    torch.manual_seed(cfg.seed)
    embedding_size = candidate_embeddings(candidates[:1]).shape[-1]
    model = TokenRewardModel(hidden.shape[-1], embedding_size, cfg.reward_width)

    def step(model: TokenRewardModel, batch: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        states, tokens, targets = batch
        loss = F.mse_loss(model(states, candidate_embeddings(tokens)).float(), targets.float())
        return loss, {"loss": loss.detach()}

    # AdamW at its default weight decay (1e-2) and a constant rate
    model, history = train(model, StateDataset(hidden, candidates, probs), step, model.parameters(),
                           partial(torch.optim.AdamW, lr=cfg.reward_learning_rate), accelerator=accelerator,
                           epochs=cfg.reward_epochs, batch_size=cfg.reward_batch_size, seed=cfg.seed,
                           desc="reward model r(e, h)", count_changes="RLMedusa reward model", loop=cfg)
    return model.eval(), history["loss"]


@torch.no_grad()
def evaluate_reward_model(model: TokenRewardModel, hidden: HiddenStates | torch.Tensor,
                          candidate_embeddings: Callable[[torch.Tensor], torch.Tensor], candidates: torch.Tensor,
                          probs: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
    """Held-out MSE, and how often r ranks the true top-1 candidate (column 0) first among the 9. ``hidden``
    (R, H), ``candidates`` and ``probs`` (R, C), scored ``batch_size`` states at a time on the model's device."""
    device = next(model.parameters()).device
    predicted = torch.cat([
        model(hidden[start : start + batch_size].to(device),
              candidate_embeddings(candidates[start : start + batch_size]).to(device)).float().cpu()
        for start in range(0, len(candidates), batch_size)])  # (R, C)
    return {"mse": F.mse_loss(predicted, probs.float()).item(),
            "top1_ranked_first": (predicted.argmax(dim=-1) == probs.argmax(dim=-1)).float().mean().item()}


def shaped_rewards(rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float
                   ) -> torch.Tensor:
    """R = r − β·KL with the per-sample KL estimate log p(a) − log p_ref(a) (no gradient through it)."""
    return rewards - beta * (logprobs - ref_logprobs).detach()


def reinforce_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE: −E[A · log p(a)], advantages treated as constants. Both (N, G)."""
    return -(advantages.detach() * logprobs).mean()


def state_baselined_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Baseline = the mean reward of the G actions sampled in the same state: (N, G) → (N, G)."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def _global_batch(local: torch.Tensor, accelerator: Accelerator | None) -> tuple[torch.Tensor, slice]:
    """Every process's rows of a batch, (P·N, ...) and the same on each, and this process's rows in it; with
    one process (or none given), ``local`` itself."""
    if accelerator is None or accelerator.num_processes == 1:
        return local, slice(None)
    n = len(local)  # the loop's loader gives every process a batch of the same size
    return accelerator.gather(local.contiguous()), slice(accelerator.process_index * n,
                                                         (accelerator.process_index + 1) * n)


def reinforce_step_loss(head_logits: torch.Tensor, ref_logits: torch.Tensor, hidden: torch.Tensor,
                 reward_model: TokenRewardModel, embed: Callable[[torch.Tensor], torch.Tensor], num_actions: int,
                 beta: float, generator: torch.Generator | None = None, accelerator: Accelerator | None = None,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """One REINFORCE loss over a batch of states: sample ``num_actions`` tokens per state from the head.

    ``head_logits``/``ref_logits`` (N, V) of the trained head and its frozen start, ``hidden`` (N, H);
    ``generator`` on their device. Under several processes (``accelerator``) the actions are drawn for the
    global batch and the advantages scaled by its spread, so the run does not depend on how many processes
    share a batch: P processes with batches of N train exactly as one with batches of P·N.
    """
    logps = torch.log_softmax(head_logits.float(), dim=-1)  # (N, V)
    ref_logps = torch.log_softmax(ref_logits.float(), dim=-1)
    probs, mine = _global_batch(logps.detach().exp(), accelerator)  # (P·N, V)
    actions = torch.multinomial(probs, num_actions, replacement=True, generator=generator)[mine]  # (N, G)
    logprobs = logps.gather(1, actions)  # (N, G)
    with torch.no_grad():
        rewards = reward_model(hidden, embed(actions)).float()  # (N, G)
    shaped = shaped_rewards(rewards, logprobs, ref_logps.gather(1, actions), beta)
    advantages = state_baselined_advantages(shaped)
    # r is a probability, often ~1e-3: scaling advantages to unit spread keeps the step size independent of it
    advantages = advantages / (_global_batch(advantages, accelerator)[0].std() + 1e-8)
    loss = reinforce_loss(logprobs, advantages)
    kl = (logps.exp() * (logps - ref_logps)).sum(dim=-1).mean()  # exact KL(p₂ ‖ p_ref), for the log
    return loss, {"loss": loss.item(), "reward": rewards.mean().item(), "kl": kl.item()}


def train_rl_head(heads: MedusaHeads, lm_head: nn.Module, reward_model: TokenRewardModel,
                  embed: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, cfg: RLMedusaTraining,
                  accelerator: Accelerator,
                  on_step: Callable[[int, int, dict[str, float]], None] | None = None,
                  ) -> tuple[MedusaHeads, dict[str, list[float]]]:
    """Train head 1 (the t + 2 head) of a copy of ``heads`` by REINFORCE on r − β·KL(· ‖ its start).

    Only head 1's parameters change; the other heads are returned as they were. ``hidden`` (R, H) are the
    trajectory states (read a batch at a time). The heads train and come back in the LM head's dtype and on
    its device (the shared loop keeps float32 master weights under autocast when that dtype is a half one).
    Returns the new heads and per-step ``loss``, ``reward`` (mean r of sampled tokens), ``kl`` (exact,
    against the start) and ``learning_rate``.
    """
    torch.manual_seed(cfg.seed)
    lm_head.requires_grad_(False)  # part of the frozen backbone: only head 1's own parameters learn
    heads = copy.deepcopy(heads).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
    reference = copy.deepcopy(heads).requires_grad_(False).eval()
    trained = [p for name, p in heads.named_parameters() if name.startswith(("blocks.0.", "projections.0."))]
    for p in heads.parameters():
        p.requires_grad_(any(p is q for q in trained))
    generator = torch.Generator(device=accelerator.device).manual_seed(cfg.seed)  # the sampled actions

    def step(heads: MedusaHeads, batch: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        states = batch[0].to(lm_head.weight.dtype)
        head_logits = heads(states, lm_head, only=0)  # (N, V)
        with torch.no_grad():
            ref_logits = reference(states, lm_head, only=0)
        return reinforce_step_loss(head_logits, ref_logits, states, reward_model, embed, cfg.num_actions, cfg.beta,
                                   generator, accelerator)

    heads, history = train(heads, StateDataset(hidden), step, trained,
                           partial(torch.optim.AdamW, lr=cfg.learning_rate, weight_decay=0.0),
                           accelerator=accelerator, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed,
                           desc="RL head (t+2)", show=("reward", "kl"), on_step=on_step,
                           count_changes="RLMedusa t+2 head", loop=cfg, resumable=[GeneratorState(generator)])
    return heads.eval(), history
