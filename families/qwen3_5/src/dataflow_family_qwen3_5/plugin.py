"""The module the ``dataflow`` entry point names: it only registers the qwen3_5 family (the
model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "qwen3_5",
    "Qwen 3.5 dense (Gated DeltaNet + gated full attention, 3:1; a tiny CPU preset); "
    "HF safetensors import/export",
    "dataflow_family_qwen3_5.family:Qwen3_5Family",
)
