"""The knobs of Medusa-1 training, RLMedusa and the tree speculative decoding benchmark (docs/medusa.md).

Each knob is declared once, here (:class:`models.common.config.Knobs`): the components the model code takes
(:class:`MedusaTraining`, :class:`RLMedusaCandidates`, :class:`RLMedusaTraining`) and the ``params.yaml`` sections
that subclass them (``medusa``, ``rlmedusa``, ``medusa_benchmark``), adding only the knobs their task reads beside
the model code. Pydantic and names only, no heavy imports: loading the params never loads model code.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from models.common.config import FileSourceConfig
from models.common.config import Knobs, MixedPrecision, TrainingLoop
from models.engine.config import Adaptation, DraftDtypeName, DynamicTree, TypicalAcceptance


class RLMedusaCandidates(Knobs):
    """RLMedusa's data collection, over the states of Medusa's frozen self-distillation pass: the trajectory states
    and the candidate tokens whose t + 2 probabilities the reward model is fitted to
    (:func:`models.medusa.rlmedusa.trajectory_candidates`)."""

    trajectory_tokens: int = Field(20, ge=1)
    """RL states per response: the steps of each response used as states (the paper's 20-token trajectories)."""
    top_candidates: int = Field(3, ge=0)
    """Candidates per state drawn from ranks 2 … top_pool (plus the top-1 itself)."""
    top_pool: int = Field(50, ge=2)
    """The paper's "top-50" the ``top_candidates`` are drawn from."""
    random_candidates: int = Field(5, ge=0)
    """Candidates per state drawn uniformly from the rest of the vocabulary."""


class RLMedusaTraining(TrainingLoop):
    """RLMedusa's reward model r(e, h) and policy-gradient t + 2 head."""

    reward_width: int = Field(512, ge=1)
    """Hidden width of the reward network."""
    reward_learning_rate: float = Field(1e-3, gt=0.0)
    """AdamW learning rate of the reward model (MSE)."""
    reward_epochs: int = Field(8, ge=1)
    """Passes over the reward data."""
    reward_batch_size: int = Field(256, ge=1)
    """States per reward-model step, each with all its candidates."""
    num_actions: int = Field(8, ge=2)
    """G: tokens sampled per state, the group whose mean reward is the baseline."""
    beta: float = Field(0.5, ge=0.0)
    """KL coefficient to the starting head. The paper advises a small one; here the learned r(e, h) ranks the true
    t + 2 token first only ~28 % of the time, and at 0.02 (lr 3e-4) the head exploited r: sampled reward 0.27 →
    0.69 while its t + 2 top-1 fell 0.434 → 0.19. At 0.5 (lr 1e-4) it kept 0.443 (docs/medusa.md, "RL budgets")."""
    learning_rate: float = Field(1e-4, gt=0.0)
    """AdamW learning rate of head 1 (3e-4 with β 0.02 let it drift onto r's errors)."""
    epochs: int = Field(5, ge=1)
    """Passes over the training trajectory states."""
    batch_size: int = Field(64, ge=1)
    """States per policy-gradient step."""
    seed: int = 0
    """Seed of initialisation, shuffling, action sampling and the draw of the RL candidates."""


Targets = Literal["greedy", "sampled"]
"""Head k's target at t + k + 1: the backbone's greedy choice there given the prefix, or the token in the data."""


class MedusaTraining(TrainingLoop):
    """Medusa-1: the heads, their self-distilled targets and their training (AdamW, cosine schedule)."""

    num_heads: int = Field(4, ge=1, le=8)
    """K: head k predicts token t + k + 1 from the hidden state at t."""
    num_layers: int = Field(1, ge=1)
    """Residual blocks per head."""
    untie: bool = False
    """Give each head its own trainable vocabulary projection (a copy of the LM head) instead of sharing the
    frozen LM head (tied-embedding models such as SmolLM2 share their embedding matrix)."""
    targets: Targets = "greedy"
    """Target at t + k + 1: the policy's greedy choice there given the prefix (what greedy verification
    checks), or the token in the data itself (the same thing for ``distill.data: greedy``)."""
    loss_decay: float = Field(0.8, gt=0.0, le=1.0)
    """Head k's loss weight is loss_decay^(k−1) (Medusa's 0.8)."""
    learning_rate: float = Field(1e-3, gt=0.0)
    """AdamW learning rate (Medusa-1's 1e-3)."""
    epochs: int = Field(4, ge=1)
    """Passes over the training positions."""
    batch_size: int = Field(64, ge=1)
    """Positions per step."""
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0)
    """Share of steps with linear warm-up before the cosine decay."""
    distill_batch_size: int = Field(40, ge=1)
    """Sequences per batch of the frozen self-distillation pass (the greedy generation's: ``distill.batch_size``)."""
    max_length: int = Field(512, ge=8)
    """Longest prompt + response (+ end token) sequence, in tokens: a longer one is dropped, never truncated, and
    counted in the stage's ``*_dropped_too_long`` metrics."""
    mixed_precision: MixedPrecision = "bf16"
    """bfloat16 autocast for the frozen self-distillation pass and head training (``accelerate``); ~2.5× faster
    on CPUs with AVX-512 BF16."""
    seed: int = 0
    """Seed of initialisation and shuffling (the RL candidates': ``rlmedusa.seed``; the prompt split's:
    ``distill.seed``)."""


