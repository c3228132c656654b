"""The pipeline's stages, declared once: ``dvc.yaml``, the Prefect flows and deployments, the pipeline's stage
table and the tests all follow from :data:`STAGES`.

A stage declares what it reads: config keys (``params``) and data (``inputs``), and what it writes
(``outputs``). Its code is not declared but found: the project modules its process imports
(:func:`stage_modules`: its task module, the config modules of its params sections and the stage runner, followed
through their imports). DVC re-runs a stage when any of them changes, so a read left undeclared lets ``dvc repro``
call a stale result up to date. The declarations are therefore enforced every time a stage runs
(``flows.stages.run_stage``): the task gets a config holding only its declared sections and keys
(:func:`foresight.params.parse_params`: reading another key fails where it happens), and a stage process started
by DVC checks that every project module it imported lies in the stage's code (:func:`undeclared_modules`).

``foresight dvc-yaml > dvc.yaml`` writes the DVC pipeline (:func:`render_dvc_yaml`); a test keeps the
committed file equal to it.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from foresight.params import ORCHESTRATION_SECTIONS, SECTIONS
from models.common.files import atomic_path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: module names map to files under it."""

GPU_TAG = "gpu"
"""The Prefect tag of every task that runs a network (:attr:`Stage.gpu`): a concurrency limit on it guards the GPUs
(``prefect concurrency-limit create gpu 1``)."""


def retry_when(is_transient: Callable[[BaseException], bool]) -> Callable[..., bool]:
    """A Prefect task's ``retry_condition_fn``: a failed run goes on to the task's retries only when its exception
    is transient by ``is_transient`` (a stage's CUDA error, DVC's git index lock)."""
    def condition(task, task_run, state) -> bool:
        try:
            state.result()
        except Exception as error:  # noqa: BLE001 - the failure's own exception decides
            return is_transient(error)
        return False

    return condition


PATH_EXPRESSION = re.compile(r"^\$\{paths\.(\w+)\}(?:/(.+))?$")
"""``${paths.NAME}`` or ``${paths.NAME}/sub/path``: a location under a ``paths`` entry of params.yaml, as DVC
interpolates it in ``dvc.yaml``."""

@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the task it runs and everything it reads and writes."""

    name: str
    """The DVC stage name (``python -m flows.stages NAME``); its flow and deployment are NAME with dashes."""
    description: str
    """One line: what the stage does (the flow's description in the Prefect UI)."""
    task: str
    """``module:function`` of the stage's Prefect task (with ``cache_policy=NO_CACHE``: a cache key would read the
    whole config); the module is imported only when the stage runs."""
    params: tuple[str, ...]
    """Config sections (``medusa``) or dotted keys (``prompts.system_prompt``) the task reads; the task's config
    holds these and nothing else (a section named by dotted keys alone holds only those keys)."""
    outputs: tuple[str, ...]
    """Path expressions (``${paths.X}`` or ``${paths.X}/sub``) the stage writes, each replaced atomically."""
    inputs: tuple[str, ...] = ()
    """Path expressions of the data the stage reads (other stages' outputs)."""
    details: str = ""
    """What the stage does, in full: the stage table of docs/guide.md (:func:`render_stage_details`)."""
    output_files: str = ""
    """What the stage writes, as the stage table of docs/guide.md shows it (markdown)."""
    headline: tuple[str, ...] = ()
    """Metrics shown in the pipeline's stage table (all metrics are in MLflow and data/metrics/ anyway)."""
    task_kwargs: Mapping[str, str] = field(default_factory=dict)
    """Arguments after the config, for a task that serves several stages; a path expression is passed as the
    absolute path it names."""
    distributed: bool = False
    """A training stage, or generation: under ``launch.num_processes`` > 1 its task runs in every process of an
    ``accelerate launch`` (data parallel; ``flows.stages``), so it also depends on the ``launch`` section."""
    files: tuple[str, ...] = ()
    """Dotted params keys naming local files or folders the task reads (``prompts.file.path``; through a list:
    ``medusa_benchmark.prompt_files.path``). Each configured one that exists is a DVC dependency of the stage,
    hashed by content (:func:`input_files`), so a file edited in place re-runs the stage; a name that is no local
    path (a hub id) is not. Keys that are not paths (``policy.model`` = ``smollm2-135m-instruct``) are skipped."""
    gpu: bool = False
    """The stage runs a network: its task is a ``gpu``-tagged Prefect task (a concurrency limit on the tag guards
    the GPUs; :func:`tasks.common.gpu_task`), and its deployment goes to the GPU work pool (``flows/serve.py``)."""
    memory: str = "no_gpu_memory"
    """The function of :mod:`foresight.memory` estimating the stage's GPU memory (``foresight plan``, and the check
    before the stage starts on GPUs)."""
    disk: str = ""
    """The function of :mod:`foresight.memory` estimating what the stage leaves on disk (``foresight plan``)."""
    curves: bool = False
    """The task reports per-step curves (``StageResult.curves``): the flow writes each as a CSV (``step,value``)
    under :attr:`curves_dir`, a DVC plot of the stage (``dvc plots show`` / ``dvc plots diff``)."""

    @property
    def dvc_params(self) -> tuple[str, ...]:
        """The params DVC tracks: the task's reads, and ``launch`` for a distributed stage."""
        return (*self.params, "launch") if self.distributed else self.params

    @property
    def file_params(self) -> tuple[str, ...]:
        """The params naming files the stage reads: :attr:`files`, and ``launch.accelerate_config`` for a
        distributed stage."""
        return (*self.files, "launch.accelerate_config") if self.distributed else self.files

    @property
    def config_keys(self) -> tuple[str, ...]:
        """What the stage's config holds (:func:`foresight.params.parse_params`): its params and the params naming
        its files, the ``paths`` entries of its inputs and outputs (and of its metrics), and the sections the stage
        runner itself reads (:data:`foresight.params.ORCHESTRATION_SECTIONS` but ``paths``)."""
        located = {path_name(expression) for expression in (*self.inputs, *self.outputs, self.metrics_file)}
        return (*self.dvc_params, *self.file_params, *(f"paths.{name}" for name in sorted(located)),
                *(name for name in ORCHESTRATION_SECTIONS if name != "paths"))

    @property
    def code(self) -> tuple[str, ...]:
        """The files (relative to the repository root) of every project module the stage's process imports, and
        the data files those modules read (:func:`stage_modules`): the stage's DVC code deps."""
        return stage_code(self)

    @property
    def flow_name(self) -> str:
        """The Prefect flow's (and deployment's) name: ``train_reward_dpo`` → ``train-reward-dpo``."""
        return self.name.replace("_", "-")

    @property
    def metrics_file(self) -> str:
        """The stage's DVC metrics file, as a path expression."""
        return f"${{paths.metrics_dir}}/{self.name}.json"

    @property
    def curves_dir(self) -> str:
        """The folder of the stage's curves, one CSV each, as a path expression."""
        return f"${{paths.metrics_dir}}/curves/{self.name}"


def _parse_path(expression: str) -> tuple[str, str | None]:
    match = PATH_EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"{expression!r} is not a path expression (${{paths.NAME}} or ${{paths.NAME}}/sub/path)")
    return match.group(1), match.group(2)


