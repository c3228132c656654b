"""params.yaml validation: errors name the key and what is allowed."""

import re
from pathlib import Path

import pytest
import yaml

from foresight.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent


def test_repo_params_file_is_valid():
    cfg = load_config(REPO / "params.yaml")
    assert cfg.policy.model == "smollm2-135m-instruct"
    assert cfg.generate.num_samples == 4 and cfg.generate.temperature == 0.8
    assert cfg.path(cfg.paths.samples) == REPO / "data/samples/samples.parquet"
    # bf16 where the hardware has it (models.engine.policy.resolve_dtype), the code's default as well
    assert cfg.policy.dtype == "auto" == parse_config({}).policy.dtype


def test_defaults_parse_from_empty():
    cfg = parse_config({})
    assert cfg.prompts.source == "arithmetic" and cfg.label.labeler == "verifiable"


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"generate": {"num_samples": 0}}, ["generate.num_samples", "greater than or equal to 1"]),
        ({"generate": {"temperature": "hot"}}, ["generate.temperature", "'hot'"]),
        ({"label": {"labeler": "gpt4"}}, ["label.labeler", "'verifiable', 'armorm' or 'hf-classifier'", "'gpt4'"]),
        ({"generate": {"num_sample": 5}}, ["generate.num_sample: unknown key", "allowed keys here are", "num_samples"]),
        ({"polcy": {}}, ["polcy: unknown key", "policy"]),
        ({"prompts": {"arithmetic": {"operations": ["/"]}}}, ["prompts.arithmetic.operations.0", "'+', '-' or '*'"]),
        ({"prompts": {"source": "file"}}, ["prompts", "'file' section is missing"]),
        ({"label": {"labeler": "armorm"}}, ["labeler 'armorm' needs 'model'"]),
        ({"policy": {"dtype": "int4"}}, ["policy.dtype", "'float32'"]),
        ({"medusa_benchmark": {"tree": [[0, 0, 0]]}, "medusa": {"num_heads": 2}},
         ["medusa_benchmark.tree is 3 deep but medusa.num_heads is 2"]),
        ({"medusa_benchmark": {"tree": [[0], [1, -1]]}}, ["medusa_benchmark.tree must be", "non-negative"]),
        ({"medusa_benchmark": {"tree": "bushy"}}, ["medusa_benchmark.tree", "'auto'"]),
        ({"rlmedusa": {"inits": []}}, ["rlmedusa.inits", "at least 1"]),
    ],
)
def test_bad_values_fail_naming_the_key(params, expected):
    with pytest.raises(ConfigError) as err:
        parse_config(params)
    for fragment in expected:
        assert fragment in str(err.value)


