"""``dataflow serve-trainer`` with real processes, on gpt2_tiny on the CPU: the losses of
steps through the service are a direct ``TrainingRun``'s; save, shutdown, a new server and
its restore continue the run exactly; a client SIGKILLed mid-``step`` and malformed bytes
leave the server serving and the state whole; SIGTERM saves and removes the socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from dataflow_training import (
    ServiceError,
    TrainerClient,
    TrainingRun,
    TrainOptions,
    load_family,
    write_token_batch,
)
from dataflow_training.testing import ServerProcess, short_folder
from safetensors.torch import load_file, save_file

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")

DATAFLOW = str(Path(sys.executable).parent / "dataflow")  # a server started by hand

SHAPE = {"batch": 2, "seq_len": 16, "lr": 1e-3, "seed": 0}
#: the tolerance of service losses against the direct run's: the same CPU code on the same
#: data and seed, in another process (bit-identical in practice)
ABS = 1e-6


def _ids(step: int) -> torch.Tensor:
    """Step ``step``'s input ids (batch, seq_len + 1), the same in every test."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (SHAPE["batch"], SHAPE["seq_len"] + 1), generator=g)


_DIRECT: list[float] = []


def direct_losses(steps: int) -> list[float]:
    """The losses of ``steps`` steps of a ``TrainingRun`` on ``_ids``, uninterrupted."""
    if len(_DIRECT) < steps:
        _DIRECT.clear()
        options = TrainOptions(
            family="gpt2", preset="gpt2_tiny", steps=0, out=tempfile.mkdtemp(), device="cpu",
            batch=SHAPE["batch"], seq_len=SHAPE["seq_len"], lr=SHAPE["lr"],
        )  # fmt: skip
        compiled = options.compile(load_family("gpt2"), recompute=options.recompute)
        run = TrainingRun(compiled, seed=SHAPE["seed"])
        for step in range(steps):
            ids = _ids(step)
            _DIRECT.append(run.step([(ids[:, :-1], ids[:, 1:])]).loss)
    return _DIRECT[:steps]


class Served(ServerProcess):
    """A server process on a run folder, and the token batches its steps read."""

    def batch(self, step: int) -> Path:
        return write_token_batch(self.out.parent / f"batch_{step}.safetensors", _ids(step))


@pytest.fixture
def home():
    with short_folder() as path:
        yield path


@pytest.fixture
def served(home):
    server = Served(home / "run")
    yield server
    server.stop()


