"""The module the ``dataflow`` entry point names: it only registers the llama3 family (the
model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "llama3",
    "Llama 3 (3.2 1B and 3B, 3.1 8B, a tiny CPU preset); HF safetensors import/export",
    "dataflow_family_llama3.family:Llama3Family",
)
