"""``foresight``: the command line. ``--params FILE`` (default ``params.yaml``) goes anywhere on the line.

- ``foresight pipeline``: the whole pipeline on ``params.yaml`` (``dvc repro`` + tracking), then
  the results report (``foresight report``) and where to find the data, the runs, the Data Docs and the report.
- ``foresight run STAGE...``: those stages through ``dvc repro`` (with their stale ancestors), with tracking. With
  ``--params FILE`` other than the project's params.yaml (both commands): FILE's values that differ are set on
  params.yaml by DVC's experiment run (``dvc exp run --set-param``), which the stages then read.
- ``foresight serve``: deployments for every flow, triggerable from the Prefect UI.
- ``foresight deploy --work-pool POOL``: the same deployments on Prefect work pools (GPU stages on POOL).
- ``foresight ui``: the MLflow and Prefect UIs on loopback, until Ctrl-C.
- ``foresight report``: the results report (``data/reports/report.html``, one self-contained page, and
  ``report.md``) from the metrics on disk and the MLflow store; ``--readme`` also rewrites README.md's headline table.
- ``foresight export OUT_DIR``: the trained Medusa heads as vLLM Medusa drafts, one folder each, and the
  ``vllm serve`` line that loads each (``models/medusa/export.py``).
- ``foresight check``: validate ``params.yaml`` and print the resolved configuration.
- ``foresight dvc-yaml``: print ``dvc.yaml`` as the stage table (``foresight/stages.py``) declares it, with the
  local files the params name (a prompt file, a local model folder) as deps.
- ``foresight params-yaml``: print ``params.yaml`` as the knobs' classes declare it (every default, a comment each).
- ``foresight dvc-plots-template``: print the ``dvc plots show`` page template with vega inlined (``.dvc/config``
  names it, so the plots page renders offline; ``foresight/offline.py``).
- ``foresight stage-docs``: rewrite the README's stage DAG and docs/guide.md's stage details from the stage table.
- ``foresight plan``: each stage's estimated peak GPU memory against the GPUs, and the knob that makes a stage
  fit that does not, then each stage's disk footprint and the run's total against the free disk
  (``foresight/memory.py``); exit code 1 when a stage or the total does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from foresight.config import ConfigError, load_config


def _run_params(file: str) -> tuple[Path, dict]:
    """The params.yaml a run reproduces, and the values ``--params FILE`` sets on it (dotted keys).

    FILE is the run's params as it is when it is a DVC project's own params.yaml (beside its ``.dvc/``). Any other
    file is a study: its values that differ (:func:`foresight.params.study_overrides`, validated there) are set on
    the params.yaml of the DVC project of the current folder by DVC's experiment run (``dvc exp run --set-param``:
    the stages read params.yaml, so FILE's values must be there, and ``dvc.lock`` then records them)."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    from flows.pipeline import set_param_args
    from foresight.params import study_overrides

    file = Path(file).resolve()
    if file.name == "params.yaml" and (file.parent / Repo.DVC_DIR).is_dir():
        return file, {}
    try:
        params = Path(Repo.find_root()) / "params.yaml"
    except NotDvcRepoError as err:
        raise ConfigError(f"--params {file}: its values are set on the params.yaml of the DVC project this command "
                          f"runs in, and {err}") from None
    overrides = study_overrides(file, params)
    set_param_args(overrides)  # a value DVC's --set-param cannot carry is refused now, before anything runs
    return params, overrides


