"""The module the ``dataflow`` entry point names: it only registers the qwen3_5_moe family
(the model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "qwen3_5_moe",
    "Qwen 3.5 MoE (Gated DeltaNet + gated full attention, 3:1; 256 experts, top-8, a gated "
    "shared expert; 35B-A3B, a 4-layer cut, a tiny CPU preset); HF safetensors import/export",
    "dataflow_family_qwen3_5_moe.family:Qwen3_5MoeFamily",
)