def test_overrides_and_file_errors(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"generate": {"num_samples": 2}}))
    cfg = load_config(path, {"generate.seed": 7, "prompts.arithmetic.max_number": 20})
    assert (cfg.generate.num_samples, cfg.generate.seed, cfg.prompts.arithmetic.max_number) == (2, 7, 20)
    assert cfg.root == tmp_path.resolve()

    with pytest.raises(ConfigError, match="params file not found"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("generate: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(path)


def test_relative_sqlite_uri_resolves_against_params_folder(tmp_path):
    cfg = parse_config({"tracking": {"mlflow_uri": "sqlite:///runs/mlflow.db"}}, root=tmp_path)
    assert cfg.mlflow_uri() == f"sqlite:///{tmp_path.resolve()}/runs/mlflow.db"
    cfg = parse_config({"tracking": {"mlflow_uri": "sqlite:////abs/mlflow.db"}}, root=tmp_path)
    assert cfg.mlflow_uri() == "sqlite:////abs/mlflow.db"


def test_in_a_dvc_experiment_the_store_stays_in_the_repository_it_came_from(tmp_path, monkeypatch):
    """``dvc exp run --temp`` runs the stages in a temporary copy of the repository (the working folder) and names
    the original in ``DVC_ROOT``: a relative store resolves there, so every experiment's runs land in one store."""
    executor, origin = tmp_path / "exps" / "tmp123", tmp_path / "repo"
    executor.mkdir(parents=True)
    monkeypatch.chdir(executor)
    cfg = parse_config({}, root=Path("."))
    assert cfg.mlflow_uri() == f"sqlite:///{executor.resolve()}/mlflow.db"  # a plain `dvc repro`: here
    monkeypatch.setenv("DVC_ROOT", str(origin))
    assert cfg.mlflow_uri() == f"sqlite:///{executor.resolve()}/mlflow.db"  # DVC_ROOT alone: any stage run
    monkeypatch.setenv("DVC_EXP_NAME", "tidy-lark")
    assert cfg.mlflow_uri() == f"sqlite:///{origin.resolve()}/mlflow.db"
    assert parse_config({}, root=Path("sub")).tracking_root == origin / "sub"


def test_a_bare_no_that_yaml_reads_as_false_is_no(tmp_path):
    """``dvc exp run -S`` rewrites params.yaml, dropping the quotes of ``mixed_precision: "no"``; YAML 1.1 then
    reads false."""
    path = tmp_path / "params.yaml"
    path.write_text("mtp_rl:\n  mixed_precision: no\ncoral:\n  mixed_precision: bf16\n")
    cfg = load_config(path)
    assert cfg.mtp_rl.mixed_precision == "no" and cfg.coral.mixed_precision == "bf16"
    with pytest.raises(ConfigError, match="mixed_precision"):
        parse_config({"mtp_rl": {"mixed_precision": True}})


def test_every_field_is_documented():
    from pydantic import BaseModel

    from foresight.config import Config

    def walk(model: type[BaseModel]):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg)

    walk(Config)


def test_study_profile_recipe_is_valid():
    """docs/study.md's `dvc exp run -S` recipe names existing keys and gives a valid config (it cannot drift)."""
    text = (REPO / "docs" / "study.md").read_text()
    recipe = text.split("```bash", 1)[1].split("```", 1)[0]
    overrides = dict(arg.strip("'").split("=", 1) for arg in re.findall(r"-S ('[^']+'|\S+)", recipe))
    assert len(overrides) >= 15 and "sla_benchmark.num_prompts" in overrides
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, value in overrides.items():  # as DVC writes them into params.yaml: YAML values at existing keys
        *sections, key = dotted.split(".")
        section = params
        for name in sections:
            section = section[name]
        assert key in section, f"{dotted} is not a key of params.yaml"
        section[key] = yaml.safe_load(value.replace(",", ", "))
    cfg = parse_config(params, REPO)
    assert cfg.sla_benchmark.num_prompts == 120 and cfg.mtp_rl.variants == ["vanilla", "mtp_rl", "mtp_rl_detached",
                                                                             "frozen_mtp"]
    assert cfg.mtp_rl.steps >= 30 and tuple(cfg.sla_benchmark.tuning_grid[-1]) == (3, 2, 10)
    from foresight.prompts import general_instructions

    assert cfg.distill.general_prompts <= len(general_instructions("train"))  # the general set can supply them
    assert cfg.medusa_benchmark.general_prompts <= len(general_instructions("eval"))


def test_committed_params_yaml_is_the_generated_one():
    """params.yaml is generated from the knobs' classes (one declaration per knob: type, default, range, docstring):
    a default changed in a class and not regenerated, or an edit of the file by hand, fails here."""
    from foresight.params import render_params_yaml

    assert (REPO / "params.yaml").read_text() == render_params_yaml(), "run: foresight params-yaml > params.yaml"


def test_every_component_config_is_reachable_from_params():
    """No silent fall-through: each component config that model code takes (a ``Knobs`` class in
    ``models/*/config.py``) is a params section or a base of one (so every field it has is a params key, and a
    section can never lack one), or the type of a section's field (``adaptation``, ``prompt_files``)."""
    import importlib
    import inspect

    from foresight.params import SECTIONS, section_class
    from models.common.config import Knobs

    sections = [section_class(name) for name in SECTIONS]
    reachable = {base for cls in sections for base in cls.__mro__}
    for cls in sections:  # nested sub-sections
        for field in cls.model_fields.values():
            for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
                for inner in (arg, *getattr(arg, "__args__", ())):
                    if isinstance(inner, type):
                        reachable.add(inner)
    components = {cls for path in (REPO / "models").glob("*/config.py")
                  for _, cls in inspect.getmembers(importlib.import_module(f"models.{path.parent.name}.config"),
                                                   inspect.isclass)
                  if issubclass(cls, Knobs) and cls is not Knobs}
    assert len(components) >= 15
    assert sorted(cls.__name__ for cls in components - reachable) == []