def _pipeline(args) -> int:
    from flows.pipeline import pipeline_flow
    from foresight.report import REPORT_HTML, REPORT_MD
    from foresight.stages import STAGES

    targets = getattr(args, "stages", [])
    unknown = sorted(set(targets) - {stage.name for stage in STAGES})
    if unknown:
        print(f"foresight run: no stage {', '.join(unknown)}; the stages: {', '.join(s.name for s in STAGES)}",
              file=sys.stderr)
        return 2
    params, overrides = _run_params(args.params)
    cfg = load_config(params, overrides)
    if overrides:
        print(f"foresight {args.command}: {params} with the values of {args.params} that differ (dvc exp run "
              f"--set-param): {', '.join(f'{key}={value!r}' for key, value in overrides.items())}")
    from prefect.exceptions import TerminationSignal

    from foresight.prefect_api import prefect_api

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    # the stages run in a session of their own (flows.stages.run_streaming): a closed terminal (SIGHUP) or a kill
    # (SIGTERM; inside a flow Prefect's own handler raises TerminationSignal) must stop them as Ctrl-C does rather
    # than end this process alone and leave them running
    signal.signal(signal.SIGHUP, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        with prefect_api():  # a temporary Prefect API outside the terminal's Ctrl-C, unless one is configured
            result = pipeline_flow(params_path=str(params), targets=targets, force=args.force, push=args.push,
                                   isolated=args.isolated, overrides=overrides)
    except (KeyboardInterrupt, TerminationSignal):  # SIGTERM in a flow: TerminationSignal. The flow runs are
        # marked crashed by now, the stage processes have ended
        print(f"\nforesight {args.command}: interrupted; the stages that finished keep their outputs (dvc status "
              "lists what is left); the same command goes on from there", file=sys.stderr)
        return 130
    print("\n" + "=" * 72)
    print(f"Foresight {'pipeline' if not targets else ' '.join(targets)} finished. Stages:")
    for row in result["stages"]:
        extra = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("stage", "status", "seconds"))
        print(f"  {row['stage']:<16} {row['status']:<11} {row['seconds']:>7} s  {extra}")
    verdicts = [row["verdict"] for row in result["claims"]]
    print(f"\nClaims: {verdicts.count('holds')} of {len(verdicts)} hold at this scale "
          f"(foresight claims, or {cfg.path(cfg.paths.reports_dir) / 'claims.md'})")
    print("\nWhere things are:")
    print(f"  data (DVC-tracked): {cfg.path(cfg.paths.pairs).parent.parent}  (dvc status, dvc metrics show)")
    print(f"  MLflow and Prefect: foresight ui  (parent run {result['mlflow_run_id']} in {cfg.mlflow_uri()})")
    print(f"  Data Docs (GX):     {cfg.path(cfg.paths.reports_dir) / 'datadocs' / 'index.html'}")
    print(f"  the report:         {cfg.path(cfg.paths.reports_dir) / REPORT_HTML}  (and {REPORT_MD} beside it)")
    return 0


def _export(args) -> int:
    """Export the trained drafters on disk in a serving engine's format: each set of Medusa heads as a vLLM Medusa
    draft folder (``models/medusa/export.py``; the MTP module has no engine format: docs/mtp.md)."""
    from models.engine.policy import policy_path
    from models.medusa.export import export_trained_heads
    from tasks.common import load_stage_policy

    cfg = load_config(args.params)
    policy = load_stage_policy(cfg, "base")  # the backbone the heads were trained on: its LM head is theirs
    written = export_trained_heads(cfg.path(cfg.paths.medusa_dir), policy.model.get_output_embeddings(), args.out_dir)
    target = policy_path(cfg.path(cfg.paths.policy_dir)).resolve()  # a Hugging Face folder vLLM can serve
    for name, folder in written.items():
        num_heads = json.loads((folder / "config.json").read_text())["num_heads"]
        spec = {"method": "medusa", "model": str(folder.resolve()), "num_speculative_tokens": num_heads}
        print(f"{name}: {folder}\n  vllm serve {target} --speculative-config '{json.dumps(spec)}'")
    print("MTP module: not exported: no serving engine's draft format computes it (docs/mtp.md#serving-engines)")
    return 0


def _claims(args) -> int:
    """Print the claims table judged on the stage metrics now on disk (the last run of each stage)."""
    from flows.pipeline import stage_metrics
    from foresight.claims import claims_markdown, claims_table

    print(claims_markdown(claims_table(stage_metrics(load_config(args.params)))), end="")
    return 0


def _report(args) -> int:
    """Write the results report (``foresight/report.py``) from the stage metrics on disk and the MLflow store;
    ``--readme`` also rewrites README.md's headline table from them."""
    from flows.pipeline import stage_metrics
    from foresight.report import sync_readme, write_report

    cfg = load_config(args.params)
    metrics = stage_metrics(cfg)
    html_path, md_path, report = write_report(cfg, metrics)
    print(f"{report.summary()}\nreport: {html_path}\n        {md_path} (the same as markdown)")
    if args.readme:
        readme = Path(args.params).resolve().parent / "README.md"
        print(f"{readme}: {'headline table rewritten' if sync_readme(readme, metrics) else 'up to date'}")
    return 0


def _serve(args) -> int:
    from flows.serve import main as serve_main

    load_config(args.params)
    serve_main(Path(args.params).resolve())
    return 0


