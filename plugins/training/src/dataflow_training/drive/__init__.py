"""The executables, the driver of a compiled step and its components (imports step, kit, plan)."""