def path_name(expression: str) -> str:
    """The ``paths`` entry a path expression starts from: ``${paths.reward_dir}/base`` → ``reward_dir``."""
    return _parse_path(expression)[0]


def resolve_path(cfg, expression: str) -> Path:
    """The absolute path a path expression names under ``cfg`` (its ``paths`` entry relative to the params file)."""
    name, sub = _parse_path(expression)
    base = cfg.path(getattr(cfg.paths, name))
    return base / sub if sub else base


def _values(node, keys: list[str]) -> list:
    """The values at the dotted ``keys`` under ``node``, through lists (each item) and unset sections (none)."""
    if node is None:
        return []
    if isinstance(node, (list, tuple)):
        return [value for item in node for value in _values(item, keys)]
    if not keys:
        return [node]
    return _values(getattr(node, keys[0]), keys[1:])


def input_files(stage: Stage, cfg) -> list[str]:
    """The local files and folders ``stage`` reads by its params (:attr:`Stage.file_params`) that exist, sorted,
    as ``dvc.yaml`` names them: relative to the params file's folder (the repository root) when inside it, else
    absolute (DVC hashes those too)."""
    files = set()
    for key in stage.file_params:
        for value in _values(cfg, key.split(".")):
            path = cfg.path(Path(value).expanduser())
            if path.exists():
                root = cfg.root.resolve()
                path = path.resolve()
                files.add(path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path))
    return sorted(files)


