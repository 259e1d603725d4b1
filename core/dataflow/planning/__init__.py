"""Planning: PressureFit, lower bounds, the minimal budget, and static placement.

``plan(program, budget_bytes, planner=...)`` returns a ``Plan`` (annotated program, its
simulation, the lower bound, planning time; ``cyclic=True`` plans one iteration of a loop);
``place(plan)`` packs every fast-resident interval into one arena. Pure Python: importing
it never imports torch.
"""

from dataflow.planning.api import DEFAULT_PLANNER, PRESSUREFIT, minimal_budget, place, plan
from dataflow.planning.arena import Block
from dataflow.planning.cycle import CycleCheck, check_cycle, unroll
from dataflow.planning.cyclic import fast_homes
from dataflow.planning.feasibility import InfeasibleBudget
from dataflow.planning.intervals import PlanningError
from dataflow.planning.lower_bound import LowerBound, lower_bound
from dataflow.planning.placement import Placement, without_workspace
from dataflow.planning.plans import Plan, Planner

__all__ = [
    "DEFAULT_PLANNER",
    "PRESSUREFIT",
    "Block",
    "CycleCheck",
    "InfeasibleBudget",
    "LowerBound",
    "Placement",
    "Plan",
    "Planner",
    "PlanningError",
    "lower_bound",
    "minimal_budget",
    "check_cycle",
    "fast_homes",
    "place",
    "plan",
    "unroll",
    "without_workspace",
]
