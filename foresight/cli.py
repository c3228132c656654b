"""``foresight``: the command line.

- ``foresight pipeline``: the whole pipeline on ``params.yaml`` (``dvc repro`` + tracking), then
  where to find the data, the MLflow runs and the Data Docs.
- ``foresight serve``: deployments for every flow, triggerable from the Prefect UI.
- ``foresight deploy --work-pool POOL``: the same deployments on Prefect work pools (GPU stages on POOL).
- ``foresight check``: validate ``params.yaml`` and print the resolved configuration.
- ``foresight dvc-yaml``: print ``dvc.yaml`` as the stage table (``foresight/stages.py``) declares it.
- ``foresight plan``: each stage's estimated peak GPU memory against the GPUs, and the knob that makes a stage
  fit that does not (``foresight/memory.py``); exit code 1 when one does not fit.
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


def _deploy(args) -> int:
    from flows.serve import deploy

    load_config(args.params)
    ids = deploy(args.work_pool, args.cpu_work_pool, Path(args.params).resolve())
    print(f"{len(ids)} deployments on work pool {args.work_pool}"
          + (f" (CPU-only stages on {args.cpu_work_pool})" if args.cpu_work_pool else "")
          + f"; start a worker with: prefect worker start --pool {args.work_pool}")
    return 0


def _plan(args) -> int:
    from foresight.memory import Shapes, labeler_shape, model_shape, plan, policy_config, render, visible_gpus

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
    plans = plan(cfg, capacity, gpus, shapes=Shapes(policy, labeler_shape(cfg, policy)))
    print(render(plans, policy, cfg, capacity, gpus, source))
    return 0 if all(p.fits for p in plans) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="foresight", description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("pipeline", help="run the whole pipeline (dvc repro) with tracking")
    run.add_argument("--force", action="store_true", help="re-run stages even if up to date")
    run.add_argument("--no-push", action="store_true", help="do not push outputs to the DVC remote")
    run.set_defaults(func=_pipeline)
    sub.add_parser("serve", help="serve deployments of every flow for the Prefect UI").set_defaults(func=_serve)
    deployer = sub.add_parser("deploy", help="register every deployment on Prefect work pools (docs/gpu.md)")
    deployer.add_argument("--work-pool", required=True, help="pool of the pipeline and the GPU stages")
    deployer.add_argument("--cpu-work-pool", help="pool of the stages that use no GPU (default: --work-pool)")
    deployer.set_defaults(func=_deploy)
    sub.add_parser("check", help="validate params.yaml and print it resolved").set_defaults(func=_check)
    sub.add_parser("dvc-yaml", help="print dvc.yaml from the stage table (foresight dvc-yaml > dvc.yaml)"
                   ).set_defaults(func=_dvc_yaml)
    planner = sub.add_parser("plan", help="estimate each stage's peak GPU memory and the knobs that make it fit")
    planner.add_argument("--gpu-memory", type=float, metavar="GiB",
                         help="memory of each GPU to plan for (default: the visible GPUs')")
    planner.add_argument("--gpus", type=int, metavar="N", help="GPUs to plan for (default: the visible ones)")
    planner.set_defaults(func=_plan)
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