STAGES: tuple[Stage, ...] = (
    Stage(
        name="prepare_policy",
        description="Resolve policy.model to local weights (converting the embedded GGUF once).",
        details='resolves `policy.model`; the embedded GGUF is de-quantised once to safetensors',
        output_files='`data/policy/`',
        task="tasks.policy:prepare_policy_task",
        params=("policy",),
        disk="prepare_policy_disk",
        outputs=("${paths.policy_dir}",),
        files=("policy.model",),
    ),
    Stage(
        name="prepare_prompts",
        description="Read the prompt source; write the train / held-out splits without over-long prompts.",
        details='seeded arithmetic word problems with known answers (or a HF dataset, or a local file); deterministic '
                 'train / held-out split',
        output_files='`data/prompts/{train,eval}.jsonl`',
        task="tasks.prompts:prepare_prompts_task",
        # the policy's tokenizer and context, the response budget and a reward model's length bound the prompts
        params=("prompts", "policy.trust_remote_code", "generate.max_new_tokens", "label.labeler", "label.max_length"),
        inputs=("${paths.policy_dir}",),
        disk="prepare_prompts_disk",
        outputs=("${paths.prompts_dir}",),
        files=("prompts.file.path",),
        headline=("num_train", "num_eval", "dropped_long_prompts"),
    ),
    Stage(
        name="generate",
        description="Sample N responses per training prompt.",
        details='N samples per training prompt (default 4, T = 0.8), batched, seeded; rows that have ended drop out '
                 'of the batch every 8 tokens (`generate.chunk_tokens`); each batch goes to a shard as it finishes, so '
                 'a killed run resumes where it stopped; HF `generate` or vLLM (`generate.engine`)',
        output_files='`data/samples/samples.parquet`',
        task="tasks.generate:generate_task",
        params=("policy", "generate", "prompts.system_prompt"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}"),
        gpu=True,
        memory="generate_memory",
        disk="generate_disk",
        outputs=("${paths.samples}",),
        distributed=True,
        headline=("num_samples", "generation_tokens_per_s", "mean_response_tokens"),
    ),
    Stage(
        name="label",
        description="Score every sample with the configured reward labeler.",
        details='reward per sample, batched with a progress bar: `verifiable` (final answer vs reference, read as '
                 'GSM8K / MATH write them), `armorm` (native ArmoRM, its 19 objective rewards kept too), or '
                 '`hf-classifier`',
        output_files='`data/labels/scores.parquet`',
        task="tasks.label:label_task",
        params=("label",),
        inputs=("${paths.samples}",),
        gpu=True,
        memory="label_memory",
        disk="label_disk",
        outputs=("${paths.scores}",),
        files=("label.model",),
        headline=("sample_accuracy", "mean_reward"),
    ),
    Stage(
        name="validate",
        description="Validate samples and scores with Great Expectations, build and validate preference pairs.",
        details='Great Expectations suites on samples, scores and pairs (HTML Data Docs); every (higher, lower) '
                 'response pair of a prompt — with the answer check, every (correct, incorrect) pair — each marked '
                 '`best_worst` for the one DPO trains on (`validate.pairing`, `dpo.pairs`)',
        output_files='`data/pairs/pairs.parquet`, `data/reports/datadocs/`',
        task="tasks.validate:validate_task",
        params=("validate", "generate.max_new_tokens", "label"),
        inputs=("${paths.samples}", "${paths.scores}"),
        disk="validate_disk",
        outputs=("${paths.pairs}", "${paths.reports_dir}/datadocs"),
        headline=("num_pairs", "pair_yield", "dropped_no_spread"),
    ),
    Stage(
        name="distill",
        description="Self-distillation data: the policy's greedy responses to the task and general prompts that "
                    "Medusa, RLMedusa, COrAL and the MTP module learn from, split by prompt.",
        details="the policy's greedy responses to 384 task prompts (the 96 training prompts and 288 further problems "
                 "of the source, for the Medusa heads alone) and to 64 instructions of the project's general "
                 "instruction set (`foresight/instructions/general.jsonl`: writing, advice, reasoning, coding), or "
                 "the generated samples (`distill.data`); with `distill.self_instruct_prompts`, also to instructions "
                 "the policy writes itself from the set's training instructions (Self-Instruct §2.2: sampled, "
                 "deduplicated, never a held-out one; all for training); one train / held-out split by prompt that "
                 "every drafter takes",
        output_files='`data/distill/` (`responses.parquet`, `split.safetensors`, `dropped_long_prompts.json`)',
        task="tasks.distill:distill_task",
        # prompts, generate.max_new_tokens and label.*: the prompt limit of the further and general prompts
        params=("policy", "distill", "prompts", "generate.max_new_tokens", "label.labeler", "label.max_length"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.samples}"),
        gpu=True,
        memory="distill_memory",
        disk="distill_disk",
        outputs=("${paths.distill_dir}",),
        files=("prompts.file.path",),  # its further task prompts
        headline=("num_task_responses", "num_general_responses", "num_self_instruct_responses", "num_eval_responses"),
    ),
    Stage(
        name="train_reward",
        description="Train the reward channel (and the adapter baselines) on the base policy with the BT loss; AuTRC.",
        details="the Reward Transformer's reward channel (and two adapter baselines) on the frozen base policy, "
                 'Bradley–Terry loss, on every training pair; held-out pair accuracy and AuTRC with intervals over '
                 'held-out prompts',
        output_files='`data/reward/base/` (`autrc.png`, `loss.png`, heads)',
        task="tasks.sla:train_reward_task",
        task_kwargs={"policy_source": "base", "out_dir": "${paths.reward_dir}/base"},
        params=("policy", "reward"),
        inputs=("${paths.policy_dir}", "${paths.pairs}"),
        gpu=True,
        memory="train_reward_memory",
        disk="train_reward_disk",
        outputs=("${paths.reward_dir}/base",),
        distributed=True,
        curves=True,
        headline=("pair_accuracy_channel", "pair_accuracy_logprob", "autrc_channel", "autrc_adapter1",
                  "autrc_adapter4"),
    ),
    Stage(
        name="dpo",
        description="Fine-tune the policy with DPO on the preference pairs.",
        details="the policy fine-tuned with DPO (TRL) on the same training prompts' best–worst pairs",
        output_files='`data/dpo/`',
        task="tasks.sla:dpo_task",
        params=("policy", "dpo", "reward.eval_fraction", "reward.seed"),
        inputs=("${paths.policy_dir}", "${paths.pairs}"),
        gpu=True,
        memory="dpo_memory",
        disk="dpo_disk",
        outputs=("${paths.dpo_dir}",),
        distributed=True,
        headline=("heldout_accuracy_after",),
    ),
    Stage(
        name="train_reward_dpo",
        description='Train a reward channel on the DPO policy (the paper\'s "llama-DPO + SLA").',
        details='a reward channel on the DPO policy ("llama-DPO + SLA")',
        output_files='`data/reward/dpo/`',
        task="tasks.sla:train_reward_task",
        task_kwargs={"policy_source": "dpo", "out_dir": "${paths.reward_dir}/dpo"},
        params=("policy", "reward"),
        inputs=("${paths.dpo_dir}", "${paths.pairs}"),
        gpu=True,
        memory="train_reward_memory",
        disk="train_reward_disk",
        outputs=("${paths.reward_dir}/dpo",),
        distributed=True,
        curves=True,
        headline=("pair_accuracy_channel", "autrc_channel"),
    ),
    Stage(
        name="benchmark_sla",
        description="Compare greedy, sampling, beam and SLA decoding for the base and DPO policies (Table 1).",
        details='greedy, temperature, top-p, top-k, beam 4 and SLA(d, k, n) on 40 held-out prompts for the base '
                 'policy, greedy and SLA for the DPO policy: win/tie/loss vs greedy, win rate, accuracy and mean '
                 'reward with intervals; greedy and SLA timed at batch 1 on 8 prompts, interleaved (latency vs greedy '
                 "with its interval), the rest decoded 32 prompts at a time (SLA's trees searched in lockstep); the "
                 "reward channel's overhead over 40 interleaved forward pairs",
        output_files='`data/benchmarks/sla/` (`report.md`, `table.csv`, `win_rate.png`, `latency.png`)',
        task="tasks.sla:benchmark_sla_task",
        params=("policy", "sla", "sla_benchmark", "label", "prompts.system_prompt"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.reward_dir}/base", "${paths.reward_dir}/dpo",
                "${paths.dpo_dir}"),
        gpu=True,
        memory="benchmark_sla_memory",
        disk="benchmark_sla_disk",
        outputs=("${paths.benchmarks_dir}/sla",),
        files=("label.model",),
        headline=("base_sla.win_rate", "base_sla_tuned.win_rate", "dpo_sla_vs_dpo_greedy.win_rate",
                  "dpo_sla_tuned_vs_dpo_greedy.win_rate", "base_sla.latency_vs_greedy", "base.reward_channel_overhead"),
    ),
    Stage(
        name="train_medusa",
        description="Medusa-1: train K decoding heads on the frozen policy's own responses to the task and general "
                    "prompts (self-distillation).",
        details="one frozen pass over the `distill` stage's responses (self-distillation), then Medusa-1: 4 heads "
                 '(head k predicts token t + k + 1) on the frozen backbone; held-out top-1/top-5 and per-rank accuracy '
                 "per head, and the paths of drafts held-out text accepts most often (the benchmark's tree)",
        output_files='`data/medusa/supervised/` (heads, `evaluation.json`, `loss.png`), `data/medusa/distilled/`',
        task="tasks.medusa:train_medusa_task",
        params=("policy", "medusa"),
        inputs=("${paths.policy_dir}", "${paths.distill_dir}"),
        gpu=True,
        memory="train_medusa_memory",
        disk="train_medusa_disk",
        outputs=("${paths.medusa_dir}/supervised", "${paths.medusa_dir}/distilled"),
        distributed=True,
        curves=True,
        headline=("top1_head1", "top1_head2", "top5_head1"),
    ),
    Stage(
        name="train_rlmedusa",
        description="RLMedusa: fit the token reward r(e, h), train the t + 2 head by policy gradient, "
                    "compare with Medusa-1.",
        details="RLMedusa: the token reward r(e, h) (MLP, MSE to the base model's probability of a token two steps "
                 'ahead, 9 candidates per step of 20-token trajectories), then head 1 (t + 2) by REINFORCE on r − '
                 'β·KL, from a fresh head (the paper) and from the supervised head; t + 2 accuracy against the '
                 'supervised head',
        output_files='`data/medusa/rl/` (`base/`, `supervised/`, `evaluation.json`, `rl.png`)',
        task="tasks.medusa:train_rlmedusa_task",
        # medusa.mixed_precision: the frozen pass's autocast, under which the candidates' logits are recomputed
        params=("policy", "rlmedusa", "medusa.eval_top_k", "medusa.mixed_precision"),
        inputs=("${paths.policy_dir}", "${paths.distill_dir}", "${paths.medusa_dir}/supervised",
                "${paths.medusa_dir}/distilled"),
        gpu=True,
        memory="train_rlmedusa_memory",
        disk="train_rlmedusa_disk",
        outputs=("${paths.medusa_dir}/rl",),
        distributed=True,
        headline=("supervised_t2_top1", "rl_base_t2_top1", "rl_supervised_t2_top1"),
    ),
    Stage(
        name="train_mtp",
        description="MTP equip: a shared-parameter multi-token-prediction module on the frozen policy, and its "
                    "depth ablation.",
        details='the MTP-equipped stage: a DeepSeek-V3-style MTP module (projection of [norm(embedding of t+k) ; '
                 "norm(previous state)], one decoder layer, the policy's final norm, LM head and embedding) applied K "
                 "= 3 times with shared parameters, trained on the policy's own greedy responses with CE weights 0.6 / "
                 "0.3 / 0.1, the policy frozen; held-out top-1 per depth and the greedy chain's expected acceptance "
                 'length; the same for K = 1, 2, 4 (Table 2); with `mtp.data_curve`, the held-out acceptance per '
                 'prompt set against the number of training responses',
        output_files='`data/mtp/` (`module/`, `evaluation.json`, `ablation.csv`, `ablation.png`, `loss.png`, '
                     '`data_curve.csv` / `.png` with `mtp.data_curve`)',
        task="tasks.mtp:train_mtp_task",
        params=("policy", "mtp"),
        inputs=("${paths.policy_dir}", "${paths.distill_dir}", "${paths.scores}"),
        gpu=True,
        memory="train_mtp_memory",
        disk="train_mtp_disk",
        outputs=("${paths.mtp_dir}",),
        distributed=True,
        curves=True,
        headline=("held_out_expected_tau", "held_out_top1_depth_1", "ablation_k1_expected_tau",
                  "ablation_k4_expected_tau"),
    ),
    Stage(
        name="benchmark_medusa",
        description="Every drafter side by side vs HF greedy on the task and general prompt sets: HF prompt lookup, "
                    "Medusa / RLMedusa heads, the MTP module as a chain and as an EAGLE-2 dynamic tree: speedup, τ, "
                    "identity to greedy (95 % intervals), divergences.",
        details='at batch 1, per prompt set — 40 held-out task prompts, 24 held-out general instructions, any '
                 '`medusa_benchmark.prompt_files`: HF greedy, HF prompt lookup, Medusa (Medusa-RL by configuration) '
                 'and the MTP module drafting a chain (`mtp_chain`) and an EAGLE-2 dynamic tree (`mtp_tree`, its '
                 "verification budget the one of the most tokens per second, calibrated at the start from the policy's "
                 "verification cost by width and the drafter's acceptance by budget on training prompts) with tree "
                 'verification and adaptive drafting (plain steps while drafting does not pay, one decision state per '
                 'decoder): speedup over greedy on 8 prompts, interleaved, with '
                 'intervals; τ on all prompts, and the share identical to HF greedy decoding the whole set in one '
                 "left-padded batch (batch-1 greedy's own share on the timed prompts shows what batching alone changes "
                 "in bf16); every divergence with the policy's logit margin there (bf16 near-ties); a speed curve at "
                 'batch 1 and 16 on the task prompts (HF batched greedy vs batched Medusa, MTP chain and MTP dynamic tree, '
                 'each row its own tree — adaptive per batch size, interleaved batch by batch, with intervals and '
                 "the share of rows identical to HF's)",
        output_files='`data/benchmarks/medusa/` (`report.md`, `table.csv`, `speed_curve.csv`, `speed_curve.png`, '
                 '`speedup.png`, `tau.png`, `tree.json`, `verification_cost.csv`, `verification_cost.png`)',
        task="tasks.speculative_benchmark:benchmark_medusa_task",
        params=("policy", "medusa_benchmark", "prompts.system_prompt", "rlmedusa.inits", "prompts.max_prompt_tokens",
                "generate.max_new_tokens", "label.labeler", "label.max_length"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.medusa_dir}/supervised",
                "${paths.medusa_dir}/rl", "${paths.mtp_dir}"),
        gpu=True,
        memory="benchmark_medusa_memory",
        disk="benchmark_medusa_disk",
        outputs=("${paths.benchmarks_dir}/medusa",),
        files=("medusa_benchmark.prompt_files.path",),
        headline=("held_out.medusa_supervised.tau", "held_out.medusa_supervised.speedup_vs_reference",
                  "held_out.medusa_supervised.identical_to_greedy", "general.medusa_supervised.speedup_vs_reference",
                  "held_out.mtp_tree.speedup_vs_reference", "general.mtp_tree.speedup_vs_reference"),
    ),
    Stage(
        name="train_coral",
        description="COrAL: two-stage order-agnostic training with target-aware RoPE in the last layer.",
        details="COrAL on the `distill` stage's responses (or the samples labeled correct): target-aware "
                 'RoPE in the last decoder layer, forward prediction at offsets +1…+4 on clean text and backward '
                 'reconstruction at −8…0 on patch-corrupted text (loss on corrupted tokens only); stage 1 trains the '
                 'last layer, stage 2 the rest; held-out top-1 per forward offset before and after',
        output_files='`data/coral/` (the model, `evaluation.json`, `history.json`, `loss.png`, `reconstruction.png`; '
                 'per-offset curves in MLflow)',
        task="tasks.coral:train_coral_task",
        params=("policy", "coral"),
        inputs=("${paths.policy_dir}", "${paths.distill_dir}", "${paths.scores}"),
        gpu=True,
        memory="train_coral_memory",
        disk="train_coral_disk",
        outputs=("${paths.coral_dir}",),
        distributed=True,
        curves=True,
        headline=("after_top1_forward_1", "after_top1_forward_2", "after_top1_forward_4"),
    ),
    Stage(
        name="benchmark_coral",
        description="Sliding blockwise order-agnostic decoding vs next-token greedy: accuracy, speed, ablations "
                    "(Table 1).",
        details='on the COrAL model at batch 1: next-token greedy, full COrAL (eq. 5 ensemble, Appendix C tree, eq. 6 '
                 '+ 7 verification in one tree forward, eq. 8 sliding) on 40 prompts; on the first 8 also w/o '
                 'verifier, w/o multi-forward, plus the block-size ablation (forward-window ablations via '
                 '`coral_benchmark.ablation_forward_windows`): accuracy, tokens/s, speedup, tokens per forward',
        output_files='`data/benchmarks/coral/` (`report.md`, `table.csv`, `table.png`, `ablation_block_size.png`, '
                 '`ablation_forward_window.png`)',
        task="tasks.coral:benchmark_coral_task",
        params=("policy", "coral_benchmark", "prompts.system_prompt"),
        inputs=("${paths.prompts_dir}", "${paths.coral_dir}"),
        gpu=True,
        memory="benchmark_coral_memory",
        disk="benchmark_coral_disk",
        outputs=("${paths.benchmarks_dir}/coral",),
        headline=("next_token.accuracy", "coral.accuracy", "coral.speedup_vs_reference", "coral_no_verifier.accuracy",
                  "coral_no_verifier.speedup_vs_reference"),
    ),
    Stage(
        name="train_mtp_rl",
        description="GRPO with MTP-drafted rollouts and the advantage-aware MTP loss (MTP-RL), against its "
                    "baselines.",
        details='GRPO (reward = the configured labeler: the answer check, or a reward model on open prompts; G '
                 "rollouts per prompt, clip 0.2 / 0.28, token-mean, optional k3 KL) with a step's rollouts at T = 0.8 "
                 'sampled as one batch: vanilla (HF batched sampling) and MTP-drafted (K chained drafts per row, one '
                 'batched verification, speculative sampling per row, each rollout its own seeded stream: exactly the '
                 "policy's distribution); MTP-RL trains policy and module with L_GRPO + w·KL(main ‖ MTP) + 0.2·CE, w = "
                 "1[A ≥ 0]; baselines frozen MTP, CE only, no backprop, and ours with the KL's target detached "
                 '(`mtp_rl.variants`); per step τ, α, rollout time, reward; held-out reward (and accuracy, where '
                 'answers are known) before and after; before RL, in the study profile (`mtp_rl.curve_batch_sizes`), '
                 "MTP drafting's speed at batch 1, 4, 16 (vs HF batched greedy on the held-out prompts, outputs "
                 'compared; vs HF batched sampling on rollouts; interleaved batch by batch, with intervals)',
        output_files='`data/mtp_rl/` (`report.md`, `table.csv`, `history.json`, `decoding_curve.csv`, `rollout_curve.csv`, '
                 '`speed_curve.png`, `tau.png`, `rollout_seconds.png`, `reward.png`)',
        task="tasks.mtp:train_mtp_rl_task",
        params=("policy", "mtp_rl", "mtp.ce_weights", "mtp.num_depths", "prompts.system_prompt", "label"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.mtp_dir}", "${paths.scores}"),
        gpu=True,
        memory="train_mtp_rl_memory",
        disk="train_mtp_rl_disk",
        outputs=("${paths.mtp_rl_dir}",),
        files=("label.model",),
        distributed=True,
        curves=True,
        headline=("mtp_rl.rollout_speedup", "mtp_rl.tokens_per_forward", "mtp_rl.tau_start", "mtp_rl.tau_end",
                  "frozen_mtp.tau_end", "mtp_rl.nonzero_advantage_share", "reward_before", "mtp_rl.reward_after"),
    ),
)

