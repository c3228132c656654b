"""One Prefect flow per pipeline stage. DVC stages call these: ``python -m flows.stages <stage>``.

Every flow takes the same parameters, so the Prefect UI can trigger any of them:
``params_path`` (the params file), ``overrides`` (dotted keys on top of it, e.g.
``{"generate.num_samples": 3}``) and ``parent_run_id`` (the MLflow run to nest under; the pipeline
flow passes it through the environment instead, because DVC runs stages in their own processes).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from foresight.config import Config, load_config
from foresight.storage import read_table, write_json
from foresight.tracking import log_stage_outputs, stage_run
from tasks.sla import benchmark_sla_task
from tasks.coral import benchmark_coral_task, train_coral_task
from tasks.data import (
    StageResult,
    generate_task,
    label_task,
    prepare_policy_task,
    prepare_prompts_task,
    validate_task,
)
from tasks.sla import dpo_task
from tasks.medusa import benchmark_medusa_task, train_medusa_task, train_rlmedusa_task
from tasks.mtp import train_mtp_rl_task, train_mtp_task
from tasks.sla import train_reward_task


def metrics_path(cfg: Config, stage: str):
    """The stage's DVC metrics file."""
    return cfg.path(cfg.paths.metrics_dir) / f"{stage}.json"


def run_stage(stage: str, work: Callable[[Config], StageResult], sections: list[str],
              params_path: str, overrides: dict | None, parent_run_id: str | None) -> dict:
    """Load the config, run the stage's task inside its MLflow run, write its metrics, publish artifacts."""
    cfg = load_config(params_path, overrides)
    started = time.perf_counter()
    with stage_run(cfg, stage, sections, parent_run_id) as run_id:
        try:
            result = work(cfg)
        except Exception as err:
            results = getattr(err, "results", None)  # a failed GX suite carries its summary: keep it
            if results is not None:
                import mlflow

                mlflow.log_dict(results, "validation_summary.json")
                log_stage_outputs(cfg, {}, {}, {"datadocs": cfg.path(cfg.paths.reports_dir) / "datadocs"})
            raise
        result.metrics["stage_seconds"] = time.perf_counter() - started
        tables = {name: read_table(path, name) for name, path in result.tables.items()}
        log_stage_outputs(cfg, result.metrics, tables, result.artifacts, result.curves)
    write_json(result.metrics, metrics_path(cfg, stage))
    lines = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                      for k, v in sorted(result.metrics.items()))
    create_markdown_artifact(
        key=f"{stage.replace('_', '-')}-summary",
        markdown=f"# Stage `{stage}`\n\nMLflow run `{run_id}`\n\n| metric | value |\n|---|---|\n{lines}\n",
        description=f"Metrics of stage {stage}",
    )
    get_run_logger().info("stage %s done in %.1f s", stage, result.metrics["stage_seconds"])
    return result.metrics


@flow(name="prepare-policy", log_prints=True)
def prepare_policy_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                        parent_run_id: str | None = None) -> dict:
    """Resolve ``policy.model`` to local weights (converting the embedded GGUF once)."""
    return run_stage("prepare_policy", prepare_policy_task, ["policy"], params_path, overrides, parent_run_id)


@flow(name="prepare-prompts", log_prints=True)
def prepare_prompts_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                         parent_run_id: str | None = None) -> dict:
    """Read the prompt source; write the train / held-out splits."""
    return run_stage("prepare_prompts", prepare_prompts_task, ["prompts"], params_path, overrides, parent_run_id)


@flow(name="generate", log_prints=True)
def generate_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                  parent_run_id: str | None = None) -> dict:
    """Sample N responses per training prompt."""
    return run_stage("generate", generate_task, ["policy", "generate"], params_path, overrides, parent_run_id)


@flow(name="label", log_prints=True)
def label_flow(params_path: str = "params.yaml", overrides: dict | None = None,
               parent_run_id: str | None = None) -> dict:
    """Score every sample with the configured reward labeler."""
    return run_stage("label", label_task, ["label"], params_path, overrides, parent_run_id)


@flow(name="validate", log_prints=True)
def validate_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                  parent_run_id: str | None = None) -> dict:
    """Validate samples and scores with Great Expectations, build and validate preference pairs."""
    return run_stage("validate", validate_task, ["validate"], params_path, overrides, parent_run_id)


def _train_reward_on(policy_source: str) -> Callable[[Config], StageResult]:
    return lambda cfg: train_reward_task(cfg, policy_source, cfg.path(cfg.paths.reward_dir) / policy_source)


@flow(name="train-reward", log_prints=True)
def train_reward_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                      parent_run_id: str | None = None) -> dict:
    """Train the reward channel (and the adapter baselines) on the base policy with the BT loss; AuTRC."""
    return run_stage("train_reward", _train_reward_on("base"), ["reward"], params_path, overrides, parent_run_id)