def test_steps_through_the_service_are_a_direct_runs(served):
    assert stat.S_IMODE(served.socket.stat().st_mode) == 0o600
    with served.client() as trainer:
        loaded = trainer.load(preset="gpt2_tiny", **SHAPE)
        assert loaded["step"] == 0 and loaded["family"] == "gpt2"
        losses = [trainer.step(served.batch(step))["loss"] for step in range(4)]
        assert trainer.status()["step"] == 4
        trainer.shutdown()
    assert losses == pytest.approx(direct_losses(4), abs=ABS)
    code, output = served.wait()
    assert code == 0, output
    assert not served.socket.exists()
    metrics = [json.loads(line) for line in (served.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]


def test_save_shutdown_new_server_restore_continues_the_run(home):
    first = Served(home / "run")
    try:
        with first.client() as trainer:
            trainer.load(preset="gpt2_tiny", **SHAPE)
            before = [trainer.step(first.batch(step))["loss"] for step in range(2)]
            saved = trainer.save()
            assert saved == {"step": 2, "checkpoint": str(home / "run" / "step_000002")}
            exported = trainer.export_weights()
            trainer.shutdown()
        assert first.wait()[0] == 0
    finally:
        first.stop()
    second = Served(home / "run")
    try:
        with second.client() as trainer:
            with pytest.raises(ServiceError, match=r"^load: args\.resume: .*step_000002"):
                trainer.load(preset="gpt2_tiny", **SHAPE)  # a new run over a saved one
            assert trainer.load(preset="gpt2_tiny", resume="auto", **SHAPE)["step"] == 2
            after = [trainer.step(second.batch(step))["loss"] for step in (2, 3)]
            # and back: restore the checkpoint, the same two steps again
            assert trainer.restore()["step"] == 2
            again = [trainer.step(second.batch(step))["loss"] for step in (2, 3)]
            trainer.shutdown()
    finally:
        second.stop()
    assert before + after == pytest.approx(direct_losses(4), abs=ABS)
    assert again == after
    # the export holds the checkpoint's weights, as `dataflow export --hf` writes them
    hf = home / "hf"
    result = invoke("export", "--hf", str(hf), "--from", saved["checkpoint"], "--no-tokenizer")
    assert result.exit_code == 0, result.output
    ours = load_file(Path(exported["path"]) / "model.safetensors")
    theirs = load_file(hf / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_export_weights_changed_only_writes_what_changed(served, home):
    with served.client() as trainer:
        trainer.load(preset="gpt2_tiny", **SHAPE)
        whole = trainer.export_weights(home / "e0", changed_only=True)  # nothing to compare
        assert not whole["changed_only"] and len(whole["written"]) == whole["tensors"]
        same = trainer.export_weights(home / "e1", changed_only=True)
        assert same["changed_only"] and same["written"] == []
        trainer.step(served.batch(0))
        moved = trainer.export_weights(home / "e2", changed_only=True)
    before = load_file(home / "e0" / "model.safetensors")
    after = load_file(home / "e2" / "model.safetensors")
    changed = sorted(k for k in before if k in after and not torch.equal(before[k], after[k]))
    assert moved["written"] == sorted(after) and changed == sorted(after) and changed
    record = json.loads((home / "e2" / "dataflow_export.json").read_text())
    assert record["step"] == 1 and sorted(record["tensors"]) == sorted(before)


#: a client that sends one step request, says so, and waits for the answer it never reads
_KILLED_CLIENT = """
import json, socket, struct, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
body = json.dumps({"verb": "step", "args": {"batch": {"path": sys.argv[2]}}}).encode()
sock.sendall(struct.pack(">I", len(body)) + body)
print("sent", flush=True)
sock.recv(1)
"""


def test_a_client_killed_mid_step_loses_nothing(home):
    """The server holds each step 1.5 s before it runs it (a test hook), and the client is
    SIGKILLed in that time: the step completes, the server serves the next client, whose
    status says step 1 and whose next step continues the uninterrupted run."""
    served = Served(home / "run", env={"DATAFLOW_SERVE_SLOW_STEP": "1.5"})
    try:
        with served.client() as trainer:
            trainer.load(preset="gpt2_tiny", **SHAPE)
        client = subprocess.Popen(
            [sys.executable, "-c", _KILLED_CLIENT, str(served.socket), str(served.batch(0))],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout.readline().strip() == "sent"
        time.sleep(0.3)
        client.send_signal(signal.SIGKILL)
        client.wait()
        with served.client() as trainer:
            status = trainer.status()
            assert status["step"] == 1, status
            second = trainer.step(served.batch(1))["loss"]
            trainer.shutdown()
        code, output = served.wait()
    finally:
        served.stop()
    assert code == 0 and "client gone before its answer" in output, output
    assert [status["last_loss"], second] == pytest.approx(direct_losses(2), abs=ABS)


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _ask(sock: socket.socket, raw: bytes) -> dict:
    sock.sendall(raw)
    (length,) = struct.unpack(">I", _recv(sock, 4))
    return json.loads(_recv(sock, length))


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b"{not json", "message: not UTF-8 JSON"),
        (b"\xff\xfe", "message: not UTF-8 JSON"),
        (b"[1, 2]", "message: a JSON list"),
        (b'{"args": {}}', "verb: missing"),
        (b'{"verb": "fly"}', "verb: 'fly' is not one of load, step"),
        (b'{"verb": "status", "args": [1]}', "args: a JSON object"),
        (b'{"verb": "status", "colour": 1}', "colour: not a field of a request"),
        (b'{"verb": "status", "args": {"x": 1}}', "status: args.x: status takes no such field"),
        (b'{"verb": "step", "args": {}}', "step: no run is loaded"),
        (b'{"verb": "load", "args": {}}', "load: args.preset: missing"),
        (b'{"verb": "load", "args": {"preset": "gpt2_tiny", "batch": 0}}', "args.batch: 0 < 1"),
        (b'{"verb": "load", "args": {"preset": "gpt2_tiny", "budget": "lots"}}', "args.budget"),
        (b'{"verb": "restore", "args": {}, "id": 7}', "restore: no run is loaded"),
        (
            b'{"verb": "load", "args": {"preset": "gpt2_tiny", "budget": "64KiB"}}',
            "load: args.budget: 64 KiB is too small for this step: the smallest budget that",
        ),
    ],
)
def test_a_malformed_request_gets_one_line_naming_the_field(served, raw, named):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(served.socket))
        answer = _ask(sock, _frame(raw))
        assert answer["ok"] is False and named in answer["error"], answer
        assert "\n" not in answer["error"]
        # the connection goes on
        assert _ask(sock, _frame(b'{"verb": "status", "id": 2}'))["result"]["loaded"] is False


