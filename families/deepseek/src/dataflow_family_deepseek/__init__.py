"""dataflow-family-deepseek: DeepSeek V3's architecture as a dataflow model family: its
presets (a tiny CPU one, Moonlight-16B-A3B, DeepSeek V3 671B, Kimi K2, a cut for one
H200), its config (the kit's multi-head latent attention, dense then sigmoid-routed MoE
blocks) and the ``config.json`` of ``DeepseekV3ForCausalLM``."""
