"""The module the ``dataflow`` entry point names: it only registers the deepseek_v3 family
(the model code loads when the family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "deepseek_v3",
    "DeepSeek V3 architecture (MLA; dense then MoE blocks, sigmoid routing with a "
    "load-balancing bias, group-limited top-k, a shared expert; tiny, Moonlight-16B-A3B, "
    "671B, Kimi K2 1T, an H200 cut); HF safetensors import/export",
    "dataflow_family_deepseek.family:DeepseekV3Family",
)