DVC_HEADER = """\
# Generated from foresight/stages.py and params.yaml by `foresight dvc-yaml > dvc.yaml`: edit the stage table, not
# this file (tests/test_stages.py fails when the two differ). One stage per pipeline step; each runs that step's
# Prefect flow. Paths come from params.yaml; so do the local files a stage reads (a prompt file, a local model
# folder), deps hashed by content: `foresight run` / `foresight pipeline` rewrite this file when params.yaml names
# others, and a stage run by plain `dvc repro` fails, naming the file, when this file lacks one.
# Outputs are cached, not `persist`: DVC's run cache restores a stage whose code, data and params it has seen
# before (revert a param and the old results come back without a run). DVC removes a stage's outputs before it
# runs it; the stages write each output to a temporary path and rename it, so an output is whole or absent, never
# half-written, and after a failed run `dvc checkout` brings back the last good version.
"""


def _yaml_list(key: str, items: Iterable[str], properties: dict[str, str] | None = None) -> list[str]:
    lines = [f"    {key}:"]
    for item in items:
        lines += [f"      - {item}:", *(f"          {k}: {v}" for k, v in properties.items())] if properties else [
            f"      - {item}"]
    return lines


def _outermost(paths) -> list[str]:
    """The declared code paths, sorted, without those inside another declared folder (DVC hashes folders whole)."""
    unique = sorted(set(paths))
    return [p for p in unique if not any(p.startswith(q + "/") for q in unique)]


