"""The stage table (foresight/stages.py): dvc.yaml, flows and deployments follow from it, and the checks that hold
every stage to its declarations reject what a stage reads without declaring it.

``tests/test_dvc_pipeline.py`` runs every real stage with both checks on; here the recorder and the checks
are tested on their own, with negative controls.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from foresight.config import Config, PathsConfig, PolicyConfig, component, load_config, parse_config
from foresight.stages import (
    STAGES,
    RecordingConfig,
    Stage,
    _outermost,
    path_name,
    render_dvc_yaml,
    sync_dvc_yaml,
    undeclared_files,
    undeclared_modules,
    undeclared_reads,
)

REPO = Path(__file__).resolve().parent.parent


def test_committed_dvc_yaml_is_the_rendered_stage_table():
    assert (REPO / "dvc.yaml").read_text() == render_dvc_yaml(load_config(REPO / "params.yaml")), \
        "run: foresight dvc-yaml > dvc.yaml"
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert list(stages) == [stage.name for stage in STAGES]
    # cached, not persist: DVC's run cache restores a stage it has run before (tests/test_dvc_pipeline.py)
    assert stages["train_reward"]["outs"] == ["${paths.reward_dir}/base"]
    assert stages["train_reward"]["metrics"] == ["${paths.metrics_dir}/train_reward.json"]
    assert stages["train_reward"]["plots"] == [{"${paths.metrics_dir}/curves/train_reward": {"x": "step", "y": "value"}}]
    assert "plots" not in stages["generate"]


def test_declarations_name_real_things():
    """Every path expression names a ``paths`` entry, every code path exists, every param is a config key,
    every task resolves."""
    import importlib

    defaults = parse_config({}).model_dump(by_alias=True)
    for stage in STAGES:
        for expression in (*stage.inputs, *stage.outputs, *stage.task_kwargs.values()):
            if expression.startswith("${"):
                assert path_name(expression) in PathsConfig.model_fields, (stage.name, expression)
        for entry in stage.code:
            assert (REPO / entry).exists(), (stage.name, entry)
        for param in stage.params:
            value = defaults
            for part in param.split("."):
                assert isinstance(value, dict) and part in value, (stage.name, param)
                value = value[part]
        module, _, name = stage.task.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), stage.task


def test_every_stage_has_a_flow_and_a_deployment_found_by_entrypoint():
    """Each stage's flow is what DVC runs (``python -m flows.stages STAGE``); each stage's deployment is the
    pipeline flow with the stage as its DVC target, so a run triggered from the UI goes through ``dvc repro``."""
    from prefect.flows import load_flow_from_entrypoint

    import flows.stages
    from flows.serve import deployments

    by_name = {d.name: d for d in deployments(REPO / "params.yaml")}
    assert list(by_name) == ["pipeline", *(stage.flow_name for stage in STAGES)]
    assert by_name["pipeline"].parameters == {"params_path": str(REPO / "params.yaml")}
    for stage in STAGES:
        stage_flow = flows.stages.STAGE_FLOWS[stage.name]
        assert getattr(flows.stages, f"{stage.name}_flow") is stage_flow
        assert (stage_flow.name, stage_flow.description) == (stage.flow_name, stage.description)
        deployment = by_name[stage.flow_name]
        assert deployment.description.startswith(stage.description)
        assert deployment.parameters == {"params_path": str(REPO / "params.yaml"), "targets": [stage.name],
                                         "isolated": True}
        assert deployment.entrypoint.endswith("flows/pipeline.py:pipeline_flow"), deployment.entrypoint
    loaded = load_flow_from_entrypoint(f"{REPO / 'flows/stages.py'}:train_reward_dpo_flow")
    assert loaded.name == "train-reward-dpo"


def test_recorder_records_nested_reads_under_their_params_names():
    cfg = parse_config({"medusa_benchmark": {"num_prompts": 3}})
    recording = RecordingConfig(cfg)
    assert recording.medusa_benchmark.num_prompts == 3
    assert recording.prompts.arithmetic.max_number == 10
    assert recording.validate_.min_pairs == 1  # the field validate_ is params.yaml's validate
    assert recording.path(recording.paths.samples) == cfg.path(cfg.paths.samples) and recording.root == cfg.root
    assert recording.reads == {"medusa_benchmark.num_prompts", "prompts.arithmetic.max_number", "validate.min_pairs",
                               "paths.samples"}


def test_recorder_is_transparent_and_a_method_call_reads_the_whole_section():
    recording = RecordingConfig(parse_config({}))
    policy = recording.policy
    assert isinstance(recording, Config) and isinstance(policy, PolicyConfig)
    assert recording.reads == set()  # taking a section reads nothing yet

    @dataclasses.dataclass(frozen=True)
    class Placement:
        dtype: str
        device: str
        threads: int = 1

    assert component(Placement, policy) == Placement(dtype="auto", device="auto")
    assert recording.reads == {"policy.dtype", "policy.device"}
    deeper = recording.sla.model_copy(update={"depth": 3})
    assert deeper.depth == 3 and "sla" in recording.reads
    recording.mtp.model_dump()
    assert "mtp" in recording.reads
    with pytest.raises(AttributeError, match="read-only"):
        recording.generate.seed = 1


def test_undeclared_reads_are_named_and_declared_ones_pass():
    stage = Stage(name="s", description="d", task="m:f", params=("medusa", "prompts.system_prompt"), code=(),
                  inputs=("${paths.prompts_dir}",), outputs=("${paths.medusa_dir}/supervised",))
    declared = {"medusa.num_heads", "prompts.system_prompt", "paths.prompts_dir", "paths.medusa_dir",
                "paths.metrics_dir"}
    assert undeclared_reads(stage, declared) == []
    # negative controls: a key beside a declared one, a whole section of a declared key, an undeclared path
    assert undeclared_reads(stage, declared | {"prompts.seed", "policy", "paths.samples"}) == [
        "paths.samples", "policy", "prompts.seed"]


def test_undeclared_modules_are_named():
    root = REPO
    stage = Stage(name="s", description="d", task="m:f", params=(), code=("models/medusa", "tasks/medusa.py"),
                  outputs=("${paths.medusa_dir}",))

    def module(path: str) -> SimpleNamespace:
        return SimpleNamespace(__file__=str(root / path))

    loaded = {"models": module("models/__init__.py"), "models.medusa": module("models/medusa/__init__.py"),
              "models.medusa.heads": module("models/medusa/heads.py"), "tasks": module("tasks/__init__.py"),
              "tasks.medusa": module("tasks/medusa.py"), "foresight.tracking": module("foresight/tracking.py"),
              "flows.stages": module("flows/stages.py"), "torch": module(".venv/torch/__init__.py")}
    assert undeclared_modules(stage, loaded, root) == []
    # negative control: a module outside the declared code, and its package (no declared code inside it)
    loaded |= {"models.coral": module("models/coral/__init__.py"),
               "models.coral.training": module("models/coral/training.py")}
    assert undeclared_modules(stage, loaded, root) == ["models.coral", "models.coral.training"]


@task(cache_policy=NO_CACHE)  # as every stage's task: a cache key would hash (read) the whole config
def _read_seed_and_pairs(cfg):
    from tasks.data import StageResult

    return StageResult(metrics={"seed": cfg.generate.seed, "pairs": str(cfg.path(cfg.paths.pairs))})


def test_run_stage_fails_a_task_that_reads_undeclared_keys(tmp_path, prefect_server):
    """The real ``run_stage`` hands its task the recorder (through Prefect) and fails the stage on an undeclared
    read, before it writes the metrics file; declared, the same task passes."""
    from flows.stages import UndeclaredReadError, run_stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                   "experiment": "test"}}))
    undeclared = Stage(name="probe", description="d", task=f"{__name__}:_read_seed_and_pairs", params=(),
                       code=(), outputs=("${paths.samples}",))
    declared = dataclasses.replace(undeclared, params=("generate.seed",), inputs=("${paths.pairs}",))

    @flow
    def run_undeclared() -> dict:
        return run_stage(undeclared, str(params), None, None)

    @flow
    def run_declared() -> dict:
        return run_stage(declared, str(params), None, None)

    with pytest.raises(UndeclaredReadError, match=r"stage probe read .*config keys generate\.seed, paths\.pairs \("):
        run_undeclared()
    assert not (tmp_path / "data/metrics/probe.json").exists()
    assert run_declared()["seed"] == 0
    assert (tmp_path / "data/metrics/probe.json").is_file()


def test_stage_table_shows_the_headline_metrics_a_stage_wrote(tmp_path):
    """A headline metric the stage did not write (an optional part switched off, such as MTP's depth ablation) is
    left out of the pipeline's summary row rather than shown as None."""
    import json

    from flows.pipeline import stage_metrics, stage_table
    from flows.stages import metrics_path

    cfg = parse_config({}, root=tmp_path)
    path = metrics_path(cfg, "train_mtp")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"stage_seconds": 74.12, "held_out_expected_tau": 1.38371,
                                "held_out_top1_depth_1": 0.277}))
    (row,) = [r for r in stage_table(stage_metrics(cfg), ["train_mtp"], set()) if r["stage"] == "train_mtp"]
    assert row == {"stage": "train_mtp", "status": "ran", "seconds": 74.1, "held_out_expected_tau": 1.384,
                   "held_out_top1_depth_1": 0.277}


