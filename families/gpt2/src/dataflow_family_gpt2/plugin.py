"""The module the ``dataflow`` entry point names: it only registers the gpt2 family (the
model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "gpt2",
    "GPT-2 (124M to 1.5B, and a tiny CPU preset); HF safetensors import/export",
    "dataflow_family_gpt2.family:GPT2Family",
)
