from __future__ import annotations

from pathlib import Path

from dataflow.testing import FeedConformance

DATA = Path(__file__).parent / "data"


class TestFeedShards(FeedConformance):
    distribution = "dataflow-feed-shards"
    expected_names = ("embedded", "shards", "text")
    feed_locations = {
        "shards": str(DATA / "shards"),
        "text": str(DATA / "text"),
        "embedded": "python-stdlib",
    }
