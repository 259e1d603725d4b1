"""The one error every feed raises for bad data: a ``ValueError`` naming the file or spec."""

from __future__ import annotations


class FeedError(ValueError):
    """A missing path, an empty folder, a corrupt or truncated shard, a saved position
    of another dataset: the message names the file or spec and what is wrong."""
