"""dataflow-planner-example: the keep-all planner, as a third-party dataflow plugin.

The entry point is ``dataflow_planner_example.plugin``; the planner itself is
``dataflow_planner_example.keep_all``.
"""
