"""Parts no builtin family composes yet, composed here into decoders and held to
``transformers``: Qwen3-Next's full attention (``Qwen3NextForCausalLM`` with every layer
``full_attention``), which takes four of them: the attention's sigmoid ``OutputGate``,
partial rotary positions (``Rope(0.25)``: a quarter of each head), zero-centred RMSNorms
(``Norm(offset=1.0)``: stored ``w``, scaling by ``1 + w``) in the blocks, on the q/k norms
and in the head, and, in its MoE layers, a sigmoid-gated ``SharedExpert`` beside the
routed ones. Each family below is a whole kit family of a few lines (registered on a
plugin manager of the test's own); each runs the kit's HF parity tests (logits, one AdamW
step, export bit-exact; the MoE's balance term) and the whole verify ladder."""

from __future__ import annotations

import types
from typing import ClassVar

import attrs
import pytest
from dataflow_training.kit.attention import OutputGate, QKNorm, SelfAttention
from dataflow_training.kit.block import Block
from dataflow_training.kit.decoder import Decoder, DecoderConfig
from dataflow_training.kit.decoder_family import DecoderFamily
from dataflow_training.kit.mlp import SwiGLUFFN
from dataflow_training.kit.moe import MoEConfig, RoutedExperts, SharedExpert
from dataflow_training.kit.moe_family import MoEFamily
from dataflow_training.kit.norms import Norm
from dataflow_training.kit.plugin import family_plugin
from dataflow_training.kit.rotary import Rope
from dataflow_training.testing.decoder import DecoderHFParity
from dataflow_training.testing.moe import MoEHFParity

pytest.importorskip("dataflow_kernels_torch")

ZERO_CENTRED = Norm(offset=1.0)
ATTENTION = SelfAttention(
    qk_norm=QKNorm("head", ZERO_CENTRED), positions=Rope(0.25), gate=OutputGate()
)


@attrs.frozen
class NextConfig(DecoderConfig):
    architecture: ClassVar[Decoder] = Decoder(
        {"block": Block(ATTENTION, SwiGLUFFN(), ZERO_CENTRED)}, norm=ZERO_CENTRED
    )


@attrs.frozen
class NextMoEConfig(MoEConfig):
    shared_expert_intermediate_size: int = attrs.field(default=24, kw_only=True)
    architecture: ClassVar[Decoder] = Decoder(
        {"moe": Block(ATTENTION, RoutedExperts(shared=SharedExpert()), ZERO_CENTRED)},
        norm=ZERO_CENTRED,
    )


class NextFamily(DecoderFamily):
    name = "next_like"
    presets = {
        "next_tiny": NextConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=128,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    }
    config_class = NextConfig
    hf_class = "Qwen3NextForCausalLM"
    hf_model_type = "qwen3_next"

    def config_to_hf(self, config, dtype):
        return next_fields(super().config_to_hf(config, dtype), config, dense=True)


def next_fields(fields, config, *, dense):
    """Qwen3-Next's own ``config.json`` fields: a quarter of each head rotated, every layer
    full attention, every FFN dense (or every one routed)."""
    layers = config.num_hidden_layers
    rope = {**fields["rope_parameters"], "partial_rotary_factor": 0.25}
    return fields | {
        "rope_parameters": rope,
        "partial_rotary_factor": 0.25,
        "layer_types": ["full_attention"] * layers,
        "mlp_only_layers": list(range(layers)) if dense else [],
    }


_NEXT_MOE_HF = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}


class NextMoEFamily(MoEFamily):
    name = "next_moe_like"
    presets = {
        "next_moe_tiny": NextMoEConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=128,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            router_aux_loss_coef=0.01,
        )
    }
    config_class = NextMoEConfig
    hf_class = "Qwen3NextForCausalLM"
    hf_model_type = "qwen3_next"
    hf_defaults = _NEXT_MOE_HF
    hf_expert_width = "moe_intermediate_size"

    def hf_fields(self, hf, source):
        width = "shared_expert_intermediate_size"
        return super().hf_fields(hf, source) | {width: hf.get(width, self.hf_defaults[width])}

    def config_to_hf(self, config, dtype):
        fields = next_fields(super().config_to_hf(config, dtype), config, dense=False)
        return fields | {"shared_expert_intermediate_size": config.shared_expert_intermediate_size}


@pytest.fixture(autouse=True)
def _registered(isolated_plugin_manager):
    """The families registered for the test beside the plugins a step runs on (what
    installed packages' entry points do)."""
    kernels = pytest.importorskip("dataflow_kernels_torch.plugin")
    resolver = pytest.importorskip("dataflow_resolver_torch.plugin")
    from dataflow_training import plugin as training

    families = [
        types.SimpleNamespace(dataflow_families=family_plugin(name, "a test", family))
        for name, family in (("next_like", NextFamily), ("next_moe_like", NextMoEFamily))
    ]
    isolated_plugin_manager(*families, kernels, resolver, training)


class TestGatedAttentionParity(DecoderHFParity):
    family_name = "next_like"
    preset = "next_tiny"
    hf_class = "Qwen3NextForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3NextConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.25,
            },
            layer_types=["full_attention"] * 2,
            mlp_only_layers=[0, 1],
            tie_word_embeddings=tied,
        )

    def test_the_parts_are_there(self, family, hf_checkpoint):
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        q, n = config.q_width, config.hidden_size
        assert state["0.self_attn.q_proj.weight"].shape == (2 * q, n)  # queries and gates
        block = family.math("block")
        assert block.attention.positions.rotary_dim(config) == config.head_dim // 4
        saved = {s.name: s.shape for s in block.saved(config, 1, 5)}
        assert saved["q"] == (1, 5, 2 * q) and saved["attn"] == (1, 5, q)


class TestSharedExpertParity(MoEHFParity):
    family_name = "next_moe_like"
    preset = "next_moe_tiny"
    hf_class = "Qwen3NextForCausalLM"

    def hf_config(self, transformers, tied):
        return transformers.Qwen3NextConfig(
            vocab_size=97,
            hidden_size=32,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.25,
            },
            layer_types=["full_attention"] * 2,
            mlp_only_layers=[],
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            router_aux_loss_coef=0.01,
            output_router_logits=True,
            tie_word_embeddings=tied,
        )


@pytest.mark.parametrize(
    ("name", "preset"), [("next_like", "next_tiny"), ("next_moe_like", "next_moe_tiny")]
)
def test_verify_passes_with_the_parts(name: str, preset: str) -> None:
    """The gate, partial rotary, zero-centred norms (and the shared expert): every op
    against its float64 formula, each layer kind's backward against autograd, whole steps
    against the reference."""
    from dataflow_training.check.verify import verify

    checks = verify(name, preset, device="cpu")
    assert {check.level for check in checks} == {"op", "task", "step"}
    assert all(check.ok for check in checks), [check for check in checks if not check.ok]


def test_a_fresh_reference_scales_its_zero_centred_norms_by_one() -> None:
    """HF initialises such a norm's stored weight to 0 (a scale of 1), and so does the
    reference: a fresh model's norms are the identity scale."""
    family = NextFamily()
    reference = family.reference_model(family.config("next_tiny"))
    norms = {k: v for k, v in reference.state_dict().items() if "norm" in k}
    assert norms and all(not value.any() for value in norms.values())
