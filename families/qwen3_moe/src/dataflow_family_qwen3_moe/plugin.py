"""The module the ``dataflow`` entry point names: it only registers the qwen3_moe family (the
model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "qwen3_moe",
    "Qwen 3 MoE (30B-A3B, a 12-layer cut, a tiny CPU preset); HF safetensors import/export",
    "dataflow_family_qwen3_moe.family:Qwen3MoeFamily",
)