def render_dvc_yaml(cfg, stages: Iterable[Stage] = STAGES) -> str:
    """``dvc.yaml`` for the stages under the params ``cfg``: code (sorted), inputs and the local files the params
    name (:func:`input_files`) as deps, params, outputs, the metrics file and the curves (plots)."""
    blocks = []
    for stage in stages:
        lines = [f"  {stage.name}:", f"    cmd: python -m flows.stages {stage.name}"]
        lines += _yaml_list("deps", (*_outermost(stage.code), *stage.inputs, *input_files(stage, cfg)))
        lines += _yaml_list("params", stage.dvc_params)
        lines += _yaml_list("outs", stage.outputs)
        lines += _yaml_list("metrics", [stage.metrics_file])
        if stage.curves:
            lines += _yaml_list("plots", [stage.curves_dir], {"x": "step", "y": "value"})
        blocks.append("\n".join(lines) + "\n")
    return DVC_HEADER + "stages:\n" + "\n".join(blocks)


def sync_dvc_yaml(cfg) -> list[str]:
    """Rewrite ``dvc.yaml`` beside the params (atomically) when it differs from :func:`render_dvc_yaml` under them
    (params naming another prompt file, a local model folder); returns the stages whose entries changed."""
    target = cfg.root / "dvc.yaml"
    wanted = render_dvc_yaml(cfg)
    current = target.read_text() if target.is_file() else ""
    if current == wanted:
        return []
    before = (yaml.safe_load(current) or {}).get("stages", {}) if current else {}
    after = yaml.safe_load(wanted)["stages"]
    with atomic_path(target) as tmp:
        tmp.write_text(wanted)
    return [name for name in after if before.get(name) != after[name]]


