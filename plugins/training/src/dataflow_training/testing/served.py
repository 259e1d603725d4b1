"""A ``dataflow serve-trainer`` process for tests: started on a run folder, waited for
until its socket exists, driven through ``TrainerClient``, stopped (killed if it still
runs). ``short_folder`` makes a folder short enough for the socket (a UNIX socket path
takes at most 107 bytes; pytest's temporary folders are longer)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from dataflow_training.service.client import TrainerClient

#: the ``dataflow`` command of this interpreter's environment
DATAFLOW = str(Path(sys.executable).parent / "dataflow")


class ServerProcess:
    """``dataflow serve-trainer --out OUT EXTRA...`` with ``env`` added to this process's
    environment; the constructor returns once the socket exists (an AssertionError with
    the server's output when it exits first or takes over ``start_seconds``)."""

    def __init__(
        self,
        out: Path,
        *extra: str,
        env: Mapping[str, str] | None = None,
        start_seconds: float = 120.0,
    ) -> None:
        self.out, self.socket = out, out / "trainer.sock"
        self.proc = subprocess.Popen(
            [DATAFLOW, "serve-trainer", "--out", str(out), *extra],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + start_seconds
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start: {self.proc.communicate()[0]}")
            time.sleep(0.05)

    def client(self, timeout: float = 120.0) -> TrainerClient:
        return TrainerClient(self.socket, timeout=timeout)

    def wait(self, timeout: float = 120.0) -> tuple[int, str]:
        """The exit code and output of a server that is ending."""
        output = self.proc.communicate(timeout=timeout)[0]
        return self.proc.returncode, output

    def stop(self) -> None:
        """Kill the server if it still runs, and read what it left (once)."""
        if self.proc.poll() is None:
            self.proc.kill()
        if not self.proc.stdout.closed:
            self.proc.communicate()


@contextmanager
def short_folder(prefix: str = "dfs-") -> Iterator[Path]:
    """A fresh folder under /tmp, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
