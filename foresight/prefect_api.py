"""The Prefect API a ``foresight pipeline`` / ``foresight run`` reports to: the configured one (``PREFECT_API_URL``,
from the environment or the Prefect profile), or else a temporary one that outlives the terminal's Ctrl-C.

Without an API URL Prefect starts a temporary API server by itself (prefect 3.8.8,
``prefect/server/api/server.py``: ``SubprocessASGIServer``, uvicorn serving ``create_app`` in a child process).
That child is in the terminal's foreground process group, so Ctrl-C kills it along with the run, and the
interrupted flows (the pipeline's and the running stage's) then retry the dead API for minutes
(``httpx.ConnectError``) and stay marked Running. :func:`prefect_api` starts the same server in a session of its
own (no terminal signal reaches it), points this process at it, and stops it only after the flows have reported
how they ended and Prefect's log and event workers have sent what they hold. Its runs get no "View at" links: a
link to a server that is gone when the run ends leads nowhere (a configured API keeps them).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings, temporary_settings


class _SessionServer(SubprocessASGIServer):
    """Prefect's temporary API server (its start, health wait, port-clash retry and stop), in its own session."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        # SubprocessASGIServer._run_uvicorn_command of prefect 3.8.8 (pinned in pyproject.toml), plus
        # start_new_session: the terminal's SIGINT goes to its foreground process group, which this is then not in
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                 "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)},
            start_new_session=True)


def _free_port() -> int:
    """A loopback port nobody listens on now (the server retries another if one takes it meanwhile)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _send_pending() -> None:
    """Send the logs and events Prefect's background workers still hold (they would otherwise go at exit, after the
    server has stopped)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # what prefect does at exit (APILogHandler.flush, EventsWorker's drain), with its 5 s bound for a stuck worker
    APILogWorker.drain_all(timeout=5)
    EventsWorker.drain_all(timeout=5)


@contextlib.contextmanager
def prefect_api() -> Iterator[str | None]:
    """Within: this process (and every process it starts with ``PREFECT_API_URL``) reports to the configured
    Prefect API, or else to a temporary one of its own. Yields the temporary API's URL, ``None`` with a configured
    API."""
    if PREFECT_API_URL.value():
        yield None
        return
    # an explicit port: Prefect keeps one server per port, and its own default (port None) stays its own
    server = _SessionServer(port=_free_port())
    server.start()
    try:
        # no UI URL: Prefect infers one from the API's (settings/models/_defaults.py, default_ui_url) and the flow
        # engine logs "View at <it>" for every flow run (flow_engine.py, url_for), links to a server that serves no
        # UI and is gone when the run ends; the stage processes get the same (flows.pipeline.reproduce_task)
        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_UI_URL: ""}):
            try:
                yield server.api_url
            finally:
                _send_pending()
    finally:
        server.stop()
