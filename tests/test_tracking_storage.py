"""MLflow runs in a temporary store; atomic writes never leave half-written outputs."""

import json
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from foresight.config import parse_config
from foresight.storage import atomic_path, read_table, write_json, write_table
from foresight.tracking import PARENT_RUN_ENV, flatten, log_stage_outputs, pipeline_run, stage_run


def test_parent_and_nested_stage_runs(tmp_path, monkeypatch):
    cfg = parse_config({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "t"}}, root=tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.html").write_text("<html></html>")
    table = pd.DataFrame({"a": [1, 2], "ok": pd.array([True, None], dtype="boolean"), "x": [0.5, float("nan")]})
    with pipeline_run(cfg) as parent:
        monkeypatch.setenv(PARENT_RUN_ENV, parent)  # how dvc-run stage processes learn their parent
        with stage_run(cfg, "generate", ["generate"]) as child:
            log_stage_outputs(cfg, {"num_samples": 10, "tokens_per_s": 99.5, "flag": True}, {"samples": table},
                              {"datadocs": docs})
            # a curve named like a metric would overwrite it with its last step in MLflow: refused, nothing logged
            with pytest.raises(ValueError, match=r"\['tokens_per_s'\] are both metrics and per-step curves"):
                log_stage_outputs(cfg, {"tokens_per_s": 99.5}, {}, {}, {"tokens_per_s": [1.0, 2.0]})
    monkeypatch.delenv(PARENT_RUN_ENV)
    with stage_run(cfg, "label", ["label"]) as standalone:
        pass

    client = mlflow.tracking.MlflowClient(cfg.mlflow_uri())
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["foresight.stage"] == "generate"
    assert run.data.metrics == {"num_samples": 10.0, "tokens_per_s": 99.5}
    assert run.data.params["generate.num_samples"] == str(cfg.generate.num_samples)
    artifacts = {a.path for a in client.list_artifacts(child)} | {a.path for a in client.list_artifacts(child, "tables")}
    assert {"tables/samples.json", "datadocs"} <= artifacts
    assert client.get_run(parent).data.params["label.labeler"] == "verifiable"
    assert "mlflow.parentRunId" not in client.get_run(standalone).data.tags
    assert client.get_run(parent).info.status == "FINISHED"
    # artifacts live beside the params file, whatever the working folder
    assert client.get_run(child).info.artifact_uri.startswith((tmp_path / "mlruns").resolve().as_uri())


def test_an_interrupted_run_ends_killed_and_a_failed_one_failed(tmp_path):
    """Ctrl-C inside the pipeline's run or a stage's ends it KILLED, not FAILED (which a stage that failed is)."""
    cfg = parse_config({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "t"}}, root=tmp_path)
    ids = {}
    with pytest.raises(KeyboardInterrupt):
        with pipeline_run(cfg) as ids["pipeline"], stage_run(cfg, "generate", ["generate"], ids["pipeline"]) as ids[
                "interrupted stage"]:
            raise KeyboardInterrupt
    with pytest.raises(RuntimeError):
        with stage_run(cfg, "label", ["label"]) as ids["failed stage"]:
            raise RuntimeError("no reward model")
    client = mlflow.tracking.MlflowClient(cfg.mlflow_uri())
    assert {name: client.get_run(run_id).info.status for name, run_id in ids.items()} == {
        "pipeline": "KILLED", "interrupted stage": "KILLED", "failed stage": "FAILED"}


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": "x"}) == {"a.b": "1", "a.c.d": "None", "e": "x"}


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "out" / "table.parquet"
    write_table(pd.DataFrame({"a": [1]}), target)
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert read_table(target, "t")["a"].tolist() == [1]
    assert sorted(p.name for p in target.parent.iterdir()) == ["table.parquet"]  # no temporaries left


def test_atomic_folder_replace_and_formats(tmp_path):
    folder = tmp_path / "docs"
    for version in ("one", "two"):
        with atomic_path(folder) as tmp:
            tmp.mkdir()
            (tmp / "index.html").write_text(version)
    assert (folder / "index.html").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]
    df = pd.DataFrame({"a": [1, 2], "b": ["x", None]})
    for ext in ("jsonl", "csv", "parquet"):
        back = read_table(write_table(df, tmp_path / f"t.{ext}"), "t")
        assert back["a"].tolist() == [1, 2]
    write_json({"b": 1, "a": [1]}, tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": [1], "b": 1}
    with pytest.raises(FileNotFoundError, match="run the stage that produces it first"):
        read_table(tmp_path / "missing.parquet", "samples")


@pytest.mark.parametrize("large_files", ["manifest", "copy"])
def test_logged_folders_keep_large_files_in_dvc_and_name_them_in_a_manifest(tmp_path, monkeypatch, large_files):
    """A registered model and an attached folder: MLflow gets each folder's ``dvc-manifest.json`` (path, DVC hash,
    every file's size and md5) and the small files; a file over ``tracking.large_file_mb`` is only named there
    (``large_files: manifest``), never copied — or copied too under ``large_files: copy``."""
    import hashlib

    from foresight.tracking import MANIFEST, register_models

    monkeypatch.chdir(tmp_path)
    cfg = parse_config({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "t",
                                     "large_files": large_files, "large_file_mb": 0.01}}, root=tmp_path)
    model = tmp_path / "data" / "dpo"
    (model / "sub").mkdir(parents=True)
    weights = bytes(range(256)) * 80  # 20 kB: over the 10 kB limit
    (model / "model.safetensors").write_bytes(weights)
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "sub" / "tokenizer.json").write_text("{}")
    copied = large_files == "copy"
    with stage_run(cfg, "dpo", ["tracking"]) as run_id:
        versions = register_models(cfg, {"dpo-policy": model})
        log_stage_outputs(cfg, {}, {}, {"coral": model})
    mlflow.set_tracking_uri(cfg.mlflow_uri())
    for uri in (f"models:/t-dpo-policy/{versions['dpo-policy']}", f"runs:/{run_id}/coral"):
        fetched = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "fetched" / uri[:4])))
        manifest = json.loads((fetched / MANIFEST).read_text())
        assert manifest["path"] == "data/dpo" and manifest["nfiles"] == 3 and manifest["size"] == len(weights) + 20
        assert manifest["md5"].endswith(".dir")
        files = {f["relpath"]: f for f in manifest["files"]}
        assert files["model.safetensors"] == {"relpath": "model.safetensors", "size": len(weights),
                                              "md5": hashlib.md5(weights).hexdigest(), "copied": copied}
        assert files["sub/tokenizer.json"]["copied"] and files["config.json"]["copied"]
        assert (fetched / "config.json").read_text() == '{"hidden_size": 8}'
        assert (fetched / "sub" / "tokenizer.json").is_file()
        assert (fetched / "model.safetensors").is_file() == copied, uri
    stored = list((tmp_path / "mlruns").rglob("model.safetensors"))
    assert len(stored) == (2 if copied else 0), stored
