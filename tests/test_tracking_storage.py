"""MLflow runs in a temporary store; atomic writes never leave half-written outputs."""

import json
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from foresight.config import parse_config
from foresight.storage import atomic_path, read_table, write_json, write_table
from foresight.tracking import (
    EXPERIMENT_KIND,
    HEADLINE_TABLE,
    PARENT_RUN_ENV,
    experiment_url,
    flatten,
    interval_table,
    log_stage_outputs,
    pipeline_run,
    stage_run,
)


def test_parent_and_nested_stage_runs(tmp_path, monkeypatch):
    cfg = parse_config({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "t"}}, root=tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.html").write_text("<html></html>")
    table = pd.DataFrame({"a": [1, 2], "ok": pd.array([True, None], dtype="boolean"), "x": [0.5, float("nan")]})
    with pipeline_run(cfg) as parent:
        monkeypatch.setenv(PARENT_RUN_ENV, parent)  # how dvc-run stage processes learn their parent
        with stage_run(cfg, "generate", ["generate"]) as child:
            log_stage_outputs(cfg, {"num_samples": 10, "tokens_per_s": 99.5, "flag": True, "win_rate": 0.6,
                                    "win_rate_low": 0.5, "win_rate_high": 0.7, "accuracy": 0.4,
                                    "accuracy_low": 0.3, "accuracy_high": 0.45}, {"samples": table},
                              {"datadocs": docs}, headline=("num_samples", "win_rate"))
            # a curve named like a metric would overwrite it with its last step in MLflow: refused, nothing logged
            with pytest.raises(ValueError, match=r"\['tokens_per_s'\] are both metrics and per-step curves"):
                log_stage_outputs(cfg, {"tokens_per_s": 99.5}, {}, {}, {"tokens_per_s": [1.0, 2.0]})
    monkeypatch.delenv(PARENT_RUN_ENV)
    with stage_run(cfg, "label", ["label"]) as standalone:
        pass

    client = mlflow.tracking.MlflowClient(cfg.mlflow_uri())
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["foresight.stage"] == "generate"
    # the flat metrics stay (the runs table sorts and compares runs by them) ...
    assert run.data.metrics == {"num_samples": 10.0, "tokens_per_s": 99.5, "win_rate": 0.6, "win_rate_low": 0.5,
                                "win_rate_high": 0.7, "accuracy": 0.4, "accuracy_low": 0.3, "accuracy_high": 0.45}
    # ... and each interval is one row of the run's table: the headline first, then every other interval
    mlflow.set_tracking_uri(cfg.mlflow_uri())
    rows = mlflow.load_table(HEADLINE_TABLE, run_ids=[child]).to_dict("records")
    assert [(r["stage"], r["metric"], r["figure"]) for r in rows] == [
        ("generate", "num_samples", "10"), ("generate", "win_rate", "0.6 [0.5, 0.7]"),
        ("generate", "accuracy", "0.4 [0.3, 0.45]")]
    assert (rows[1]["low"], rows[1]["high"], rows[1]["level"]) == pytest.approx((0.5, 0.7, 0.95))
    assert pd.isna(rows[0]["low"]) and pd.isna(rows[0]["level"])
    # the experiment opens on its runs: tagged as a model-training one, and so linked
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND[0]] == "custom_model_development"
    assert experiment_url(cfg, "http://h:5000/") == (
        f"http://h:5000/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning")
    assert run.data.params["generate.num_samples"] == str(cfg.generate.num_samples)
    artifacts = {a.path for a in client.list_artifacts(child)} | {a.path for a in client.list_artifacts(child, "tables")}
    assert {"tables/samples.json", "datadocs"} <= artifacts
    assert client.get_run(parent).data.params["label.labeler"] == "verifiable"
    assert "mlflow.parentRunId" not in client.get_run(standalone).data.tags
    assert client.get_run(parent).info.status == "FINISHED"
    # artifacts live beside the params file, whatever the working folder
    assert client.get_run(child).info.artifact_uri.startswith((tmp_path / "mlruns").resolve().as_uri())


def test_interval_table_rows_are_the_measured_figures_with_their_intervals():
    """The parent run's table: one row per stage's headline figure it measured as a number, with its interval where
    it has one."""
    table = interval_table({"a": {"x": 1.0, "x_low": 0.5, "x_high": 1.5, "n": 3, "flag": True},
                            "b": {"y": float("nan")}}, {"a": ("x", "n", "flag", "missing"), "b": ("y",)})
    assert table[["stage", "metric", "figure"]].values.tolist() == [["a", "x", "1 [0.5, 1.5]"], ["a", "n", "3"]]
    assert table["level"].tolist()[0] == 0.95 and pd.isna(table["level"].tolist()[1])


