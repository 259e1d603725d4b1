"""The module the ``dataflow`` entry point names: it only registers the deepseek_v3 and
deepseek_v32 families (the model code loads when a family is used)."""

from dataflow_training.kit import family_plugin

from dataflow import hookimpl

#: each family's spec (``family_plugin`` makes a hook of one; this module's hook is both)
_SPECS = [
    *family_plugin(
        "deepseek_v3",
        "DeepSeek V3 architecture (MLA; dense then MoE blocks, sigmoid routing with a "
        "load-balancing bias, group-limited top-k, a shared expert; tiny, Moonlight-16B-A3B, "
        "671B, Kimi K2 1T, an H200 cut); HF safetensors import/export",
        "dataflow_family_deepseek.family:DeepseekV3Family",
    )(),
    *family_plugin(
        "deepseek_v32",
        "DeepSeek V3.2 architecture (DeepSeek V3 with sparse attention: a lightning indexer "
        "selects each query's top-k tokens, trained by a KL loss to the attention; tiny, "
        "671B, an H200 cut); HF safetensors import/export",
        "dataflow_family_deepseek.family_v32:DeepseekV32Family",
    )(),
]


@hookimpl
def dataflow_families() -> list:
    return list(_SPECS)