@flow(name="dpo", log_prints=True)
def dpo_flow(params_path: str = "params.yaml", overrides: dict | None = None,
             parent_run_id: str | None = None) -> dict:
    """Fine-tune the policy with DPO on the preference pairs."""
    return run_stage("dpo", dpo_task, ["dpo"], params_path, overrides, parent_run_id)


@flow(name="train-reward-dpo", log_prints=True)
def train_reward_dpo_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                          parent_run_id: str | None = None) -> dict:
    """Train a reward channel on the DPO policy (the paper's "llama-DPO + SLA")."""
    return run_stage("train_reward_dpo", _train_reward_on("dpo"), ["reward"], params_path, overrides, parent_run_id)


@flow(name="benchmark-sla", log_prints=True)
def benchmark_sla_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                       parent_run_id: str | None = None) -> dict:
    """Compare greedy, sampling, beam and SLA decoding for the base and DPO policies (Table 1)."""
    return run_stage("benchmark_sla", benchmark_sla_task, ["sla", "sla_benchmark", "label"], params_path, overrides,
                     parent_run_id)


@flow(name="train-medusa", log_prints=True)
def train_medusa_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                      parent_run_id: str | None = None) -> dict:
    """Medusa-1: train K decoding heads on the frozen policy's own samples (self-distillation)."""
    return run_stage("train_medusa", train_medusa_task, ["medusa", "rlmedusa"], params_path, overrides, parent_run_id)


@flow(name="train-rlmedusa", log_prints=True)
def train_rlmedusa_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                        parent_run_id: str | None = None) -> dict:
    """RLMedusa: fit the token reward r(e, h), train the t + 2 head by policy gradient, compare with Medusa-1."""
    return run_stage("train_rlmedusa", train_rlmedusa_task, ["rlmedusa"], params_path, overrides, parent_run_id)


@flow(name="benchmark-medusa", log_prints=True)
def benchmark_medusa_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                          parent_run_id: str | None = None) -> dict:
    """Tree speculative decoding with Medusa / RLMedusa heads vs HF greedy and prompt lookup: τ, speedup."""
    return run_stage("benchmark_medusa", benchmark_medusa_task, ["medusa_benchmark"], params_path, overrides,
                     parent_run_id)


@flow(name="train-coral", log_prints=True)
def train_coral_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                     parent_run_id: str | None = None) -> dict:
    """COrAL: two-stage order-agnostic training with target-aware RoPE in the last layer."""
    return run_stage("train_coral", train_coral_task, ["coral"], params_path, overrides, parent_run_id)


@flow(name="benchmark-coral", log_prints=True)
def benchmark_coral_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                         parent_run_id: str | None = None) -> dict:
    """Sliding blockwise order-agnostic decoding vs next-token greedy: accuracy, speed, ablations (Table 1)."""
    return run_stage("benchmark_coral", benchmark_coral_task, ["coral_benchmark"], params_path, overrides,
                     parent_run_id)


@flow(name="train-mtp", log_prints=True)
def train_mtp_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                   parent_run_id: str | None = None) -> dict:
    """MTP equip: a shared-parameter multi-token-prediction module on the frozen policy, and its depth ablation."""
    return run_stage("train_mtp", train_mtp_task, ["mtp"], params_path, overrides, parent_run_id)


@flow(name="train-mtp-rl", log_prints=True)
def train_mtp_rl_flow(params_path: str = "params.yaml", overrides: dict | None = None,
                      parent_run_id: str | None = None) -> dict:
    """GRPO with MTP-drafted rollouts and the advantage-aware MTP loss (MTP-RL), against its baselines."""
    return run_stage("train_mtp_rl", train_mtp_rl_task, ["mtp_rl"], params_path, overrides, parent_run_id)


STAGE_FLOWS = {
    "prepare_policy": prepare_policy_flow,
    "prepare_prompts": prepare_prompts_flow,
    "generate": generate_flow,
    "label": label_flow,
    "validate": validate_flow,
    "train_reward": train_reward_flow,
    "dpo": dpo_flow,
    "train_reward_dpo": train_reward_dpo_flow,
    "benchmark_sla": benchmark_sla_flow,
    "train_medusa": train_medusa_flow,
    "train_rlmedusa": train_rlmedusa_flow,
    "benchmark_medusa": benchmark_medusa_flow,
    "train_coral": train_coral_flow,
    "benchmark_coral": benchmark_coral_flow,
    "train_mtp": train_mtp_flow,
    "train_mtp_rl": train_mtp_rl_flow,
}


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.stages STAGE [PARAMS_PATH]``: what each DVC stage runs."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in STAGE_FLOWS:
        sys.exit(f"usage: python -m flows.stages {{{','.join(STAGE_FLOWS)}}} [params.yaml]")
    try:
        STAGE_FLOWS[argv[0]](params_path=argv[1] if len(argv) > 1 else "params.yaml")
    except Exception as err:  # the traceback is in the Prefect log; end with the cause, for dvc's output
        sys.exit(f"ERROR: stage {argv[0]} failed: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