def undeclared_files(stage: Stage, cfg) -> list[str]:
    """The local files ``stage`` reads by its params (:func:`input_files`) that ``dvc.yaml`` beside the params
    does not list among its deps: DVC would not re-run it when they change."""
    target = cfg.root / "dvc.yaml"
    stages = (yaml.safe_load(target.read_text()) or {}).get("stages", {}) if target.is_file() else {}
    deps = set(stages.get(stage.name, {}).get("deps", []))
    return [file for file in input_files(stage, cfg) if file not in deps]


PROJECT_PACKAGES = ("foresight", "models", "tasks")
"""Packages whose modules are a stage's code."""

STAGE_RUNNER = "flows.stages"
"""The module every stage process starts from (``python -m flows.stages STAGE``)."""

ORCHESTRATION_MODULES = ("foresight.tracking", "foresight.stages", "foresight.memory")
"""Modules that run every stage, not part of any stage's work (with the ``flows`` package): editing them re-runs
nothing. Only their module-level imports are followed (their functions serve other commands too)."""

MODULE_DATA = {"foresight.prompts": ("foresight/instructions",)}
"""Files a module reads besides code (the general instruction sets): code deps of every stage importing it."""


def _module_file(name: str) -> Path | None:
    """The file of project module ``name`` under :data:`ROOT` (a package's ``__init__.py``), None if none."""
    base = ROOT / name.replace(".", "/")
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            return file
    return None