def test_bytes_that_are_no_frame_close_only_their_connection(served):
    with socket.socket(socket.AF_UNIX) as sock:  # a length past the limit: answered, closed
        sock.connect(str(served.socket))
        answer = _ask(sock, struct.pack(">I", 2**31))
        assert "past the limit" in answer["error"] and sock.recv(1) == b""
    with socket.socket(socket.AF_UNIX) as sock:  # half a frame, then gone
        sock.connect(str(served.socket))
        sock.sendall(_frame(b'{"verb": "shutdown"}')[:9])
    with served.client() as trainer:
        assert trainer.status()["loaded"] is False  # and it was not shut down


def test_sigterm_finishes_the_verb_saves_when_asked_and_removes_the_socket(home):
    """SIGTERM lands while a step runs (held 1.5 s by the test hook): the step completes
    and is answered, then the server saves its checkpoint and goes."""
    served = Served(home / "run", "--save-on-exit", env={"DATAFLOW_SERVE_SLOW_STEP": "1.5"})
    answers = []
    try:
        with served.client() as trainer:
            trainer.load(preset="gpt2_tiny", **SHAPE)
            stepping = threading.Thread(
                target=lambda: answers.append(trainer.step(served.batch(0)))
            )
            stepping.start()
            time.sleep(0.5)
            served.proc.send_signal(signal.SIGTERM)
            stepping.join(timeout=60)
        code, output = served.wait()
    finally:
        served.stop()
    assert code == 0, output
    assert [a["step"] for a in answers] == [1]
    assert json.loads((home / "run" / "step_000001" / "manifest.json").read_text())["step"] == 1
    assert not served.socket.exists() and "stopped (SIGTERM)" in output


