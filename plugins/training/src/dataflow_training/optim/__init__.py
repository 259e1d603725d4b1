"""The builtin optimizers (``builtins.OPTIMIZERS``, registered through the
``dataflow_optimizers`` hook): AdamW and its compensated bf16 form, Muon (with AdamW for
what is not a hidden matrix), Lion and Adafactor. Each update is a function over the lists
of one parameter group's tensors; ``step.optimizers`` looks a spec up by name."""