def _is_project(name: str) -> bool:
    return name.split(".")[0] in (*PROJECT_PACKAGES, "flows")


def _orchestration(name: str) -> bool:
    return name.split(".")[0] == "flows" or name in ORCHESTRATION_MODULES


@functools.cache
def module_imports(name: str) -> frozenset[str]:
    """The project modules module ``name`` imports (with their parent packages): every ``import`` statement, in
    functions too, but those under ``if TYPE_CHECKING:`` (annotations only); for an orchestration module only its
    module-level ones."""
    file = _module_file(name)
    tree = ast.parse(file.read_text(), str(file))
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - child.level + 1], base]).strip(".")
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names
                             if _module_file(f"{base}.{alias.name}") is not None)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not top or not _orchestration(name) or isinstance(child, ast.ClassDef):
                    visit(child, False)
            else:
                visit(child, top)

    visit(tree, True)
    modules = set()
    for module in found:
        parts = module.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(m for m in modules if _is_project(m) and _module_file(m) is not None and m != name)


def import_closure(roots: Iterable[str]) -> set[str]:
    """``roots`` and every project module they import, transitively (:func:`module_imports`)."""
    seen: set[str] = set()
    todo = [m for root in roots for m in (root, *(".".join(root.split(".")[:i]) for i in range(1, root.count(".") + 1)))]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(module_imports(module))
    return seen


def stage_modules(stage: Stage) -> set[str]:
    """The project modules a process of ``stage`` imports, without the orchestration's: its task module, the config
    module of each section its config holds (``foresight.params`` imports them by name), the stage runner, and
    everything they import."""
    sections = {key.split(".")[0] for key in stage.config_keys} | {"paths"}
    roots = {stage.task.partition(":")[0], STAGE_RUNNER, *(SECTIONS[name].partition(":")[0] for name in sections)}
    return {module for module in import_closure(roots) if not _orchestration(module)}