def test_tcp_serves_only_requests_that_carry_the_token(home):
    token = "a-token-of-some-length"
    proc = subprocess.Popen(
        [DATAFLOW, "serve-trainer", "--out", str(home / "run"), "--tcp", "127.0.0.1:0"],
        env={**os.environ, "DATAFLOW_SERVE_TOKEN": token},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        address = line.split(" on tcp:")[1].split()[0]
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            answer = _ask(sock, _frame(b'{"verb": "status"}'))
            assert answer["error"] == "token: missing or wrong; closing the connection"
            assert sock.recv(1) == b""
        with TrainerClient(tcp=address, token="wrong" * 4) as trainer:
            with pytest.raises(ServiceError, match="^token: missing or wrong"):
                trainer.status()
        with TrainerClient(tcp=address, token=token) as trainer:
            assert trainer.status()["loaded"] is False
            trainer.shutdown()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_tcp_is_refused_without_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("DATAFLOW_SERVE_TOKEN", raising=False)
    result = invoke("serve-trainer", "--out", str(tmp_path / "r"), "--tcp", "127.0.0.1:0")
    assert_one_line_error(result, 1, "--tcp needs --token")
    short = invoke(
        "serve-trainer", "--out", str(tmp_path / "r"), "--tcp", "127.0.0.1:0", "--token", "x"
    )
    assert_one_line_error(short, 1, "--token")


def _read(tmp_path: Path, rounds: int = 1, kind: str | None = None, **tensors: torch.Tensor):
    # the batch reader in-process: what a step request's batch file becomes
    from dataflow_training.service.batches import read_batch
    from dataflow_training.step.config import TrainConfig

    path = tmp_path / "b.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    spec = {"path": str(path), **({} if kind is None else {"kind": kind})}
    return read_batch(spec, TrainConfig(seq_len=4, batch=2, rounds=rounds))


def test_a_tokens_batch_is_input_ids_or_inputs_and_targets_per_round(tmp_path):
    ids = torch.arange(3 * 2 * 5).reshape(3, 2, 5)
    rounds = _read(tmp_path, 3, input_ids=ids)
    assert len(rounds) == 3
    assert all(
        torch.equal(x, ids[r, :, :-1]) and torch.equal(y, ids[r, :, 1:])
        for r, (x, y) in enumerate(rounds)
    )
    ((x, y),) = _read(tmp_path, inputs=ids[0, :, :4].int(), targets=ids[0, :, 1:])
    assert x.dtype == torch.int64 and torch.equal(y, ids[0, :, 1:])


@pytest.mark.parametrize(
    ("kind", "tensors", "named"),
    [
        (None, {"input_ids": torch.zeros(2, 4, dtype=torch.int64)}, "input_ids has shape (2, 4)"),
        (None, {"input_ids": torch.zeros(2, 5)}, "input_ids is torch.float32"),
        (None, {"ids": torch.zeros(2, 5, dtype=torch.int64)}, "holds ids; a tokens batch is"),
        ("rollouts", {"input_ids": torch.zeros(2, 5, dtype=torch.int64)}, "kind: 'rollouts'"),
    ],
)
def test_a_bad_batch_file_is_named(tmp_path, kind, tensors, named):
    from dataflow_training.service.protocol import ProtocolError

    with pytest.raises(ProtocolError, match=r"^args\.batch\.") as caught:
        _read(tmp_path, kind=kind, **tensors)
    assert named in str(caught.value)


def test_the_socket_file_appears_only_once_it_accepts(home):
    # a client waiting for the file (as docs/extending_programs.md's loop does) connects at
    # once: a file bound but not yet listening refuses, which CI once caught
    from dataflow_training.service.server import unix_listener

    path = home / "t.sock"
    refused = []

    def connect() -> None:
        while not path.exists():
            pass
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.connect(str(path))
            except ConnectionRefusedError:
                refused.append(path)

    for _ in range(200):
        watcher = threading.Thread(target=connect)
        watcher.start()
        listener = unix_listener(path)
        watcher.join(10)
        assert sorted(p.name for p in home.iterdir()) == ["t.sock"]  # no staging name left
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        listener.close()
        path.unlink()
    assert refused == []


def test_a_staging_socket_of_a_killed_server_is_removed_and_a_live_ones_kept(home):
    # a server killed between its bind (at ``.NAME.PID``) and its rename left that file; the
    # next server at the path removes it, and leaves one whose process still runs
    from dataflow_training.service.server import unix_listener

    bind = (
        "import os, socket, sys, time; s = socket.socket(socket.AF_UNIX); "
        "s.bind(os.path.join(sys.argv[1], f'.t.sock.{os.getpid()}')); print('bound', flush=True); "
        "time.sleep(60)"
    )
    staged = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", bind, str(home)], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"bound\n"
        staged.append(proc)
    killed, live = staged
    killed.kill()
    killed.wait()
    try:
        listener = unix_listener(home / "t.sock")
        listener.close()
        assert sorted(p.name for p in home.iterdir()) == [f".t.sock.{live.pid}", "t.sock"]
    finally:
        live.kill()
        live.wait()


def _served(out: Path):
    """A ``ServedRun`` in this process (the verbs without the socket)."""
    import io

    from dataflow_training.service.served_run import ServedRun

    out.mkdir(parents=True)  # the server's run folder (it makes and claims it)
    return ServedRun(out, log=io.StringIO())


def test_a_served_lora_run_trains_as_train_does_and_exports_the_adapters_merged(tmp_path) -> None:
    """``load`` with ``lora`` and ``freeze`` runs ``dataflow train``'s LoRA step (the same
    losses as a direct run of those options); ``export_weights`` writes what an inference
    engine reloads: HF tensors with the adapters merged, no adapter tensors."""
    from dataflow_training.drive.peft_export import base_state, merged
    from dataflow_training.service.weights_export import EXPORT_FILE, export_weights
    from dataflow_training.step.lora import LoraConfig

    served = _served(tmp_path / "run")
    trains = {"lora": 4, "lora_alpha": 8.0, "freeze": ["embed"]}
    served.load({"preset": "gpt2_tiny", **SHAPE, **trains})
    options = TrainOptions(
        family="gpt2", preset="gpt2_tiny", steps=0, out=tmp_path / "direct", device="cpu",
        batch=SHAPE["batch"], seq_len=SHAPE["seq_len"], lr=SHAPE["lr"], lora=4, lora_alpha=8.0,
        freeze=("embed",),
    )  # fmt: skip
    direct = TrainingRun(options.compile(load_family("gpt2")), seed=SHAPE["seed"])
    for step in range(2):
        path = write_token_batch(tmp_path / f"b{step}.safetensors", _ids(step))
        loss = served.step({"batch": {"kind": "tokens", "path": str(path)}})["loss"]
        ids = _ids(step)
        assert loss == pytest.approx(direct.step([(ids[:, :-1], ids[:, 1:])]).loss, abs=ABS)
    exported = served.export_weights({"path": str(tmp_path / "export")})
    want = merged(direct.weights(), LoraConfig(4, 8.0))
    family = load_family("gpt2")
    config = family.config("gpt2_tiny")
    export_weights(
        family, config, want, tmp_path / "want", step=2, previous=None, changed_only=False
    )
    record = json.loads((tmp_path / "export" / EXPORT_FILE).read_text())
    assert record["tensors"] == json.loads((tmp_path / "want" / EXPORT_FILE).read_text())["tensors"]
    assert not any("lora" in name for name in exported["written"])
    base = base_state(direct.weights())
    assert any(not torch.equal(want[k], base[k]) for k in want)  # the adapters trained


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"lora_alpha": 8.0}, "args.lora_alpha: needs args.lora"),
        ({"lora": 0}, "args.lora"),
        ({"freeze": ["nothing.here"]}, "args.freeze: --freeze nothing.here"),
        ({"freeze": "embed"}, "args.freeze"),
        ({"lora": 4, "lora_targets": ["q_proj"]}, "args.lora_targets"),
        ({"optimizer": "lion", "optimizer_args": {"zz": 1}}, "args.optimizer_args.zz"),
        ({"optimizer": "adam9"}, "args.optimizer: unknown optimizer 'adam9'"),
    ],
)
def test_what_a_load_trains_is_checked_naming_the_field(tmp_path, fields, named) -> None:
    from dataflow_training.service.protocol import ProtocolError

    served = _served(tmp_path / "run")
    with pytest.raises(ProtocolError) as caught:
        served.load({"preset": "gpt2_tiny", **SHAPE, **fields})
    assert named in str(caught.value) and "\n" not in str(caught.value)
    assert served.run is None  # a load that fails leaves nothing loaded
