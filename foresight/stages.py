"""The pipeline's stages, declared once: ``dvc.yaml``, the Prefect flows and deployments, the pipeline's stage
table and the tests all follow from :data:`STAGES`.

A stage declares what it reads: config keys (``params``), code (``code``: files or folders) and data
(``inputs``), and what it writes (``outputs``). DVC re-runs a stage when any of them changes, so a read left
undeclared lets ``dvc repro`` call a stale result up to date. The declarations are therefore checked every
time a stage runs (``flows.stages.run_stage``): the task gets a :class:`RecordingConfig` that records every
config key it reads (:func:`undeclared_reads`), and a stage process started by DVC checks that every project
module it imported lies in the stage's declared code (:func:`undeclared_modules`). Either finding fails the
stage, naming the undeclared reads.

``foresight dvc-yaml > dvc.yaml`` writes the DVC pipeline (:func:`render_dvc_yaml`); a test keeps the
committed file equal to it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from models.common.files import atomic_path

PATH_EXPRESSION = re.compile(r"^\$\{paths\.(\w+)\}(?:/(.+))?$")
"""``${paths.NAME}`` or ``${paths.NAME}/sub/path``: a location under a ``paths`` entry of params.yaml, as DVC
interpolates it in ``dvc.yaml``."""

ALWAYS_ALLOWED_PATHS = ("metrics_dir",)
"""``paths`` entries every stage may read: each writes its own metrics file there."""


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
    """Config sections (``medusa``) or dotted keys (``prompts.system_prompt``) the task reads."""
    code: tuple[str, ...]
    """Files and folders (relative to the repository root) holding every project module the stage imports."""
    outputs: tuple[str, ...]
    """Path expressions (``${paths.X}`` or ``${paths.X}/sub``) the stage writes, each replaced atomically."""
    inputs: tuple[str, ...] = ()
    """Path expressions of the data the stage reads (other stages' outputs)."""
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


CONFIG_CODE = ("foresight/config.py", *(f"models/{folder}/config.py" for folder in
                                        ("common", "coral", "engine", "labeling", "medusa", "mtp", "sla")))
"""The params and the component configs they take their defaults from (light modules: no model code)."""

TASK_CODE = (*CONFIG_CODE, "foresight/storage.py", "models/common/files.py", "foresight/pairs.py", "tasks/data.py")
"""What every stage process imports around its task: the config, atomic I/O, and the shared task helpers
(``tasks/data.py``, which imports the sample and pair schemas)."""

BENCHMARK_CODE = ("foresight/benchmark.py", "foresight/statistics.py", "foresight/plots.py")
"""Timing, tables and plots: imported by the task modules of every method."""

STAGES: tuple[Stage, ...] = (
    Stage(
        name="prepare_policy",
        description="Resolve policy.model to local weights (converting the embedded GGUF once).",
        task="tasks.data:prepare_policy_task",
        params=("policy",),
        code=(*TASK_CODE, "models/engine"),
        outputs=("${paths.policy_dir}",),
        files=("policy.model",),
    ),
    Stage(
        name="prepare_prompts",
        description="Read the prompt source; write the train / held-out splits without over-long prompts.",
        task="tasks.data:prepare_prompts_task",
        # the policy's tokenizer and context, the response budget and a reward model's length bound the prompts
        params=("prompts", "policy.trust_remote_code", "generate.max_new_tokens", "label.labeler", "label.max_length"),
        code=(*TASK_CODE, "foresight/prompts.py", "models/engine", "models/labeling/answers.py"),
        inputs=("${paths.policy_dir}",),
        outputs=("${paths.prompts_dir}",),
        files=("prompts.file.path",),
        headline=("num_train", "num_eval", "dropped_long_prompts"),
    ),
    Stage(
        name="generate",
        description="Sample N responses per training prompt.",
        task="tasks.data:generate_task",
        params=("policy", "generate", "prompts.system_prompt"),
        code=(*TASK_CODE, "foresight/shards.py", "models/engine"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}"),
        outputs=("${paths.samples}",),
        distributed=True,
        headline=("num_samples", "generation_tokens_per_s", "mean_response_tokens"),
    ),
    Stage(
        name="label",
        description="Score every sample with the configured reward labeler.",
        task="tasks.data:label_task",
        params=("label",),
        code=(*TASK_CODE, "models/engine", "models/labeling"),
        inputs=("${paths.samples}",),
        outputs=("${paths.scores}",),
        files=("label.model",),
        headline=("sample_accuracy", "mean_reward"),
    ),
    Stage(
        name="validate",
        description="Validate samples and scores with Great Expectations, build and validate preference pairs.",
        task="tasks.data:validate_task",
        params=("validate", "generate.max_new_tokens", "label"),
        code=(*TASK_CODE, "foresight/validation.py"),
        inputs=("${paths.samples}", "${paths.scores}"),
        outputs=("${paths.pairs}", "${paths.reports_dir}/datadocs"),
        headline=("num_pairs", "pair_yield", "dropped_no_spread"),
    ),
    Stage(
        name="train_reward",
        description="Train the reward channel (and the adapter baselines) on the base policy with the BT loss; AuTRC.",
        task="tasks.sla:train_reward_task",
        task_kwargs={"policy_source": "base", "out_dir": "${paths.reward_dir}/base"},
        params=("policy", "reward"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "models/engine", "models/sla", "tasks/sla.py"),
        inputs=("${paths.policy_dir}", "${paths.pairs}"),
        outputs=("${paths.reward_dir}/base",),
        distributed=True,
        curves=True,
        headline=("pair_accuracy_channel", "pair_accuracy_logprob", "autrc_channel", "autrc_adapter1",
                  "autrc_adapter4"),
    ),
    Stage(
        name="dpo",
        description="Fine-tune the policy with DPO on the preference pairs.",
        task="tasks.sla:dpo_task",
        params=("policy", "dpo", "reward.eval_fraction", "reward.seed"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "models/engine", "models/sla", "tasks/sla.py"),
        inputs=("${paths.policy_dir}", "${paths.pairs}"),
        outputs=("${paths.dpo_dir}",),
        distributed=True,
        headline=("heldout_accuracy_after",),
    ),
    Stage(
        name="train_reward_dpo",
        description='Train a reward channel on the DPO policy (the paper\'s "llama-DPO + SLA").',
        task="tasks.sla:train_reward_task",
        task_kwargs={"policy_source": "dpo", "out_dir": "${paths.reward_dir}/dpo"},
        params=("policy", "reward"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "models/engine", "models/sla", "tasks/sla.py"),
        inputs=("${paths.dpo_dir}", "${paths.pairs}"),
        outputs=("${paths.reward_dir}/dpo",),
        distributed=True,
        curves=True,
        headline=("pair_accuracy_channel", "autrc_channel"),
    ),
    Stage(
        name="benchmark_sla",
        description="Compare greedy, sampling, beam and SLA decoding for the base and DPO policies (Table 1).",
        task="tasks.sla:benchmark_sla_task",
        params=("policy", "sla", "sla_benchmark", "label", "prompts.system_prompt"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common",
              "models/engine", "models/labeling", "models/sla", "tasks/sla.py"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.reward_dir}/base", "${paths.reward_dir}/dpo",
                "${paths.dpo_dir}"),
        outputs=("${paths.benchmarks_dir}/sla",),
        files=("label.model",),
        headline=("base_sla.win_rate", "base_sla_tuned.win_rate", "dpo_sla_vs_dpo_greedy.win_rate",
                  "dpo_sla_tuned_vs_dpo_greedy.win_rate", "base_sla.latency_vs_greedy", "base.reward_channel_overhead"),
    ),
    Stage(
        name="train_medusa",
        description="Medusa-1: train K decoding heads on the frozen policy's own responses to the task and general "
                    "prompts (self-distillation).",
        task="tasks.medusa:train_medusa_task",
        # the distillation pass also collects RLMedusa's trajectory states and candidates (RLMedusaCandidates)
        params=("policy", "medusa", "prompts", "rlmedusa.trajectory_tokens", "rlmedusa.top_candidates",
                "rlmedusa.top_pool", "rlmedusa.random_candidates", "generate.max_new_tokens", "label.labeler",
                "label.max_length"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "foresight/prompts.py", "foresight/instructions",
              "models/engine", "models/medusa", "tasks/medusa.py"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.samples}"),
        outputs=("${paths.medusa_dir}/supervised", "${paths.medusa_dir}/distilled"),
        files=("prompts.file.path",),  # its further task prompts
        distributed=True,
        curves=True,
        headline=("top1_head1", "top1_head2", "top5_head1"),
    ),
    Stage(
        name="train_rlmedusa",
        description="RLMedusa: fit the token reward r(e, h), train the t + 2 head by policy gradient, "
                    "compare with Medusa-1.",
        task="tasks.medusa:train_rlmedusa_task",
        params=("policy", "rlmedusa", "medusa.eval_top_k"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "models/engine", "models/medusa", "tasks/medusa.py"),
        inputs=("${paths.policy_dir}", "${paths.medusa_dir}/supervised", "${paths.medusa_dir}/distilled"),
        outputs=("${paths.medusa_dir}/rl",),
        distributed=True,
        headline=("supervised_t2_top1", "rl_base_t2_top1", "rl_supervised_t2_top1"),
    ),
    Stage(
        name="benchmark_medusa",
        description="Tree speculative decoding with Medusa / RLMedusa heads vs HF greedy on the task and general "
                    "prompt sets: speedup, τ, identity to greedy (95 % intervals), divergences.",
        task="tasks.medusa:benchmark_medusa_task",
        params=("policy", "medusa_benchmark", "prompts.system_prompt", "rlmedusa.inits", "prompts.max_prompt_tokens",
                "generate.max_new_tokens", "label.labeler", "label.max_length"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "foresight/prompts.py", "foresight/instructions",
              "models/engine", "models/medusa", "tasks/medusa.py"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.medusa_dir}/supervised",
                "${paths.medusa_dir}/rl"),
        outputs=("${paths.benchmarks_dir}/medusa",),
        files=("medusa_benchmark.prompt_files.path",),
        headline=("held_out.medusa_supervised.tau", "held_out.medusa_supervised.speedup_vs_reference",
                  "held_out.medusa_supervised.identical_to_greedy", "general.medusa_supervised.speedup_vs_reference"),
    ),
    Stage(
        name="train_coral",
        description="COrAL: two-stage order-agnostic training with target-aware RoPE in the last layer.",
        task="tasks.coral:train_coral_task",
        params=("policy", "coral"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "models/coral", "models/engine", "tasks/coral.py"),
        inputs=("${paths.policy_dir}", "${paths.medusa_dir}/distilled", "${paths.scores}"),
        outputs=("${paths.coral_dir}",),
        distributed=True,
        curves=True,
        headline=("after_top1_forward_1", "after_top1_forward_2", "after_top1_forward_4"),
    ),
    Stage(
        name="benchmark_coral",
        description="Sliding blockwise order-agnostic decoding vs next-token greedy: accuracy, speed, ablations "
                    "(Table 1).",
        task="tasks.coral:benchmark_coral_task",
        params=("policy", "coral_benchmark", "prompts.system_prompt"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common",
              "models/coral", "models/engine", "models/labeling", "tasks/coral.py"),
        inputs=("${paths.prompts_dir}", "${paths.coral_dir}"),
        outputs=("${paths.benchmarks_dir}/coral",),
        headline=("next_token.accuracy", "coral.accuracy", "coral.speedup_vs_reference", "coral_no_verifier.accuracy",
                  "coral_no_verifier.speedup_vs_reference"),
    ),
    Stage(
        name="train_mtp",
        description="MTP equip: a shared-parameter multi-token-prediction module on the frozen policy, and its "
                    "depth ablation.",
        task="tasks.mtp:train_mtp_task",
        params=("policy", "mtp"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common", "models/engine", "models/mtp", "tasks/mtp.py"),
        inputs=("${paths.policy_dir}", "${paths.medusa_dir}/distilled", "${paths.scores}"),
        outputs=("${paths.mtp_dir}",),
        distributed=True,
        curves=True,
        headline=("held_out_expected_tau", "held_out_top1_depth_1", "ablation_k1_expected_tau",
                  "ablation_k4_expected_tau"),
    ),
    Stage(
        name="train_mtp_rl",
        description="GRPO with MTP-drafted rollouts and the advantage-aware MTP loss (MTP-RL), against its "
                    "baselines.",
        task="tasks.mtp:train_mtp_rl_task",
        params=("policy", "mtp_rl", "mtp.ce_weights", "mtp.num_depths", "prompts.system_prompt", "label"),
        code=(*TASK_CODE, *BENCHMARK_CODE, "models/common",
              "models/engine", "models/labeling", "models/mtp", "tasks/mtp.py"),
        inputs=("${paths.policy_dir}", "${paths.prompts_dir}", "${paths.mtp_dir}", "${paths.scores}"),
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


class RecordingConfig:
    """A transparent stand-in for the config (or one of its sections) that records every key read through it.

    Reading a field gives its value, or another recorder for a nested section, and records the dotted key
    under its params.yaml name (``cfg.medusa_benchmark.num_prompts`` → ``medusa_benchmark.num_prompts``,
    ``cfg.validate_`` → ``validate``). Anything else taken from a section (``model_copy``, ``model_dump``, a
    property, comparing or printing it) may read every field, so it records the whole section. On the config
    itself, ``path()`` and the fields that are not params (``root``) record nothing: they only locate files.
    ``__class__`` is the wrapped object's class, so ``isinstance`` and code reading ``obj.__class__.model_fields``
    see the real thing.
    """

    __slots__ = ("_target", "_key", "_reads")
    _UNRECORDED_ON_CONFIG = frozenset({"path"})

    def __init__(self, target: BaseModel, reads: set[str] | None = None, key: str = "") -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_reads", set() if reads is None else reads)

    @property
    def reads(self) -> set[str]:
        """Every dotted key read so far (shared by the config's recorder and its sections')."""
        return self._reads

    @property
    def __class__(self):  # noqa: D105 - see the class docstring
        return type(self._target)

    def _join(self, name: str) -> str:
        return f"{self._key}.{name}" if self._key else name

    def _record_whole(self) -> None:
        target = self._target
        if self._key:
            self._reads.add(self._key)
        else:
            self._reads.update(f.alias or name for name, f in type(target).model_fields.items() if not f.exclude)

    def __getattr__(self, name: str) -> Any:
        target = self._target
        fields = type(target).model_fields
        value = getattr(target, name)
        if name in fields:
            if fields[name].exclude:
                return value
            key = self._join(fields[name].alias or name)
            if isinstance(value, BaseModel):
                return RecordingConfig(value, self._reads, key)
            self._reads.add(key)
            return value
        if not (self._key == "" and name in self._UNRECORDED_ON_CONFIG):
            self._record_whole()
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the config is read-only inside a stage (tried to set {self._join(name)})")

    def __eq__(self, other: object) -> bool:
        self._record_whole()
        return self._target == (other._target if isinstance(other, RecordingConfig) else other)

    __hash__ = None

    def __iter__(self):
        self._record_whole()
        return iter(self._target)

    def __repr__(self) -> str:
        self._record_whole()
        return repr(self._target)


def _covered(key: str, declared: Iterable[str]) -> bool:
    """A declared section covers its keys (``medusa`` covers ``medusa.x``); a declared key covers only itself."""
    return any(key == entry or key.startswith(entry + ".") for entry in declared)


def undeclared_reads(stage: Stage, reads: Iterable[str]) -> list[str]:
    """The config reads ``stage`` does not declare: keys outside its params, ``paths`` entries outside its
    inputs and outputs."""
    located = {path_name(expression) for expression in (*stage.inputs, *stage.outputs)} | set(ALWAYS_ALLOWED_PATHS)
    undeclared = []
    for key in sorted(set(reads)):
        section, _, rest = key.partition(".")
        if section == "paths":
            if rest.split(".")[0] not in located:
                undeclared.append(key)
        elif not _covered(key, stage.params):
            undeclared.append(key)
    return undeclared


PROJECT_PACKAGES = ("foresight", "models", "tasks")
"""Packages whose modules a stage must declare as code."""

ORCHESTRATION_MODULES = ("foresight.tracking", "foresight.stages", "foresight.cli", "foresight.memory")
"""Modules that run every stage, not part of any stage's work (with the ``flows`` package)."""


def undeclared_modules(stage: Stage, modules: Mapping[str, Any], root: Path) -> list[str]:
    """The project modules in ``modules`` (e.g. ``sys.modules``) whose files lie outside ``stage``'s code.

    A package's ``__init__`` counts as declared when declared code lies inside the package: importing a
    module imports its parent packages.
    """
    declared = [(root / entry).resolve() for entry in stage.code]
    undeclared = []
    for name, module in sorted(modules.items()):
        if name.split(".")[0] not in PROJECT_PACKAGES or name in ORCHESTRATION_MODULES:
            continue
        file = getattr(module, "__file__", None)
        if file is None:
            continue
        path = Path(file).resolve()
        if any(path == entry or entry in path.parents for entry in declared):
            continue
        if path.name == "__init__.py" and any(path.parent in entry.parents for entry in declared):
            continue
        undeclared.append(name)
    return undeclared
