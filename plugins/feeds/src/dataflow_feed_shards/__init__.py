"""dataflow-feed-shards: data feeds for dataflow (llm.c shards, text, the embedded
Python-stdlib corpus) and ``dataflow data prepare``. See docs/feeds.md.

Nothing is imported here: the entry-point module (``plugin``) must stay light.
"""

__version__ = "0.1.0"
