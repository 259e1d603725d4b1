"""``TrainerClient``: the Python client of ``dataflow serve-trainer``, a method per verb
(docs/engine_service.md). Light: no torch (a batch goes as a file's path; write one with
``write_token_batch``).

    with TrainerClient("run/trainer.sock") as trainer:
        trainer.load(preset="gpt2_tiny", batch=4, seq_len=32, budget="8MiB")
        stats = trainer.step("batch.safetensors", lr=1e-3)
        trainer.save()
"""

from __future__ import annotations

import itertools
import socket
from pathlib import Path
from typing import Any

from dataflow_training.service.protocol import read_message, send_message


class ServiceError(RuntimeError):
    """A request the server refused: its one-line error (it names the field at fault)."""


class TrainerClient:
    """A connection to a server: on its UNIX socket ``path``, or ``tcp="HOST:PORT"`` with
    the server's ``token``. ``timeout``: seconds to wait for an answer (None: as long as
    the verb takes; a first step compiles nothing, but a ``load`` may take minutes)."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        tcp: str | None = None,
        token: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if (path is None) == (tcp is None):
            raise ValueError("TrainerClient takes a socket path or tcp='HOST:PORT', one of them")
        if path is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            self._sock.connect(str(path))
        else:
            host, _, port = tcp.rpartition(":")
            self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        self.token = token
        self._ids = itertools.count(1)

    def call(self, verb: str, **args: Any) -> Any:
        """Send one request and return its result; ``ServiceError`` when it is refused."""
        request: dict[str, Any] = {"verb": verb, "args": args, "id": next(self._ids)}
        if self.token is not None:
            request["token"] = self.token
        send_message(self._sock, request)
        answer = read_message(self._sock)
        if not answer.get("ok"):
            raise ServiceError(answer.get("error", "the server gave no reason"))
        return answer.get("result")

    def load(self, preset: str | None = None, **options: Any) -> dict[str, Any]:
        """Compile ``preset``'s step and start its run (``options``: the ``load`` fields of
        docs/engine_service.md: budget, batch, seq_len, rounds, lr, seed, init, resume...;
        ``kind="rl"`` and that kind's fields for an update a plugin serves)."""
        return self.call("load", **({} if preset is None else {"preset": preset}), **options)

    def step(self, path: str | Path, lr: float | None = None, **args: Any) -> dict[str, Any]:
        """One optimizer update on the batch at ``path``: a ``tokens`` batch file, or what
        the loaded kind reads (a rollouts folder for ``rl``); ``args``: the kind's other
        step fields (``kl_coef``...)."""
        batch = {"path": str(Path(path).resolve())}  # the kind is the loaded run's
        return self.call("step", batch=batch, **({} if lr is None else {"lr": lr}), **args)

    def save(self) -> dict[str, Any]:
        return self.call("save")

    def restore(self, checkpoint: str | Path = "auto") -> dict[str, Any]:
        return self.call("restore", checkpoint=str(checkpoint))

    def export_weights(
        self,
        path: str | Path | None = None,
        *,
        changed_only: bool = False,
        max_shard_size: str | int | None = None,
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"changed_only": changed_only}
        if path is not None:
            args["path"] = str(Path(path).resolve())
        if max_shard_size is not None:
            args["max_shard_size"] = max_shard_size
        return self.call("export_weights", **args)

    def profile_start(self, folder: str | Path | None = None) -> dict[str, Any]:
        return self.call("profile_start", **({} if folder is None else {"folder": str(folder)}))

    def profile_stop(self) -> dict[str, Any]:
        return self.call("profile_stop")

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def shutdown(self, save: bool = False) -> dict[str, Any]:
        return self.call("shutdown", save=save)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
