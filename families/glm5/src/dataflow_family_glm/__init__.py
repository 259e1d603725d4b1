"""GLM 5 (``GlmMoeDsaForCausalLM``) as a dataflow model family: DeepSeek V3.2's sparse
attention with index sharing across layers."""

__all__: list[str] = []