def test_live_curves_number_points_by_step_across_loops_and_after_a_resume(tmp_path, monkeypatch):
    """A loop resumed at step 3 leaves steps 1–2 empty (NaN: the killed run holds them); a loop that counts from 1
    again is the block's next one, its steps after the last one's; a key ``names`` maps to None is no curve."""
    from foresight.tracking import STAGE_RUN_ENV, LiveCurves

    monkeypatch.delenv(STAGE_RUN_ENV, raising=False)  # no stage run: the points are only kept
    live = LiveCurves(parse_config({}, root=tmp_path), {"loss": "fit.loss"}.get)
    for values, step in (({"loss": 0.5, "other": 1.0}, 3), ({"loss": 0.4}, 4), ({"loss": 0.3}, 1), ({"loss": 0.2}, 2)):
        live(values, step)
    assert list(live.curves) == ["fit.loss"]
    assert live.curves["fit.loss"][2:] == [0.5, 0.4, 0.3, 0.2] and all(v != v for v in live.curves["fit.loss"][:2])


def test_training_curves_reach_the_stage_run_while_it_trains(tmp_path):
    """A training loop's steps are in the stage's run while it still trains, each at its own step and time; the
    end-of-stage logging leaves them alone and logs only the curves that were not live."""
    import time
    from functools import partial

    import torch
    from accelerate import Accelerator
    from torch import nn

    from models.common.training import train
    from tasks.common import live_curves

    cfg = parse_config({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "t"}}, root=tmp_path)
    client = mlflow.MlflowClient(cfg.mlflow_uri())
    data = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
    model = nn.Linear(4, 1)

    def step(model, batch):
        time.sleep(0.005)  # a step takes time: the points' timestamps tell when each step ended
        x, y = batch
        loss = (model(x) - y).pow(2).mean()
        return loss, {"loss": loss.detach()}

    seen_in_mlflow = []
    with stage_run(cfg, "train_medusa", ["tracking"]) as run_id:
        with live_curves(cfg, {"loss": "fit.loss", "learning_rate": "fit.learning_rate"}.get) as live:
            def on_step(step_number, num_steps, stats):
                live.wait()  # what MLflow holds while the loop is still at this step
                seen_in_mlflow.append(len(client.get_metric_history(run_id, "fit.loss")))

            _, history = train(model, data, step, model.parameters(), partial(torch.optim.SGD, lr=0.1),
                               accelerator=Accelerator(cpu=True), epochs=2, batch_size=4, seed=0, on_step=on_step)
            # a second loop in the block (COrAL's stage 2): its steps continue the first one's curves
            _, second = train(model, data, step, model.parameters(), partial(torch.optim.SGD, lr=0.05),
                              accelerator=Accelerator(cpu=True), epochs=1, batch_size=6, seed=0)
        curves = {key: history[key] + second[key] for key in ("loss", "learning_rate")}
        log_stage_outputs(cfg, {"final_loss": history["loss"][-1]}, {}, {},
                          {"fit.loss": curves["loss"], "fit.learning_rate": curves["learning_rate"],
                           "held_out.curve": [0.25, float("nan"), 0.5]})
    assert seen_in_mlflow == [1, 2, 3, 4, 5, 6]
    assert live.curves == {"fit.loss": curves["loss"], "fit.learning_rate": curves["learning_rate"]}
    points = client.get_metric_history(run_id, "fit.loss")
    assert [(p.step, p.value) for p in points] == [(i + 1, v) for i, v in enumerate(curves["loss"])]  # once each
    stamps = [p.timestamp for p in points]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)  # one time per step, not one for all
    assert [p.step for p in client.get_metric_history(run_id, "fit.learning_rate")] == list(range(1, 9))
    # a curve no loop logged live arrives at the end, NaN steps left out
    assert [(p.step, p.value) for p in client.get_metric_history(run_id, "held_out.curve")] == [(1, 0.25), (3, 0.5)]

    # an experiment made before the kind tag existed gets it; one whose kind a user chose keeps it
    old = mlflow.create_experiment("old", artifact_location=(tmp_path / "mlruns").as_uri())
    chosen = mlflow.create_experiment("chosen", artifact_location=(tmp_path / "mlruns").as_uri(),
                                      tags={EXPERIMENT_KIND[0]: "genai_development"})
    for name in ("old", "chosen"):
        with stage_run(cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"experiment": name})}),
                       "label", ["label"]):
            pass
    assert client.get_experiment(old).tags[EXPERIMENT_KIND[0]] == "custom_model_development"
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND[0]] == "genai_development"


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
