"""How the event loop encodes each object's state (docs/execution_model.md, Object state).

Small ints in plain lists, one entry per object index: ``fast[o]`` is ABSENT, INCOMING
(a prefetch reserved its bytes and is running) or RESIDENT; ``slow[o]`` is ABSENT,
CURRENT (holds the latest value) or STALE.
"""

ABSENT = 0
INCOMING = 1
RESIDENT = 2
CURRENT = 1
STALE = 2