def _ui(args) -> int:
    """Start the MLflow UI on the configured store and a Prefect server (its UI), both on loopback; print the URLs;
    stop both on Ctrl-C (or SIGTERM)."""
    import subprocess
    import time
    import urllib.request

    cfg = load_config(args.params)
    host = "127.0.0.1"
    commands = {
        "MLflow": ([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", cfg.mlflow_uri(), "--host", host,
                    "--port", str(args.mlflow_port)], f"http://{host}:{args.mlflow_port}", "/health"),
        "Prefect": ([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port",
                     str(args.prefect_port)], f"http://{host}:{args.prefect_port}", "/api/health"),
    }
    processes = {name: subprocess.Popen(command, start_new_session=True) for name, (command, _, _) in
                 commands.items()}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally below stops the servers

    def answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        pending = dict(commands)
        deadline = time.monotonic() + args.timeout
        while pending:
            for name, (_, url, health) in list(pending.items()):
                if processes[name].poll() is not None:
                    print(f"foresight ui: the {name} server exited ({processes[name].returncode})", file=sys.stderr)
                    return 1
                if answers(url + health):
                    print(f"{name} UI: {url}", flush=True)
                    del pending[name]
            if time.monotonic() > deadline:
                print(f"foresight ui: {', '.join(pending)} not up after {args.timeout} s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        from foresight.tracking import experiment_url

        # the experiment's runs table in the UI's model-training view (its default view is GenAI's traces)
        print(f"MLflow runs: {experiment_url(cfg, commands['MLflow'][1])}", flush=True)
        print(f"(MLflow store {cfg.mlflow_uri()}; point flows at Prefect with PREFECT_API_URL="
              f"http://{host}:{args.prefect_port}/api; Ctrl-C stops both)", flush=True)
        while all(process.poll() is None for process in processes.values()):
            time.sleep(1)
        return 1  # a server died
    except KeyboardInterrupt:
        return 0
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _check(args) -> int:
    cfg = load_config(args.params)
    print(json.dumps(cfg.model_dump(mode="json", by_alias=True), indent=2))
    return 0


def _dvc_yaml(args) -> int:
    from foresight.stages import render_dvc_yaml

    print(render_dvc_yaml(load_config(args.params)), end="")
    return 0


def _params_yaml(args) -> int:
    from foresight.params import render_params_yaml

    print(render_params_yaml(), end="")
    return 0


def _dvc_plots_template(args) -> int:
    from foresight.offline import dvc_plots_template

    print(dvc_plots_template(), end="")
    return 0


def _stage_docs(args) -> int:
    from foresight.stages import sync_stage_docs

    changed = sync_stage_docs(Path(args.params).resolve().parent)
    print(f"rewritten: {', '.join(map(str, changed))}" if changed else "README.md and the stage details: up to date")
    return 0


def _deploy(args) -> int:
    from flows.serve import deploy

    load_config(args.params)
    ids = deploy(args.work_pool, args.cpu_work_pool, Path(args.params).resolve())
    print(f"{len(ids)} deployments on work pool {args.work_pool}"
          + (f" (CPU-only stages on {args.cpu_work_pool})" if args.cpu_work_pool else "")
          + f"; start a worker with: prefect worker start --pool {args.work_pool}")
    return 0


def _plan(args) -> int:
    from foresight.memory import (Shapes, disk_plan, labeler_shape, model_shape, plan, policy_config, render,
                                  render_disk, visible_gpus)

    cfg = load_config(args.params)
    visible = visible_gpus()
    if args.gpu_memory is None and not visible:
        print("foresight plan: no GPU is visible here: say which to plan for with --gpu-memory GiB (and --gpus N)",
              file=sys.stderr)
        return 2
    capacity = args.gpu_memory if args.gpu_memory is not None else min(visible)
    gpus = args.gpus or len(visible) or 1
    source = "--gpu-memory" if args.gpu_memory is not None else "visible GPUs, torch.cuda.mem_get_info"
    policy = model_shape(policy_config(cfg))
    shapes = Shapes(policy, labeler_shape(cfg, policy))
    plans = plan(cfg, capacity, gpus, shapes=shapes)
    disk = disk_plan(cfg, shapes, args.disk)
    print(render(plans, policy, cfg, capacity, gpus, source))
    print("\n" + render_disk(disk))
    return 0 if all(p.fits for p in plans) and disk.fits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="foresight",
                                     description="Foresight, the looking-ahead pipeline. --params FILE (default "
                                                 "params.yaml) goes anywhere on the line.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Docs: README.md (two commands), docs/pipeline.md, docs/gpu.md.")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    # --params after the command too (``foresight run generate --params study.yaml``)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--params", default=argparse.SUPPRESS, help="params file (default: params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, func):
        subparser = sub.add_parser(name, help=help, description=help, parents=[common])
        subparser.set_defaults(func=func)
        return subparser

    for name, help in (("pipeline", "run the whole pipeline (dvc repro) with tracking"),
                       ("run", "run STAGE... through dvc repro (with their stale ancestors) with tracking")):
        runner = command(name, help, _pipeline)
        if name == "run":
            runner.add_argument("stages", nargs="+", metavar="STAGE", help="stage names (foresight/stages.py)")
        runner.add_argument("--force", action="store_true", help="re-run stages even if up to date")
        runner.add_argument("--push", action="store_true",
                            help="push the outputs and the run cache to the default DVC remote (dvc push --run-cache)")
        runner.add_argument("--isolated", action="store_true",
                            help="run in a temporary workspace (dvc exp run --temp), then record the results here "
                                 "from the run cache: runs of independent branches can go at once")
        runner.epilog = ("--params FILE: the project's params.yaml runs as it is. Any other FILE (a whole or partial "
                         "params file) runs as a DVC experiment: its values that differ from params.yaml's are set "
                         "there (dvc exp run --set-param), so params.yaml, dvc.lock and the outputs agree and dvc exp "
                         "show lists the run; keys FILE lacks keep params.yaml's values, a key params.yaml lacks is "
                         "an error, relative paths are read from the project's folder.")
    command("serve", "serve deployments of every flow for the Prefect UI", _serve)
    deployer = command("deploy", "register every deployment on Prefect work pools (docs/gpu.md)", _deploy)
    deployer.add_argument("--work-pool", required=True, help="pool of the pipeline and the GPU stages")
    deployer.add_argument("--cpu-work-pool", help="pool of the stages that use no GPU (default: --work-pool)")
    ui = command("ui", "start the MLflow and Prefect UIs on loopback and print their URLs (Ctrl-C stops them)", _ui)
    ui.add_argument("--mlflow-port", type=int, default=5000, help="MLflow UI port (default: 5000)")
    ui.add_argument("--prefect-port", type=int, default=4200, help="Prefect UI port (default: 4200)")
    ui.add_argument("--timeout", type=float, default=120, help="seconds to wait for both to answer (default: 120)")
    command("claims", "judge each paper's central claims on the stage metrics on disk (a markdown table)", _claims)
    exporter = command("export", "export the trained Medusa heads as vLLM Medusa drafts (docs/medusa.md#export)",
                       _export)
    exporter.add_argument("out_dir", type=Path, metavar="OUT_DIR",
                          help="folder to write one draft folder per set of heads into (created if missing)")
    reporter = command("report", "write the results report (data/reports/report.html and report.md) from the "
                                 "metrics on disk and the MLflow store", _report)
    reporter.add_argument("--readme", action="store_true",
                          help="also rewrite README.md's headline table from the same metrics")
    command("check", "validate params.yaml and print it resolved", _check)
    command("dvc-yaml", "print dvc.yaml from the stage table (foresight dvc-yaml > dvc.yaml)", _dvc_yaml)
    command("params-yaml", "print params.yaml from the knobs' classes (foresight params-yaml > params.yaml)",
            _params_yaml)
    command("dvc-plots-template", "print the offline `dvc plots show` page template, vega inlined "
                                  "(foresight dvc-plots-template > foresight/vendor/dvc_plots.html)", _dvc_plots_template)
    command("stage-docs", "rewrite README.md's stage DAG and docs/guide.md's stage details from the stage table",
            _stage_docs)
    planner = command("plan", "estimate each stage's peak GPU memory (and the knobs that make it fit) and disk "
                              "footprint", _plan)
    planner.add_argument("--gpu-memory", type=float, metavar="GiB",
                         help="memory of each GPU to plan for (default: the visible GPUs')")
    planner.add_argument("--gpus", type=int, metavar="N", help="GPUs to plan for (default: the visible ones)")
    planner.add_argument("--disk", type=float, metavar="GiB",
                         help="disk to plan for (default: the free space of the checkout's filesystem)")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"foresight: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the full traceback is in the Prefect log above
        print(f"\nforesight {args.command} failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
