"""Register the deployments with a running Prefect server: served here, or on work pools.

One deployment runs the whole pipeline, and one per stage runs that stage: every one of them is the ``pipeline``
flow (``dvc repro``, with ``targets`` = the stage for a stage's deployment), so a stage triggered from the UI
runs through DVC, with its stale ancestors, and ``dvc.lock``, the metrics and the DVC remote stay true whichever
way it was started. DVC then runs the stage's own flow (``python -m flows.stages STAGE``), which reports to the
same Prefect server. A stage's deployment runs ``isolated`` (``flows/pipeline.py``): in a temporary workspace, its
results then recorded here from DVC's run cache, so independent branches can run at once on several workers.

``foresight serve`` (or ``python -m flows.serve``) blocks, polling the server for runs triggered from
the UI (Deployments → a deployment → Run → Quick run, or Custom run to edit its parameters) or the API
(``prefect deployment run 'pipeline/train-medusa'``). No work pool is needed: ``prefect.serve`` runs
them in this process's machine, in the repository folder.

``foresight deploy --work-pool gpu-pool`` registers the same deployments on work pools instead (docs/gpu.md):
the pipeline and every stage that runs a network go to the GPU pool, the others to ``--cpu-work-pool`` when
given. Workers on the GPU machines (``prefect worker start --pool gpu-pool``) then run them from this
repository folder; the ``gpu`` concurrency limit guards the GPUs they share. These deployments push their
outputs and the run cache to the DVC remote (``push``): workers in their own clones share their results through
it. Served deployments run in this workspace, whose DVC cache already holds them, and do not push.
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect import Flow, serve

from flows.pipeline import pipeline_flow
from foresight.stages import STAGES
from foresight.stages import GPU_TAG

ROOT = Path(__file__).resolve().parent.parent


def _deployment_specs(params_path: Path, push: bool = False) -> list[tuple[str, dict, str, bool]]:
    """(name, parameters, description, whether it runs a network on a GPU) of the pipeline's deployment and each
    stage's, all of the pipeline flow; ``push``: their runs push to the DVC remote."""
    params = {"params_path": str(params_path), **({"push": True} if push else {})}
    pipeline = ("pipeline", params, (pipeline_flow.description or "").strip().splitlines()[0], True)
    # isolated: a stage's runs on several workers at once (independent branches) each get a temporary workspace
    stages = [(stage.flow_name, {**params, "targets": [stage.name], "isolated": True},
               f"{stage.description} Runs dvc repro {stage.name} (the stage and its stale ancestors) in a temporary "
               "workspace, then records it in this one from DVC's run cache.",
               stage.gpu) for stage in STAGES]
    return [pipeline, *stages]


def deployments(params_path: Path = ROOT / "params.yaml") -> list:
    """The pipeline's deployment and one per stage of the stage table, each defaulting to this repository's params
    file and showing its one-line description in the UI."""
    return [pipeline_flow.to_deployment(name=name, parameters=parameters, tags=["foresight"], description=description)
            for name, parameters, description, _ in _deployment_specs(params_path)]


def main(params_path: Path = ROOT / "params.yaml") -> None:
    """Serve every deployment until interrupted."""
    serve(*deployments(params_path), limit=1)  # one run at a time: runs share the data folder


if __name__ == "__main__":
    main()


def deploy(work_pool: str, cpu_work_pool: str | None = None, params_path: Path = ROOT / "params.yaml") -> list[UUID]:
    """Register every deployment on a work pool (no image: workers run this folder's code); returns their ids.

    The pipeline and the GPU stages go to ``work_pool``; the CPU-only stages to ``cpu_work_pool`` (default:
    ``work_pool`` too). GPU deployments carry the ``gpu`` tag as well, for filtering in the UI.
    """
    source = Flow.from_source(source=str(ROOT), entrypoint="flows/pipeline.py:pipeline_flow")
    return [source.deploy(name=name, work_pool_name=work_pool if gpu else cpu_work_pool or work_pool,
                          parameters=parameters, tags=["foresight", *([GPU_TAG] if gpu else [])],
                          description=description, build=False, push=False, print_next_steps=False)
            for name, parameters, description, gpu in _deployment_specs(params_path, push=True)]
