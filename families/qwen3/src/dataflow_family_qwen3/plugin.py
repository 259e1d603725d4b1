"""The module the ``dataflow`` entry point names: it only registers the qwen3 family (the
model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "qwen3",
    "Qwen 3 dense (0.6B to 8B, a tiny CPU preset); HF safetensors import/export",
    "dataflow_family_qwen3.family:Qwen3Family",
)
