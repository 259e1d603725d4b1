"""The wire protocol of ``dataflow serve-trainer`` (docs/engine_service.md): framing and the
shape of a request, on both ends. Light: no torch.

A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON, one object. A
request is ``{"verb": ..., "args": {...}, "id": ...}`` (``args`` and ``id`` optional; a
server with a token wants ``"token"`` too); its answer ``{"id": ..., "ok": true, "result":
...}`` or ``{"id": ..., "ok": false, "error": "one line"}``. Tensors travel as paths of
safetensors files, never inline: nothing on the socket is ever unpickled.

Framing errors and request errors differ in what follows them. A message whose body is
not a JSON object, or a request with an unknown verb or a missing or mistyped field, is
answered with an error and the connection goes on (the frame was whole). A length past
``MAX_MESSAGE_BYTES`` cannot be skipped safely: it is answered and the connection closed.
"""

from __future__ import annotations

import hmac
import json
import math
import socket
import struct
from collections.abc import Mapping
from typing import Any

#: the header of every message: its body's length in bytes
HEADER = struct.Struct(">I")
#: the longest body either end accepts (requests and answers are small: tensors go by path)
MAX_MESSAGE_BYTES = 16 * 2**20
#: the socket a server makes in its run folder unless ``--socket`` names another
SOCKET_NAME = "trainer.sock"


class ProtocolError(ValueError):
    """A request that cannot be served: the one-line error its answer carries. ``fatal``:
    the connection cannot go on (the framing is lost)."""

    def __init__(self, message: str, *, fatal: bool = False, id: Any = None) -> None:
        super().__init__(message)
        self.fatal, self.id = fatal, id


class Disconnected(ConnectionError):
    """The other end closed the connection (between messages, or inside one)."""


def send_message(sock: socket.socket, message: Mapping[str, Any]) -> None:
    """Send ``message`` as one frame; non-finite floats go as null (strict JSON)."""
    body = json.dumps(_plain(message), allow_nan=False, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes is past {MAX_MESSAGE_BYTES}")
    sock.sendall(HEADER.pack(len(body)) + body)


def read_message(sock: socket.socket) -> dict[str, Any]:
    """The next frame's JSON object. ``Disconnected`` when the other end closed (at a frame
    boundary or inside a frame: a partial frame is never served); ``ProtocolError`` when
    the frame is whole but not a JSON object (fatal when its length is past the limit)."""
    (length,) = HEADER.unpack(_exactly(sock, HEADER.size))
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"message: length {length} is past the limit of {MAX_MESSAGE_BYTES} bytes "
            "(4-byte big-endian length, then UTF-8 JSON); closing the connection",
            fatal=True,
        )
    body = _exactly(sock, length)
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"message: not UTF-8 JSON ({_short(exc)})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"message: a JSON {type(message).__name__}, not an object")
    return message


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            raise Disconnected("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def parse_request(
    message: Mapping[str, Any], verbs: Mapping[str, Any], token: str | None
) -> tuple[Any, str, dict[str, Any]]:
    """``(id, verb, args)`` of a request; a ``ProtocolError`` naming the field otherwise.
    ``verbs``: the known verb names; ``token``: what ``"token"`` must be (None: none)."""
    request_id = message.get("id")
    if request_id is not None and not isinstance(request_id, (str, int)):
        raise ProtocolError("id: a string or an integer (or left out)")
    unknown = sorted(set(message) - {"verb", "args", "id", "token"})
    if unknown:
        raise ProtocolError(
            f"{unknown[0]}: not a field of a request (verb, args, id, token)", id=request_id
        )
    if token is not None and not _same(message.get("token"), token):
        # every request: a connection is never trusted on the strength of an earlier one
        raise ProtocolError("token: missing or wrong; closing the connection", fatal=True)
    verb = message.get("verb")
    if not isinstance(verb, str):
        raise ProtocolError(
            "verb: missing (a string: one of " + ", ".join(verbs) + ")", id=request_id
        )
    if verb not in verbs:
        raise ProtocolError(f"verb: {verb!r} is not one of {', '.join(verbs)}", id=request_id)
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(f"args: a JSON object, not {type(args).__name__}", id=request_id)
    return request_id, verb, args


def _same(given: Any, token: str) -> bool:
    # constant time: a wrong guess learns nothing of the token
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())


#: ``field(args, name, kind)`` without a default: the field must be there
REQUIRED = object()

_KINDS = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    dict: "a JSON object",
    list: "a JSON array",
}


def field(
    args: Mapping[str, Any], name: str, kind: type, default: Any = REQUIRED, *, where: str = "args"
) -> Any:
    """``args[name]`` checked to be of ``kind`` (an int is a float too; None is the default
    where there is one); a ``ProtocolError`` naming ``WHERE.NAME`` otherwise."""
    value = args.get(name)
    name = f"{where}.{name}"
    if value is None:
        if default is REQUIRED:
            raise ProtocolError(f"{name}: missing ({_KINDS[kind]})")
        return default
    fits = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, fits = float(value), True
    if not fits:
        raise ProtocolError(f"{name}: {_KINDS[kind]}, not {json.dumps(value)[:60]}")
    return value


def no_other_fields(
    args: Mapping[str, Any], known: tuple[str, ...], what: str, *, where: str = "args"
) -> None:
    """A ``ProtocolError`` naming the first field of ``args`` that ``what`` does not take."""
    unknown = sorted(set(args) - set(known))
    if unknown:
        taken = ", ".join(known) or "none"
        raise ProtocolError(f"{where}.{unknown[0]}: {what} takes no such field (it takes: {taken})")


def _plain(value: Any) -> Any:
    """``value`` with every non-finite float as None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120]
