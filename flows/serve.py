"""Register one deployment per flow with a running Prefect server: served here, or on work pools.

``foresight serve`` (or ``python -m flows.serve``) blocks, polling the server for runs triggered from
the UI (Deployments → a flow → Run → Quick run, or Custom run to edit its parameters) or the API
(``prefect deployment run 'pipeline/pipeline'``). No work pool is needed: ``prefect.serve`` runs
them in this process's machine, in the repository folder.

``foresight deploy --work-pool gpu-pool`` registers the same deployments on work pools instead (docs/gpu.md):
the pipeline and every stage that runs a network go to the GPU pool, the others to ``--cpu-work-pool`` when
given. Workers on the GPU machines (``prefect worker start --pool gpu-pool``) then run them from this
repository folder; the ``gpu`` concurrency limit guards the GPUs they share.
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect import Flow, serve

from flows.pipeline import pipeline_flow
from flows.stages import STAGE_FLOWS, _task
from foresight.stages import STAGES
from tasks.data import GPU_TAG

ROOT = Path(__file__).resolve().parent.parent


def deployments(params_path: Path = ROOT / "params.yaml") -> list:
    """A deployment per flow (the pipeline's and one per stage of the stage table); each defaults to this
    repository's params file and shows its flow's one-line description in the UI."""
    flows = [pipeline_flow, *STAGE_FLOWS.values()]
    return [
        f.to_deployment(name=f.name, parameters={"params_path": str(params_path)}, tags=["foresight"],
                        description=(f.description or "").strip().splitlines()[0])
        for f in flows
    ]


def main(params_path: Path = ROOT / "params.yaml") -> None:
    """Serve every deployment until interrupted."""
    serve(*deployments(params_path), limit=1)  # one run at a time: runs share the data folder


if __name__ == "__main__":
    main()


def _entrypoints() -> list[tuple[Flow, str, bool]]:
    """(flow, entrypoint, whether it runs a network on a GPU) for the pipeline and every stage."""
    stages = [(STAGE_FLOWS[stage.name], f"flows/stages.py:{stage.name}_flow", GPU_TAG in _task(stage).tags)
              for stage in STAGES]
    return [(pipeline_flow, "flows/pipeline.py:pipeline_flow", True), *stages]


def deploy(work_pool: str, cpu_work_pool: str | None = None, params_path: Path = ROOT / "params.yaml") -> list[UUID]:
    """Register every deployment on a work pool (no image: workers run this folder's code); returns their ids.

    The pipeline and the GPU stages go to ``work_pool``; the CPU-only stages to ``cpu_work_pool`` (default:
    ``work_pool`` too). GPU deployments carry the ``gpu`` tag as well, for filtering in the UI.
    """
    ids = []
    for f, entrypoint, gpu in _entrypoints():
        source = Flow.from_source(source=str(ROOT), entrypoint=entrypoint)
        ids.append(source.deploy(name=f.name, work_pool_name=work_pool if gpu else cpu_work_pool or work_pool,
                                 parameters={"params_path": str(params_path)},
                                 tags=["foresight", *([GPU_TAG] if gpu else [])],
                                 description=(f.description or "").strip().splitlines()[0],
                                 build=False, push=False, print_next_steps=False))
    return ids
