"""``foresight``: the command line.

- ``foresight pipeline``: the whole pipeline on ``params.yaml`` (``dvc repro`` + tracking), then
  where to find the data, the MLflow runs and the Data Docs.
- ``foresight serve``: deployments for every flow, triggerable from the Prefect UI.
- ``foresight check``: validate ``params.yaml`` and print the resolved configuration.
- ``foresight dvc-yaml``: print ``dvc.yaml`` as the stage table (``foresight/stages.py``) declares it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from foresight.config import ConfigError, load_config


def _pipeline(args) -> int:
    from flows.pipeline import pipeline_flow

    cfg = load_config(args.params)
    result = pipeline_flow(params_path=str(Path(args.params).resolve()), force=args.force, push=not args.no_push)
    print("\n" + "=" * 72)
    print("Foresight pipeline finished. Stages:")
    for row in result["stages"]:
        extra = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("stage", "status", "seconds"))
        print(f"  {row['stage']:<16} {row['status']:<11} {row['seconds']:>7} s  {extra}")
    print("\nWhere things are:")
    print(f"  data (DVC-tracked):   {cfg.path(cfg.paths.pairs).parent.parent}   (dvc status / dvc metrics show)")
    print(f"  preference pairs:     {cfg.path(cfg.paths.pairs)}")
    print(f"  Data Docs (GX):       {cfg.path(cfg.paths.reports_dir) / 'datadocs' / 'index.html'}")
    print(f"  MLflow runs:          {cfg.mlflow_uri()}  (parent run {result['mlflow_run_id']})")
    print(f"      view with:        mlflow ui --backend-store-uri {cfg.mlflow_uri()}")
    print("  Prefect runs:         prefect server start, then open http://127.0.0.1:4200")
    return 0


def _serve(args) -> int:
    from flows.serve import main as serve_main

    load_config(args.params)
    serve_main(Path(args.params).resolve())
    return 0


def _check(args) -> int:
    cfg = load_config(args.params)
    print(json.dumps(cfg.model_dump(mode="json", by_alias=True), indent=2))
    return 0


def _dvc_yaml(args) -> int:
    from foresight.stages import render_dvc_yaml

    print(render_dvc_yaml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="foresight", description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("pipeline", help="run the whole pipeline (dvc repro) with tracking")
    run.add_argument("--force", action="store_true", help="re-run stages even if up to date")
    run.add_argument("--no-push", action="store_true", help="do not push outputs to the DVC remote")
    run.set_defaults(func=_pipeline)
    sub.add_parser("serve", help="serve deployments of every flow for the Prefect UI").set_defaults(func=_serve)
    sub.add_parser("check", help="validate params.yaml and print it resolved").set_defaults(func=_check)
    sub.add_parser("dvc-yaml", help="print dvc.yaml from the stage table (foresight dvc-yaml > dvc.yaml)"
                   ).set_defaults(func=_dvc_yaml)
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
