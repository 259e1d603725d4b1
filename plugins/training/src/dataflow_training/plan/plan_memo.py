"""Plans kept for the rest of the process, by what they were made of.

The step search (``plan.search``) plans each candidate as ``compile_step`` would: the
same lowering, the same pricing, the same planner at the same budget. ``compile_step``
would then plan the chosen shape again, which for a large model is seconds of a core
(Llama 3 8B's 16-round step). The search leaves the chosen shape's plans here (one for
each slow budget it planned it in, ``Searcher.keep_plan``), and ``compile_step``, told
the slow budget the search chose (``first_slow_bytes``), takes the one whose program,
budget and options are its own
(``plan_key``: a digest of the program's JSON and of them), so nothing is planned twice
and nothing stale is taken: a program priced otherwise (other profiles, other links)
has another key.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from dataflow import Plan, Program

#: Plans kept at most (the chosen shape's of each search, one for each slow budget it was
#: planned in, ``compile_step``'s ``FIT_POOL_TRIES`` + 1 at most; a process searches once
#: a run)
KEPT = 8

_plans: OrderedDict[str, Plan] = OrderedDict()


def plan_key(program: Program, budget_bytes: int, planner: str, options: dict[str, Any]) -> str:
    """What a plan was made of: ``program`` (its JSON: tasks, costs, objects, links),
    the fast budget, the planner's name and its options (slow budget, cyclic)."""
    digest = hashlib.sha256(program.to_json(indent=None).encode())
    digest.update(json.dumps([budget_bytes, planner, sorted(options.items())]).encode())
    return digest.hexdigest()


def plan_options(slow_budget_bytes: int | None, *, cyclic: bool) -> dict[str, Any]:
    """``plan``'s options as ``compile_step`` and the search give them (and key them)."""
    options: dict[str, Any] = {"cyclic": cyclic}
    if slow_budget_bytes is not None:
        options["slow_budget_bytes"] = slow_budget_bytes
    return options


def remember(key: str, planned: Plan) -> None:
    _plans[key] = planned
    _plans.move_to_end(key)
    while len(_plans) > KEPT:
        _plans.popitem(last=False)


def recall(key: str) -> Plan | None:
    """The plan made of ``key``'s parts in this process, if one was kept."""
    return _plans.get(key)
