"""The shared family kit: what every model family would otherwise retype.

This package's ``__init__`` is the facade for family and kit authors (docs/api.md): the
family protocol a family implements, the ops its math gets, the parts a block is composed
of, the decoder and MoE configs and families a preset subclasses, HF checkpoints by key
table, and ``family_plugin`` for the entry-point module. Import from here, never from a
submodule. Light (a family's entry point imports it for ``family_plugin``): each name is
imported from its module when first used, so only a used part imports torch.
"""

from dataflow import exported, lazy_exports

#: Each public name by its home module, imported when the name is first used.
_HOMES = {
    # the family protocol
    "dataflow_training.step.family": (
        "Family",
        "EmbedMath",
        "BlockMath",
        "HeadMath",
        "LayerSpec",
        "ParamGroup",
        "TensorSpec",
        "Env",
        "RowGradient",
        "RowPieces",
        "LayerCost",
        "Work",
        "PartialSave",
        "partial_saves",
        "FamilyContractError",
        "embed_layer",
        "head_layer",
    ),
    "dataflow_training.step.ops": ("load_ops", "Ops", "STANDARD_OPS", "MissingOpError"),
    # parts and their ops
    "dataflow_training.kit.attention": (
        "SelfAttention",
        "QKNorm",
        "OutputGate",
        "ChunkedMask",
        "attention_forward",
        "attention_backward",
        "split_heads",
        "merge_heads",
        "attention_flops",
    ),
    "dataflow_training.kit.fused_attention": ("FusedQKVAttention",),
    "dataflow_training.kit.linear_attention": (
        "GatedDeltaNet",
        "LinearAttentionConfig",
        "delta_rule_flops",
    ),
    "dataflow_training.kit.norms": ("Norm", "LayerNorm", "RMSNorm"),
    "dataflow_training.kit.rotary": ("Rope", "Llama3Scaling"),
    "dataflow_training.kit.segments": ("Segments", "packed_documents"),
    "dataflow_training.kit.mlp": ("SwiGLUFFN", "SwiGLU", "GELUFFN"),
    "dataflow_training.kit.moe": (
        "RoutedExperts",
        "SharedExpert",
        "MoEConfig",
        "MoEFields",
        "moe_expected_state",
        "moe_parameter_count",
        "moe_active_parameter_count",
        "EXPERTS_GROUP",
    ),
    "dataflow_training.kit.linear": (
        "Linear",
        "linear_backward",
        "accumulation_dtype",
        "projections_backward",
    ),
    "dataflow_training.kit.head": ("lm_head_loss", "IGNORE_INDEX"),
    "dataflow_training.kit.parts": ("FfnCost", "as_is", "conv1d", "values_per_token", "ops_of"),
    "dataflow_training.kit.block": ("Block",),
    # decoders
    "dataflow_training.kit.decoder": (
        "Decoder",
        "DecoderConfig",
        "flag",
        "sliding_window_field",
        "layer_types_field",
        "layer_specs",
        "head_params",
        "expected_state",
        "parameter_count",
        "EMBED",
        "HEAD",
        "LAYER_TYPES",
    ),
    "dataflow_training.kit.decoder_math": (
        "DecoderEmbed",
        "LearnedPositions",
        "DecoderHead",
        "head_cost",
        "padded_vocab",
        "vocab_table",
        "vocab_multiple_field",
        "VOCAB_MULTIPLE",
        "EMBED_WEIGHT",
        "LM_HEAD",
        "FINAL_NORM",
    ),
    "dataflow_training.kit.decoder_reference": ("DecoderReference",),
    "dataflow_training.kit.decoder_family": ("DecoderFamily", "UnknownPresetError"),
    "dataflow_training.kit.decoder_hf": (
        "key_map",
        "fields_from_hf",
        "fields_to_hf",
        "HF_DEFAULTS",
        "window_fields_from_hf",
        "window_fields_to_hf",
        "check_full_attention",
        "full_attention_fields",
        "import_decoder",
        "export_decoder",
    ),
    "dataflow_training.kit.moe_family": ("MoEFamily", "moe_key_map"),
    "dataflow_training.kit.mla": ("LatentAttention", "MLAFields", "YarnScaling"),
    "dataflow_training.kit.sigmoid_moe": (
        "SigmoidExperts",
        "SigmoidMoEFields",
        "GroupLimitedRouter",
        "SharedExperts",
    ),
    "dataflow_training.kit.sigmoid_moe_reference": ("SigmoidMoEReference",),
    "dataflow_training.kit.dsa": (
        "DSAFields",
        "IndexedAttention",
        "SharedIndexAttention",
        "IndexedBlock",
    ),
    "dataflow_training.kit.dsa_reference": ("DSAReference",),
    "dataflow_training.kit.hybrid": (
        "HybridConfig",
        "HybridFamily",
        "hybrid_layer_types",
        "GATED_ATTENTION",
        "ZERO_CENTRED",
        "FULL_ATTENTION_INTERVAL",
    ),
    "dataflow_training.kit.moe_reference": ("MoEReference",),
    # HF checkpoints
    "dataflow_training.kit.hf": (
        "CheckpointError",
        "read_state",
        "write_state",
        "read_config",
        "write_config",
        "checkpoint_folder",
        "SAFETENSORS",
        "SAFETENSORS_INDEX",
        "CONFIG",
        "PICKLE_SUFFIXES",
    ),
    "dataflow_training.kit.hf_keys": (
        "KeyMap",
        "KeyRule",
        "Conversion",
        "IDENTITY",
        "TRANSPOSE",
        "offset",
    ),
    # the entry-point module
    "dataflow_training.kit.plugin": ("family_plugin",),
}

__all__ = exported(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
