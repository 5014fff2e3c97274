"""MLflow in a child process, so its import overlaps the run instead of preceding it.

Importing MLflow and opening its SQLite store costs about 3 s (SQLAlchemy, alembic, pandas, MLflow's own
modules), a fifth of a llava-bench run. In a thread beside the models' build it was slower (both import Python
code under one GIL); in a child process it costs the run nothing measurable on two cores, because building a
model is mostly one busy core. :class:`ChildConnection` starts ``python -m paritylab.sink.worker``, which runs an
:class:`~paritylab.sink.connection.InlineConnection` and answers one JSON line per request, in order, on a pipe.

The child runs in its own session: a Ctrl-C in the terminal reaches the run, which then asks the child to mark
the MLflow run KILLED (a publish under way is interrupted first). When the run's process dies, the child reads
the end of its input and exits; the run left RUNNING is closed as stale by the next run, as without a child.

``tracking.process``: ``child``; ``inline``; ``auto`` (the default): inline when MLflow is already imported
in this process (a notebook, a test session, a sweep), since there is nothing left to overlap, else a child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from paritylab.sink.connection import Connection, InlineConnection, Opening
from paritylab.sink.history import Regression
from paritylab.sink.tracking import TrackingError


def connect(opening: Opening, process: str, echo: Callable[[str], None] = print) -> Connection:
    """The run's MLflow connection, in this process or a child (``process``: ``auto``, ``child``, ``inline``).
    An inline connection raises :class:`TrackingError` here when the store cannot be opened; a child's failure
    is raised by its first :meth:`~Connection.ready`."""
    if process not in ("auto", "child", "inline"):
        raise ValueError(f"tracking.process={process!r}: use auto, child or inline")
    if process == "inline" or (process == "auto" and "mlflow" in sys.modules):
        return InlineConnection(opening, echo)
    return ChildConnection(opening, echo)


class ChildConnection(Connection):
    """An :class:`InlineConnection` in a child process. The run is opened there at once; only :meth:`ready`
    (and every later call) waits for it."""

    def __init__(self, opening: Opening, echo: Callable[[str], None] = print) -> None:
        self.echo = echo
        self.uri = opening.record.uri or ""
        self._opened: dict[str, Any] | None = None
        self._failed: TrackingError | None = None
        """Why the run could not be opened: every later call raises it again (the child has no reply left)."""
        self._unread = 0
        package_root = str(Path(__file__).resolve().parents[2])  # this paritylab, however the run found it
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "paritylab.sink.worker"],
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C in the terminal is the run's to handle, not the child's
            text=True,
            encoding="utf-8",
        )
        self._send("open", **opening.to_json())

    def ready(self) -> str | None:
        if self._failed is not None:
            raise self._failed
        if self._opened is None:
            try:
                self._opened = self._reply("open the run")
            except TrackingError as error:
                self._failed = error
                raise
            self.uri = self._opened["uri"]
        return self._opened["run_id"]

    def link(self) -> str:
        return self._opened["link"] if self._opened else ""

    def baseline_alignment(self, fingerprint: str, directory: Path) -> tuple[str, Path] | None:
        self.ready()
        found = self._call("read the baseline's alignment", "baseline_alignment", fingerprint=fingerprint,
                           directory=str(directory))  # fmt: skip
        return None if found is None else (found[0], Path(found[1]))

    def publish(self, directory: Path) -> Regression | None:
        self.ready()
        found = self._call("publish", "publish", directory=str(directory))
        return None if found is None else Regression(**found)

    def end(self, status: str) -> None:
        if self._failed is None and (self._opened is not None or self._unread):
            self.ready()
            self._call("end the run", "end", status=status)

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            with suppress(OSError):
                self.process.stdin.close()  # the child reads the end of its input and exits
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def _call(self, what: str, op: str, **arguments: Any) -> Any:
        while self._unread:  # the reply to a call a signal interrupted: its outcome is superseded
            with suppress(TrackingError):
                self._reply(what)
        self._send(op, **arguments)
        return self._reply(what)

    def _send(self, op: str, **arguments: Any) -> None:
        pipe = self.process.stdin
        try:
            assert pipe is not None
            pipe.write(json.dumps({"op": op, "arguments": arguments}) + "\n")
            pipe.flush()
        except (OSError, ValueError) as error:
            raise TrackingError(f"MLflow's worker process is gone ({self._exit()}): {error}") from error
        self._unread += 1

    def _reply(self, what: str) -> Any:
        pipe = self.process.stdout
        assert pipe is not None
        try:
            line = pipe.readline()
        except KeyboardInterrupt:  # Ctrl-C while the child works: interrupt it too, and read its reply later
            if self.process.poll() is None:
                os.kill(self.process.pid, signal.SIGINT)
            raise
        if not line:
            self._unread = 0
            raise TrackingError(f"MLflow's worker process ended while asked to {what} ({self._exit()})")
        self._unread -= 1
        reply = json.loads(line)
        for said in reply.get("said", []):
            self.echo(said)
        if "error" in reply:
            raise TrackingError(reply["error"])
        return reply.get("result")

    def _exit(self) -> str:
        code = self.process.poll()
        return "still running" if code is None else f"exit code {code}"


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer requests, one JSON line each, until the input ends."""
    connection: Connection = Connection()
    while True:
        try:
            line = requests.readline()
        except KeyboardInterrupt:  # a signal forwarded after its call had already been answered
            continue
        if not line:
            return
        said: list[str] = []
        try:
            request = json.loads(line)
            result: Any = None
            op, arguments = request["op"], request["arguments"]
            if op == "open":
                connection = InlineConnection(Opening.from_json(arguments), said.append)
                result = {"run_id": connection.ready(), "link": connection.link(), "uri": connection.uri}
            elif op == "baseline_alignment":
                found = connection.baseline_alignment(arguments["fingerprint"], Path(arguments["directory"]))
                result = None if found is None else [found[0], str(found[1])]
            elif op == "publish":
                regression = connection.publish(Path(arguments["directory"]))
                result = None if regression is None else asdict(regression)
            elif op == "end":
                connection.end(arguments["status"])
            else:
                raise ValueError(f"unknown request {op!r}")
            reply: dict[str, Any] = {"result": result}
        except TrackingError as error:
            reply = {"error": str(error)}
        except BaseException as error:  # a bug, a full disk, a forwarded Ctrl-C: the run decides what follows
            reply = {"error": f"{type(error).__name__}: {error}".strip()}
        reply["said"] = said
        try:
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
        except (BrokenPipeError, ValueError):  # the run is gone (kill -9): nobody to answer, nothing to say
            return


def main() -> None:
    # The run interrupts this child with SIGINT (it has a session of its own, so no terminal does). A run started
    # from a background shell or nohup inherits SIGINT ignored, and so would this child: hear it whatever came down.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The replies' pipe is this process's standard output; anything MLflow or a library prints goes to
    # standard error instead, so it can never be taken for a reply.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin, replies)
    with contextlib.suppress(OSError, ValueError):  # a run killed mid-reply closed the pipe
        replies.flush()
    os._exit(0)  # the interpreter's teardown of MLflow's modules would only delay the run's own exit


if __name__ == "__main__":
    main()
