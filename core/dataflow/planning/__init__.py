"""Planning: PressureFit, lower bounds, the minimal budget, and static placement.

``plan(program, budget_bytes)`` returns a ``Plan`` (annotated program, its simulation, the
lower bound, planning time); ``place(plan)`` packs every fast-resident interval into one
arena. Pure Python: importing it never imports torch.
"""

from dataflow.planning.api import DEFAULT_PLANNER, Plan, plan
from dataflow.planning.feasibility import InfeasibleBudget, minimal_budget
from dataflow.planning.intervals import PlanningError
from dataflow.planning.lower_bound import LowerBound, lower_bound
from dataflow.planning.placement import Block, Placement, place

__all__ = [
    "DEFAULT_PLANNER",
    "Block",
    "InfeasibleBudget",
    "LowerBound",
    "Placement",
    "Plan",
    "PlanningError",
    "lower_bound",
    "minimal_budget",
    "place",
    "plan",
]
