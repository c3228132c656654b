"""The stage table (foresight/stages.py): dvc.yaml, flows and deployments follow from it, and the checks that hold
every stage to its declarations reject what a stage reads without declaring it.

``tests/test_dvc_pipeline.py`` runs every real stage with both checks on; here the recorder and the checks
are tested on their own, with negative controls.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from foresight.config import load_config, parse_config
from foresight.params import ConfigError, PathsConfig, UndeclaredKeyError, parse_params
from foresight.stages import (
    STAGES,
    _outermost,
    path_name,
    render_dvc_yaml,
    stage_modules,
    sync_dvc_yaml,
    undeclared_files,
    undeclared_modules,
)
from models.engine.config import PolicyConfig

REPO = Path(__file__).resolve().parent.parent
BATCHED_ENGINE_STAGES = {"benchmark_medusa", "train_mtp", "train_mtp_rl"}
"""The stages that import the batched speculative engine (models/engine/batched.py): the speculative benchmark
decodes batched, and the MTP module drafts batched (models/mtp/module.py); the Medusa training stages do not (their
task module holds no benchmark: tasks/speculative_benchmark.py)."""


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


def test_a_stage_config_holds_its_declared_sections_and_keys_and_nothing_else():
    """A declared section comes whole, a section named by dotted keys holds only those keys, ``paths`` only the
    entries the stage's inputs and outputs name; the rest fails where it is read, naming the key."""
    cfg = parse_params({"rlmedusa": {"beta": 0.3}, "medusa": {"num_heads": 2}},
                       keys=("policy", "rlmedusa.inits", "paths.samples"))
    assert cfg.policy.model == "smollm2-135m-instruct" and isinstance(cfg.policy, PolicyConfig)
    assert cfg.rlmedusa.inits == ["base", "supervised"]
    assert cfg.path(cfg.paths.samples) == cfg.root / "data/samples/samples.parquet"
    assert cfg.launch.num_processes == 1 and cfg.tracking.experiment == "foresight"  # the stage runner's
    with pytest.raises(UndeclaredKeyError, match=r"rlmedusa\.beta is not among this stage's params"):
        _ = cfg.rlmedusa.beta
    with pytest.raises(UndeclaredKeyError, match=r"section medusa is not among this stage's params"):
        _ = cfg.medusa
    with pytest.raises(UndeclaredKeyError, match=r"paths\.pairs is not among"):
        _ = cfg.paths.pairs


def test_a_stage_config_validates_its_own_sections_only():
    """A bad value in a section the stage does not read is that section's stages' business (``foresight check``
    and the pipeline validate the whole file first); in a section it reads, it is an error naming the key."""
    bad = {"medusa": {"num_heads": "many"}}
    assert parse_params(bad, keys=("policy",)).policy.dtype == "auto"
    with pytest.raises(ConfigError, match=r"medusa\.num_heads"):
        parse_params(bad, keys=("medusa.num_heads",))
    with pytest.raises(ConfigError, match=r"medusa\.heads: no such key"):
        parse_params({}, keys=("medusa.heads",))


