"""The llm.c token shard: a header of 256 int32, then the tokens.

``header[0]`` is the magic, ``header[1]`` the version, ``header[2]`` the token count:

- magic 20240520, version 1: tokens are uint16 (a vocabulary of at most 65,536);
- magic 20240801, version 7: tokens are uint32.

``read_shard`` memory-maps the tokens after checking the header against the file's size;
whatever is wrong is one ``FeedError`` naming the file. ``write_shard`` writes a shard
under a temporary name and renames it once complete.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dataflow_feed_shards.errors import FeedError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
#: version -> (magic, token dtype)
VERSIONS: dict[int, tuple[int, np.dtype]] = {
    1: (20240520, np.dtype("<u2")),
    7: (20240801, np.dtype("<u4")),
}
MAGICS = {magic: version for version, (magic, _) in VERSIONS.items()}
#: The largest vocabulary version 1 (uint16 tokens) holds.
UINT16_VOCAB = 1 << 16


def version_for(vocab_size: int) -> int:
    """The shard version whose token type holds ids below ``vocab_size``."""
    return 1 if vocab_size <= UINT16_VOCAB else 7


def read_header(path: Path) -> tuple[int, int]:
    """(version, token count) of the shard at ``path``, checked against its size."""
    size_bytes = path.stat().st_size
    if size_bytes < HEADER_BYTES:
        raise FeedError(
            f"{path}: truncated header ({size_bytes} bytes; an llm.c shard starts with a "
            f"{HEADER_BYTES}-byte header)"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, tokens = (int(value) for value in header[:3])
    if magic not in MAGICS:
        raise FeedError(
            f"{path}: bad magic {magic} (an llm.c shard has 20240520 for version 1 or "
            "20240801 for version 7): not a token shard"
        )
    if version != MAGICS[magic]:
        raise FeedError(
            f"{path}: bad version {version} for magic {magic} (expected {MAGICS[magic]})"
        )
    if tokens < 0:
        raise FeedError(f"{path}: corrupt header: token count {tokens} is negative")
    itemsize = VERSIONS[version][1].itemsize
    held, stray = divmod(size_bytes - HEADER_BYTES, itemsize)
    if held < tokens or stray:
        piece = f" tokens and {stray} stray byte(s)" if stray else ""
        raise FeedError(
            f"{path}: truncated: the header says {tokens} tokens but the file holds {held}{piece}"
        )
    if held > tokens:
        raise FeedError(
            f"{path}: corrupt: the header says {tokens} tokens but the file holds {held} "
            "(trailing bytes after the tokens)"
        )
    return version, tokens


def read_shard(path: Path) -> np.ndarray:
    """The tokens of the shard at ``path``, memory-mapped read-only."""
    version, tokens = read_header(path)
    if tokens == 0:
        return np.zeros(0, dtype=VERSIONS[version][1])
    return np.memmap(path, dtype=VERSIONS[version][1], mode="r", offset=HEADER_BYTES, shape=tokens)


def write_shard(path: Path, tokens: np.ndarray, version: int) -> None:
    """Write ``tokens`` as a shard of ``version`` (1: uint16, 7: uint32) at ``path``."""
    magic, dtype = VERSIONS[version]
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise FeedError(
            f"{path}: token id {int(tokens.max())} does not fit a version {version} shard "
            f"({dtype.name}); use version 7"
        )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, tokens.size)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(header.tobytes())
        out.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
        out.flush()
        os.fsync(out.fileno())
    partial.replace(path)