class MedusaConfig(MedusaTraining):
    """Medusa heads and their Medusa-1 training on self-distilled data (stage ``train_medusa``; the data: stage
    ``distill``, section ``distill``)."""

    eval_top_k: int = Field(5, ge=1)
    """The k of the top-k accuracy reported per head."""


class RLMedusaConfig(RLMedusaCandidates, RLMedusaTraining):
    """RLMedusa: reward model r(e, h) and the policy-gradient t + 2 head (stage ``train_rlmedusa``; its candidates
    are drawn over the states of ``train_medusa``'s self-distillation pass)."""

    inits: list[Literal["base", "supervised"]] = Field(default_factory=lambda: ["base", "supervised"], min_length=1)
    """One RL head per entry; where head 1 starts and what the KL keeps it near: ``base`` = a fresh Medusa
    head (the backbone's next-token head, so the KL is the paper's KL to p₁), ``supervised`` = the
    Medusa-1 head 1 (RL as fine-tuning)."""


class MedusaBenchmarkConfig(TypicalAcceptance):
    """Tree speculative decoding and its benchmark (stage ``benchmark_medusa``); with ``acceptance: typical`` the
    section is the verifier's acceptance rule."""

    tree: list[list[int]] | Literal["auto"] = "auto"
    """Candidate tree: ``auto`` = the ``tree_size`` paths the supervised heads' drafts had accepted most often on
    held-out responses (measured jointly along each path: docs/medusa.md#the-tree); or explicit paths of
    per-depth ranks ([0, 1] = head 1's best token, then head 2's second best), depth ≤ medusa.num_heads."""
    tree_size: int = Field(4, ge=1, le=64)
    """Nodes of the ``auto`` tree besides the root (each tree forward scores tree_size + 1 tokens; at most the 64
    paths ``train_medusa`` measured). 4 suits the default bf16 policy on the 2-core CPU: a forward of 4 tokens
    costs what one of 1 token does (46 vs 47 ms), 8 tokens 1.3×, 16 tokens 1.6×, and with the default heads 4, 5,
    6 and 8 nodes all ran at 2.2× greedy on the task prompts (the top-1 chain to depth 4 first, then second
    choices) while smaller trees are cheaper in a batch. In fp32 (77 / 120 / 91 / 107 ms for 1 / 4 / 8 / 16
    tokens: MKL's GEMM blocking) take 7; on a GPU, where a forward of tens of tokens costs what one of 1 does,
    larger trees pay (docs/medusa.md#the-tree)."""
    acceptance: Literal["greedy", "typical"] = "greedy"
    """``greedy``: lossless exact-match verification; ``typical``: Medusa's typical acceptance (lossy)."""
    decoders: list[Literal["greedy", "prompt_lookup", "medusa_supervised", "medusa_rl", "mtp_chain", "mtp_tree"]] = (
        Field(default_factory=lambda: ["greedy", "prompt_lookup", "medusa_supervised", "mtp_chain", "mtp_tree"]))
    """Decoders to compare at batch 1 (HF greedy with KV cache is always the reference): HF prompt lookup, Medusa
    (``medusa_supervised``; ``medusa_rl`` runs once per RL head, ``rlmedusa.inits``, as ``medusa_rl_base`` /
    ``medusa_rl_supervised``), and the ``train_mtp`` stage's MTP module as a drafter: ``mtp_chain`` (its K chained
    top-1 drafts) and ``mtp_tree`` (EAGLE-2's dynamic tree, ``dynamic_tree``). Every drafter also decodes every
    prompt of every set batched, greedy-verified (``<decoder>_batched``; ``mtp_tree``: each row its own dynamic
    tree), and runs on the speed curve (``curve_sets``). Prompt lookup runs on the timed prompts only."""
    prompt_lookup_tokens: int = Field(10, ge=1)
    """``prompt_lookup_num_tokens`` of HF prompt-lookup decoding."""
    num_prompts: int = Field(40, ge=1)
    """Prompts of each prompt set (the first ones of the eval split, of each prompt file) decoded by HF greedy
    and the Medusa decoders: τ and the share identical to greedy, with intervals over them."""
    speed_prompts: int = Field(8, ge=1)
    """The first prompts of each set also timed at batch 1, every decoder interleaved prompt by prompt: speedups
    and their intervals are over these."""
    general_prompts: int = Field(24, ge=0)
    """The first held-out instructions of the project's general instruction set (≤ 48), benchmarked as their own
    prompt set (``general``; 0 = none): writing, reasoning and coding requests, unlike the task prompts. 24 on the
    2-core CPU default (40 until issue #34, for the 30-minute budget); the 8B configs and docs/study.md use 40–48."""
    batch_size: int = Field(40, ge=1)
    """Prompts at a time of the greedy reference that identity is judged against (HF greedy over each whole set,
    left-padded, untimed; lower on OOM). At batch 1 it cost as much as the Medusa decoding it checks."""
    float32_recheck: bool = True
    """Where an output differs from greedy's and the policy is not float32: also score the first differing
    position with a float32 copy of the policy (loaded once, at the first divergence; 4 bytes per parameter)."""
    draft_dtype: DraftDtypeName = "bfloat16"
    """Precision of the drafts (Medusa's heads, the MTP module, and a copy of the LM head they read). Verification
    stays in the policy's dtype, so this never changes greedy-verified output; bf16 drafts are ~4× cheaper on a CPU
    with bf16 units."""
    adaptive: bool = True
    """The drafting decoders (Medusa, MTP) draft only while drafting pays: where the last cycles gained fewer
    tokens than a cycle costs in plain forwards (measured in the run), they decode plainly, probing again every
    few tokens (``adaptation``). Lossless either way."""
    adaptation: Adaptation = Field(default_factory=Adaptation)
    """The adaptive drafting rule of every drafting decoder (Medusa, MTP), one decision state each, at batch 1 and
    in the speed curve (``adaptive``; :class:`models.engine.config.Adaptation`)."""
    dynamic_tree: DynamicTree = Field(default_factory=DynamicTree)
    """The ``mtp_tree`` decoder's EAGLE-2 dynamic tree (:class:`models.engine.config.DynamicTree`); with ``budget:
    auto`` the budget comes from the policy's verification cost against tree width, measured at the start of the
    stage (``verification_cost.csv``, ``verification_cost.png``, metric ``mtp_tree.budget``)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest output."""
    prompt_files: list[FileSourceConfig] = Field(default_factory=list)
    """Extra prompt sets (local jsonl/parquet/csv files), each benchmarked like the held-out prompts: ``num_prompts``
    rows drawn across the whole file with ``seed``."""
    seed: int = 0
    """Seed of the rows drawn from each prompt file (the same draw on every machine)."""
    curve_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 16])
    """The speed curve's batch sizes: HF batched greedy (left-padded, the reference) against each Medusa decoder in
    the batched tree engine (greedy-verified, adaptive as ``adaptive``, with a decision state per batch size), the
    decoders interleaved batch by batch on the same prompts (``speed_curve.csv``, ``speed_curve.png``); empty: no
    curve. On the 2-core CPU a 4-node tree forward of 16 rows cost 2.4 plain batch steps (83 vs 34 ms) against
    1.2 at one row: drafting stops paying as the batch grows. The study profile adds batch 4."""
    curve_batches: int = Field(3, ge=2)
    """Timed batches per batch size (the intervals' units; the set's prompts in order, cycled when too few)."""
    curve_sets: list[str] = Field(default_factory=lambda: ["held_out"])
    """The prompt sets the speed curve runs on (``held_out``, ``general``, a prompt file's stem); a name that is
    not a benchmarked set is an error. The default's general instructions are timed at batch 1 only (the 30-minute
    budget; the curve on them cost ~75 s on the 2-core CPU); the study profile adds them."""


def tree_fits_the_heads(benchmark: MedusaBenchmarkConfig, medusa: MedusaConfig) -> None:
    """A configured tree (``medusa_benchmark.tree``) is well formed and no deeper than the heads trained
    (``medusa.num_heads``): each depth needs a head. Run wherever a config holds both sections
    (:data:`foresight.params.CROSS_CHECKS`)."""
    tree = benchmark.tree
    if tree == "auto":
        return
    if not tree or any(not path or min(path) < 0 for path in tree):
        raise ValueError("medusa_benchmark.tree must be a non-empty list of non-empty paths of non-negative ranks, "
                         "e.g. [[0], [0, 0]]")
    deepest = max(len(path) for path in tree)
    if deepest > medusa.num_heads:
        raise ValueError(f"medusa_benchmark.tree is {deepest} deep but medusa.num_heads is {medusa.num_heads}: "
                         "each depth needs a head")