def test_a_stage_process_imports_the_configs_of_its_sections_alone():
    """What makes a COrAL docstring edit leave the SLA stages alone: building an SLA stage's config imports no
    other method's config module."""
    import subprocess
    import sys

    probe = ("import sys; from foresight.params import parse_params; parse_params({}, keys=('sla', 'policy')); "
             "print(sorted(m for m in sys.modules if m.startswith('models.')))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    modules = eval(imported.stdout)  # noqa: S307 - our own probe's list literal
    assert "models.sla.config" in modules and "models.engine.config" in modules
    assert not [m for m in modules if m.split(".")[1] in ("coral", "medusa", "mtp")], modules


def test_undeclared_modules_are_named():
    root = REPO
    stage = next(s for s in STAGES if s.name == "train_medusa")

    def module(path: str) -> SimpleNamespace:
        return SimpleNamespace(__file__=str(root / path))

    loaded = {"models": module("models/__init__.py"), "models.medusa": module("models/medusa/__init__.py"),
              "models.medusa.heads": module("models/medusa/heads.py"), "tasks": module("tasks/__init__.py"),
              "tasks.medusa": module("tasks/medusa.py"), "foresight.tracking": module("foresight/tracking.py"),
              "flows.stages": module("flows/stages.py"), "torch": module(".venv/torch/__init__.py")}
    assert undeclared_modules(stage, loaded, root) == []
    # negative control: a module outside the stage's code (its package's empty __init__ holds nothing to track)
    loaded |= {"models.coral": module("models/coral/__init__.py"),
               "models.coral.training": module("models/coral/training.py")}
    assert undeclared_modules(stage, loaded, root) == ["models.coral.training"]


_IMPORT_PROBE = """
import importlib, json, os, sys
# Third-party libraries first, in the parent: they import no project module, and each forked child then starts from
# them already loaded (one start-up of torch, transformers, prefect and mlflow instead of one per stage).
for library in ("torch", "transformers", "accelerate", "datasets", "trl", "peft", "prefect", "mlflow", "pandas",
                "great_expectations"):
    importlib.import_module(library)
assert not [m for m in sys.modules if m.split(".")[0] in ("flows", "foresight", "models", "tasks")]
found = {}
for name in sys.argv[2:]:
    read, write = os.pipe()
    if os.fork() == 0:  # the child: a process of that stage, up to its task; it never returns to the loop
        try:
            os.close(read)
            import flows.stages
            from foresight.params import load_params
            from foresight.stages import STAGES, PROJECT_PACKAGES, _orchestration
            stage = next(s for s in STAGES if s.name == name)
            cfg = load_params(sys.argv[1], keys=stage.config_keys)
            importlib.import_module(stage.task.partition(":")[0])
            import foresight.memory  # the pre-flight check on GPUs
            modules = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT_PACKAGES and not _orchestration(m))
            os.write(write, json.dumps(modules).encode())
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        found[name] = json.loads(pipe.read())
    assert os.wait()[1] == 0, name
print(json.dumps(found))
"""


def test_each_stages_code_deps_are_the_modules_its_process_imports():
    """The DVC code deps of every stage (found by following the imports, :func:`foresight.stages.stage_modules`)
    against what a fresh process of that stage really imports before its task runs: no module missing (DVC would
    call a stale result up to date) and none extra (an edit would re-run a stage that does not use the file). Each
    stage's process is a fork of one that holds only the third-party libraries."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(REPO / "params.yaml"),
                          *(stage.name for stage in STAGES)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    for stage in STAGES:
        modules, declared = set(found[stage.name]), stage_modules(stage)
        assert modules - declared == set(), (stage.name, "imported but not deps")
        assert declared - modules == set(), (stage.name, "deps it does not import")


@task(cache_policy=NO_CACHE)  # as every stage's task
def _read_seed_and_pairs(cfg):
    from tasks.common import StageResult

    return StageResult(metrics={"seed": cfg.generate.seed, "pairs": str(cfg.path(cfg.paths.pairs))})


def test_run_stage_fails_a_task_that_reads_undeclared_keys(tmp_path, prefect_server):
    """The real ``run_stage`` hands its task (through Prefect) a config of the declared keys alone: an undeclared
    read fails the stage there, before it writes the metrics file; declared, the same task passes."""
    import dataclasses

    from flows.stages import run_stage
    from foresight.stages import Stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                   "experiment": "test"}}))
    undeclared = Stage(name="probe", description="d", task=f"{__name__}:_read_seed_and_pairs", params=(),
                       outputs=("${paths.samples}",))
    declared = dataclasses.replace(undeclared, params=("generate.seed",), inputs=("${paths.pairs}",))

    @flow
    def run_undeclared() -> dict:
        return run_stage(undeclared, str(params), None, None)

    @flow
    def run_declared() -> dict:
        return run_stage(declared, str(params), None, None)

    with pytest.raises(UndeclaredKeyError, match=r"section generate is not among this stage's params"):
        run_undeclared()
    assert not (tmp_path / "data/metrics/probe.json").exists()
    assert run_declared()["seed"] == 0
    assert (tmp_path / "data/metrics/probe.json").is_file()


def _stages_depending_on(file: str) -> set[str]:
    return {stage.name for stage in STAGES if file in stage.code}


def test_an_edit_re_runs_only_the_stages_that_use_the_file():
    """The issue's three edits: a COrAL config docstring, the label task, the batched engine."""
    assert _stages_depending_on("models/coral/config.py") == {"train_coral", "benchmark_coral"}
    assert _stages_depending_on("tasks/label.py") == {"label"}
    assert _stages_depending_on("models/engine/batched.py") == BATCHED_ENGINE_STAGES
    core = {"foresight/params.py", "models/common/config.py", "models/common/files.py"}
    assert all(core <= set(stage.code) for stage in STAGES)


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
        "distill": {"prompts.jsonl"},
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
    assert sync_dvc_yaml(cfg) == ["prepare_prompts", "distill"]
    assert "a.jsonl" in _deps((tmp_path / "dvc.yaml").read_text(), "prepare_prompts")
    assert undeclared_files(prepare_prompts, cfg) == []
    assert sync_dvc_yaml(cfg) == [], "an up-to-date dvc.yaml is left alone"


def test_readme_stage_table_and_dag_are_the_rendered_stage_table():
    """The README's DAG (one line per stage) and docs/guide.md's stage table come from the stage table (what each
    stage reads and writes, its text)."""
    from foresight.stages import (STAGE_DETAILS_BEGIN, STAGE_DETAILS_DOC, STAGE_DETAILS_END, STAGE_DOCS_BEGIN,
                                  STAGE_DOCS_END, render_stage_details, render_stage_docs, upstream)

    readme, details = (REPO / "README.md").read_text(), (REPO / STAGE_DETAILS_DOC).read_text()
    begin, end = readme.index(STAGE_DOCS_BEGIN), readme.index(STAGE_DOCS_END) + len(STAGE_DOCS_END)
    assert readme[begin:end] == render_stage_docs(), "run: foresight stage-docs"
    begin, end = details.index(STAGE_DETAILS_BEGIN), details.index(STAGE_DETAILS_END) + len(STAGE_DETAILS_END)
    assert details[begin:end] == render_stage_details(), "run: foresight stage-docs"
    assert all(stage.details and stage.output_files for stage in STAGES)
    by_name = {stage.name: stage for stage in STAGES}
    assert upstream(by_name["train_coral"]) == ["prepare_policy", "label", "distill"]
    assert "\n  prepare_policy & label & distill --> train_coral\n" in readme
    assert all(readme.count(f" --> {stage.name}\n") == 1 for stage in STAGES[1:])  # one line per stage