def stage_code(stage: Stage) -> tuple[str, ...]:
    """:attr:`Stage.code`: the files of :func:`stage_modules` and the data they read (:data:`MODULE_DATA`), sorted;
    empty files (package ``__init__``) left out: a package that gains code becomes a dep then."""
    files = set()
    for module in stage_modules(stage):
        file = _module_file(module)
        if file.stat().st_size:  # an empty package __init__ holds nothing to change (DVC warns on empty deps)
            files.add(file.relative_to(ROOT).as_posix())
        files.update(MODULE_DATA.get(module, ()))
    return tuple(sorted(files))


def undeclared_modules(stage: Stage, modules: Mapping[str, Any], root: Path) -> list[str]:
    """The project modules in ``modules`` (e.g. ``sys.modules``) whose files lie outside ``stage``'s code."""
    declared = [(root / entry).resolve() for entry in stage.code]
    undeclared = []
    for name, module in sorted(modules.items()):
        if name.split(".")[0] not in PROJECT_PACKAGES or _orchestration(name):
            continue
        file = getattr(module, "__file__", None)
        if file is None:
            continue
        path = Path(file).resolve()
        if any(path == entry or entry in path.parents for entry in declared) or not path.stat().st_size:
            continue
        undeclared.append(name)
    return undeclared


def _produces(output: str, expression: str) -> bool:
    """Whether a stage's output covers the data a path expression names (the same path, or a folder above it)."""
    return expression == output or expression.startswith(output + "/")


def upstream(stage: Stage, stages: Iterable[Stage] = STAGES) -> list[str]:
    """The stages whose outputs ``stage`` reads (its direct DVC ancestors), in table order."""
    return [other.name for other in stages if other is not stage and any(
        _produces(output, expression) for output in other.outputs for expression in stage.inputs)]


STAGE_DOCS_BEGIN = "<!-- stage table: generated by `foresight stage-docs` from foresight/stages.py; edit it there -->"
STAGE_DOCS_END = "<!-- end of the generated stage table -->"
STAGE_DETAILS_BEGIN = ("<!-- stage details: generated by `foresight stage-docs` from foresight/stages.py; edit it "
                       "there -->")
STAGE_DETAILS_END = "<!-- end of the generated stage details -->"
STAGE_DETAILS_DOC = "docs/guide.md"
"""The page holding the stage table in full (:func:`render_stage_details`), relative to the repository root."""


def render_stage_docs(stages: Iterable[Stage] = STAGES) -> str:
    """The README's picture of the pipeline, one line per stage, between :data:`STAGE_DOCS_BEGIN` and
    :data:`STAGE_DOCS_END`: the DAG (a Mermaid flowchart, each stage after the stages whose outputs it reads) and
    what each stage does (its :attr:`Stage.description`)."""
    stages = list(stages)
    edges = [f"  {' & '.join(parents)} --> {stage.name}" if (parents := upstream(stage, stages)) else
             f"  {stage.name}" for stage in stages]
    table = ["| stage | what it does |", "|---|---|",
             *(f"| `{stage.name}` | {stage.description} |" for stage in stages)]
    return "\n".join([STAGE_DOCS_BEGIN, "```mermaid", "flowchart LR", *edges, "```", "", *table, "",
                      f"Each stage in full, with its outputs: [{STAGE_DETAILS_DOC}]({STAGE_DETAILS_DOC}#stages).",
                      STAGE_DOCS_END])


def render_stage_details(stages: Iterable[Stage] = STAGES) -> str:
    """The stage table in full (what each stage does, what it writes) and the GPU stages, between
    :data:`STAGE_DETAILS_BEGIN` and :data:`STAGE_DETAILS_END` (in :data:`STAGE_DETAILS_DOC`)."""
    stages = list(stages)
    gpu = ", ".join(stage.name for stage in stages if stage.gpu)
    table = ["| stage | what it does | output (DVC-tracked) |", "|---|---|---|",
             *(f"| `{stage.name}` | {stage.details} | {stage.output_files} |" for stage in stages)]
    return "\n".join([STAGE_DETAILS_BEGIN, f"GPU stages (tagged `gpu` for Prefect concurrency limits): {gpu}.", "",
                      *table, STAGE_DETAILS_END])


def sync_block(path: Path, begin: str, end: str, block: str) -> bool:
    """Replace the part of ``path`` from the line ``begin`` to the line ``end`` with ``block`` (markers included;
    atomically); True when it changed."""
    text = path.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path}: no generated block to rewrite (the lines {begin!r} and {end!r})")
    start, stop = text.index(begin), text.index(end) + len(end)
    wanted = text[:start] + block + text[stop:]
    if wanted == text:
        return False
    with atomic_path(path) as tmp:
        tmp.write_text(wanted)
    return True


def sync_stage_docs(root: Path) -> list[Path]:
    """Rewrite ``root``'s README.md picture (:func:`render_stage_docs`) and the stage details of
    :data:`STAGE_DETAILS_DOC` (:func:`render_stage_details`); returns the files that changed."""
    blocks = {root / "README.md": (STAGE_DOCS_BEGIN, STAGE_DOCS_END, render_stage_docs()),
              root / STAGE_DETAILS_DOC: (STAGE_DETAILS_BEGIN, STAGE_DETAILS_END, render_stage_details())}
    return [path for path, block in blocks.items() if sync_block(path, *block)]
