"""Register one deployment per flow with a running Prefect server, and serve them.

``foresight serve`` (or ``python -m flows.serve``) blocks, polling the server for runs triggered from
the UI (Deployments → a flow → Run → Quick run, or Custom run to edit its parameters) or the API
(``prefect deployment run 'pipeline/pipeline'``). No work pool is needed: ``prefect.serve`` runs
them in this process's machine, in the repository folder.
"""

from __future__ import annotations

from pathlib import Path

from prefect import serve

from flows.pipeline import pipeline_flow
from flows.stages import STAGE_FLOWS

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
