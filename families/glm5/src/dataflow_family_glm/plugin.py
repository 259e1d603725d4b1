"""The module the ``dataflow`` entry point names: it only registers the glm5 family (the
model code loads when a family is used)."""

from dataflow_training.kit import family_plugin

dataflow_families = family_plugin(
    "glm5",
    "GLM 5 architecture (DeepSeek V3.2's sparse attention with index sharing: a "
    "'shared' layer attends to an earlier layer's top-k and joins its indexer's KL "
    "target; tiny, the 78-layer GLM 5, an H200 cut); HF safetensors import/export",
    "dataflow_family_glm.family:Glm5Family",
)
