"""An attention mask as a part: a Llama-like family whose attention is chunked (Llama 4's
``attention_chunk_size``: a query sees the keys of its own chunk alone), composed from the
kit in a few lines and held to its plain-autograd reference by the whole verify ladder at
a sequence longer than the chunk; the mask is seen to change what the model computes, and
its attention is priced by the pairs it keeps."""

from __future__ import annotations

import types
from typing import ClassVar

import attrs
import pytest
import torch
from dataflow_training.kit import (
    Block,
    ChunkedMask,
    Decoder,
    DecoderConfig,
    DecoderFamily,
    SelfAttention,
    attention_flops,
    family_plugin,
    layer_types_field,
)

pytest.importorskip("dataflow_kernels_torch")

#: the chunk, shorter than verify's sequence of 16 tokens
CHUNK = 5


@attrs.frozen
class ChunkedConfig(DecoderConfig):
    attention_chunk_size: int | None = CHUNK
    layer_types: tuple[str, ...] | None = layer_types_field()
    architecture: ClassVar[Decoder] = Decoder(
        {
            "block": Block(SelfAttention()),
            "chunked_block": Block(SelfAttention(mask=ChunkedMask())),
        },
        layer_types={"full_attention": "block", "chunked_attention": "chunked_block"},
    )


TINY = ChunkedConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    layer_types=("full_attention", "chunked_attention"),
)


class ChunkedFamily(DecoderFamily):
    name = "chunked_like"
    presets = {"chunked_tiny": TINY}
    config_class = ChunkedConfig


@pytest.fixture(autouse=True)
def _registered(isolated_plugin_manager):
    """The family registered for the test beside the plugins a step runs on."""
    kernels = pytest.importorskip("dataflow_kernels_torch.plugin")
    resolver = pytest.importorskip("dataflow_resolver_torch.plugin")
    from dataflow_training import plugin as training

    family = types.SimpleNamespace(
        dataflow_families=family_plugin("chunked_like", "a test", ChunkedFamily)
    )
    isolated_plugin_manager(family, kernels, resolver, training)


def test_the_chunked_layers_are_chunked() -> None:
    family = ChunkedFamily()
    config = family.config("chunked_tiny")
    assert config.architecture.kinds(config) == ["block", "chunked_block"]
    keep = family.math("chunked_block").attention.mask_of(config, 12, "cpu")
    # query 6 (chunk 5..9) sees keys 5 and 6 alone; query 4 sees 0..4
    assert keep[6].nonzero().flatten().tolist()[:2] == [5, 6]
    assert keep[4, :5].all() and not keep[4, 5:].any()
    assert family.math("block").attention.mask_of(config, 12, "cpu") is None
    # a chunk at or past the sequence cuts nothing: the plain causal kernels run
    assert family.math("chunked_block").attention.mask_of(config, CHUNK, "cpu") is None


def test_verify_passes_past_the_chunk() -> None:
    """Every op against its float64 formula, the chunked layer's backward against
    autograd, whole steps against the reference (which masks with SDPA), at 16 tokens:
    three chunks and a part."""
    from dataflow_training.check.verify import verify

    checks = verify("chunked_like", "chunked_tiny", device="cpu", seq_len=16)
    assert {check.level for check in checks} == {"op", "task", "step"}
    assert all(check.ok for check in checks), [check for check in checks if not check.ok]


def test_the_mask_changes_what_the_model_computes() -> None:
    """The same weights with the chunks and without: the logits past the first chunk
    differ, those inside it do not (a mask that was never applied would pass verify's
    comparisons only if the reference ignored it too)."""
    family = ChunkedFamily()
    chunked = family.reference_model(TINY)
    plain = family.reference_model(attrs.evolve(TINY, attention_chunk_size=None))
    tokens = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    chunked.init_weights(torch.Generator().manual_seed(1))
    plain.load_state_dict(chunked.state_dict())
    with torch.no_grad():
        a, b = chunked.logits(tokens), plain.logits(tokens)
    torch.testing.assert_close(a[:, :CHUNK], b[:, :CHUNK])
    assert (a[:, CHUNK:] - b[:, CHUNK:]).abs().max() > 1e-3


def test_the_attention_is_priced_by_the_pairs_kept() -> None:
    family = ChunkedFamily()
    config = family.config("chunked_tiny")
    seq = 16  # chunks 5, 5, 5 and 1: 3 * 15 + 1 pairs
    mask = family.math("chunked_block").attention.mask
    assert mask.pairs(config, seq) == 46
    keep = mask.keep(config, seq, "cpu") & torch.ones(seq, seq, dtype=torch.bool).tril()
    assert int(keep.sum()) == 46
    _, chunked = family.math("chunked_block").attention.flops(config, 2, seq)
    _, causal = family.math("block").attention.flops(config, 2, seq)
    assert chunked == attention_flops(2, seq, config.q_width, None, 46)
    assert causal == attention_flops(2, seq, config.q_width, None) > chunked


def test_a_chunk_that_is_not_a_token_count_is_refused() -> None:
    config = attrs.evolve(TINY, attention_chunk_size=0)
    with pytest.raises(ValueError, match=r"attention_chunk_size = 0: a chunk is a whole number"):
        ChunkedMask().keep(config, 8, "cpu")
