"""Making a rename or a new file survive a crash: ``fsync_path`` flushes a file's or a
folder's entry to disk (a folder's: the names created, renamed or removed in it), what a
checkpoint and a prepared dataset do after their atomic rename into place."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """``fsync`` the file or folder at ``path`` (opened read-only, then closed)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