def _deps(text: str, stage: str) -> list[str]:
    return yaml.safe_load(text)["stages"][stage]["deps"]


def test_local_files_the_params_name_are_deps_of_the_stages_that_read_them(tmp_path):
    """A prompt file (in the repository: relative), a benchmark prompt file (outside: absolute) and a local
    policy folder are deps of exactly the stages that read them; a hub id, an unset file and a missing path are
    not (DVC would fail on a missing dep; the stage names the missing file itself)."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    outside = tmp_path.parent / f"{tmp_path.name}-extra.jsonl"
    outside.write_text('{"prompt": "hello"}\n')
    (tmp_path / "policy").mkdir()
    cfg = parse_config({"policy": {"model": "policy"},
                        "prompts": {"source": "file", "file": {"path": "prompts.jsonl"}},
                        "medusa_benchmark": {"prompt_files": [{"path": str(outside)}, {"path": "gone.jsonl"}]},
                        "label": {"labeler": "armorm", "model": "RLHFlow/ArmoRM-Llama3-8B-v0.1"}}, root=tmp_path)
    text = render_dvc_yaml(cfg)
    reading = {stage.name: set(_deps(text, stage.name)) - set(stage.inputs) - set(_outermost(stage.code))
               for stage in STAGES}
    assert {name: files for name, files in reading.items() if files} == {
        "prepare_policy": {"policy"},
        "prepare_prompts": {"prompts.jsonl"},
        "train_medusa": {"prompts.jsonl"},
        "benchmark_medusa": {str(outside)},
    }
    assert render_dvc_yaml(parse_config({}, root=tmp_path)) == render_dvc_yaml(parse_config({}, root=REPO)), \
        "the default params name no local file: dvc.yaml does not depend on where the checkout is"


def test_dvc_yaml_follows_the_params_and_a_stage_refuses_a_file_it_does_not_list(tmp_path):
    """``sync_dvc_yaml`` (what foresight run / pipeline call first) rewrites dvc.yaml when the params name another
    file and reports the stages it changed; until then ``undeclared_files`` names the file a stage would read
    unseen by DVC (a stage run by plain ``dvc repro`` fails on it)."""
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "dvc.yaml").write_text(render_dvc_yaml(parse_config({}, root=tmp_path)))
    cfg = parse_config({"prompts": {"source": "file", "file": {"path": "a.jsonl"}}}, root=tmp_path)
    prepare_prompts = next(stage for stage in STAGES if stage.name == "prepare_prompts")
    assert undeclared_files(prepare_prompts, cfg) == ["a.jsonl"]
    assert sync_dvc_yaml(cfg) == ["prepare_prompts", "train_medusa"]
    assert "a.jsonl" in _deps((tmp_path / "dvc.yaml").read_text(), "prepare_prompts")
    assert undeclared_files(prepare_prompts, cfg) == []
    assert sync_dvc_yaml(cfg) == [], "an up-to-date dvc.yaml is left alone"
