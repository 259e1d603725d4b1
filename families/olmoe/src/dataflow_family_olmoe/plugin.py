"""The module the ``dataflow`` entry point names: it only registers the olmoe family (the
model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "olmoe",
    "OLMoE mixture of experts (1B-7B, a tiny CPU preset); HF safetensors import/export",
    "dataflow_family_olmoe.family:OlmoeFamily",
)
