"""The kit's decoder pieces that no family test pins alone: the reference's rotary
frequencies against ``kit.rotary``'s (two independent implementations, every band of the
Llama 3 scaling), the cached rotary tables, ``DecoderConfig``'s rules, the shared
``config.json`` reading, and ``task_doc``'s stale-block check on a planted difference."""

from __future__ import annotations

import re
from typing import ClassVar

import attrs
import pytest
import torch
from dataflow_training.kit import rotary
from dataflow_training.kit.attention import QKNorm, SelfAttention
from dataflow_training.kit.block import Block
from dataflow_training.kit.decoder import Decoder, DecoderConfig, parameter_count
from dataflow_training.kit.decoder_hf import fields_from_hf, fields_to_hf
from dataflow_training.kit.decoder_reference import DecoderReference, inverse_frequencies
from dataflow_training.kit.hf import CheckpointError
from dataflow_training.kit.rotary import Llama3Scaling

pytest.importorskip("dataflow_kernels_torch")


def small(**fields) -> DecoderConfig:
    sizes = dict(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    return DecoderConfig(**(sizes | fields))


@attrs.frozen
class WithQKNorm(DecoderConfig):
    architecture: ClassVar[Decoder] = Decoder({"block": Block(SelfAttention(QKNorm("head")))})


@pytest.mark.parametrize(
    "scaling", [None, Llama3Scaling(factor=8.0, original_max_position=64)], ids=["plain", "llama3"]
)
def test_the_reference_frequencies_equal_the_kits(scaling) -> None:
    config = small(rope_scaling=scaling)
    ours = inverse_frequencies(config)
    torch.testing.assert_close(
        ours, rotary.inverse_frequencies(16, 500000.0, scaling), rtol=1e-12, atol=0
    )
    if scaling is not None:  # the test reaches all three bands: kept, blended, divided
        plain = rotary.inverse_frequencies(16, 500000.0)
        ratio = (ours / plain).tolist()
        assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 8)
        assert any(1 / 8 < r < 1 for r in ratio)


def test_cached_tables_are_made_once_and_equal_tables() -> None:
    args = (12, 16, 10000.0, Llama3Scaling(), torch.device("cpu"), torch.float64)
    first, again = rotary.cached_tables(*args), rotary.cached_tables(*args)
    assert first[0] is again[0] and first[1] is again[1]
    expected = rotary.tables(12, 16, 10000.0, scaling=Llama3Scaling(), dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True))


def test_compiled_callers_take_the_cached_tables_as_inputs() -> None:
    """Under torch.compile the tables are looked up, not made again by every call: the
    first call's graph makes them (and fills the cache), the graph that runs from then on
    takes them as inputs and computes no cosine or sine; the results equal eager's."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def rotate(x: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary.cached_tables(x.shape[1], x.shape[-1], 500.0, None, x.device, x.dtype)
        return rotary.apply(x.transpose(1, 2), cos, sin) * 2

    torch._dynamo.reset()
    compiled = torch.compile(rotate, backend=backend)
    x = torch.randn(2, 24, 3, 8, dtype=torch.float64)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), rotate(x), rtol=0, atol=0)

    def trig(gm: torch.fx.GraphModule) -> list[str]:
        return [str(n.target) for n in gm.graph.nodes if re.search("cos|sin", str(n.target))]

    assert len(graphs) == 2 and trig(graphs[0]) and not trig(graphs[1])


@pytest.mark.gpu
def test_tables_made_while_a_cuda_graph_is_captured_are_not_kept() -> None:
    """Tables first made inside a CUDA graph capture hold nothing until it replays (and
    nothing at all if the capture fails and the step is dispatched instead): the cache
    keeps none of them, and a later lookup outside the capture makes them afresh."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    args = (40, 8, 1234.5, None, device, torch.float32)  # a key no other test makes
    key = (40, 8, 1234.5, None, "cuda", device.index, torch.float32)
    rotary._TABLES.pop(key, None)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        rotary.cached_tables(*args)
    assert key not in rotary._TABLES
    cos, sin = rotary.cached_tables(*args)
    assert key in rotary._TABLES
    expected = rotary.tables(40, 8, 1234.5, device=device, dtype=torch.float32)
    torch.testing.assert_close(cos, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, expected[1], rtol=0, atol=0)


def test_the_table_cache_keeps_the_newest() -> None:
    for n in range(rotary._KEPT + 3):
        rotary.cached_tables(n + 1, 4, 10000.0, None, torch.device("cpu"), torch.float32)
    assert len(rotary._TABLES) == rotary._KEPT
    lengths = [key[0] for key in rotary._TABLES]
    assert lengths == list(range(4, rotary._KEPT + 4))


def test_config_rules_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"DecoderConfig.head_dim \(15\) must be even"):
        small(head_dim=15)
    with pytest.raises(
        ValueError, match=r"WithQKNorm.num_attention_heads \(4\) must be a multiple"
    ):
        WithQKNorm(**attrs.asdict(small(), recurse=False) | {"num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"tie_word_embeddings must be True or False, got 1"):
        small(tie_word_embeddings=1)
    with pytest.raises(TypeError, match=r"no field\(s\) 'qk_norm'"):
        small().with_overrides(qk_norm=True)  # a class attribute, not a field
    scaled = small().with_overrides(rope_scaling={"factor": 4.0, "original_max_position": 32})
    assert scaled.rope_scaling == Llama3Scaling(factor=4.0, original_max_position=32)
    with pytest.raises(ValueError, match=r"rope_scaling \{'factr': 4.0\}: "):
        small(rope_scaling={"factr": 4.0})


def test_qk_norm_adds_two_head_dim_weights_per_block() -> None:
    plain, normed = (
        small(head_dim=32),
        WithQKNorm(**attrs.asdict(small(head_dim=32), recurse=False)),
    )
    assert parameter_count(normed) - parameter_count(plain) == 2 * 32
    with torch.device("meta"):
        assert sum(p.numel() for p in DecoderReference(normed).parameters()) == parameter_count(
            normed
        )


def test_config_json_rope_spellings() -> None:
    config = small(rope_scaling=Llama3Scaling(factor=8.0))
    written = fields_to_hf(config, torch.bfloat16)
    assert written["rope_parameters"]["rope_type"] == "llama3" and written["dtype"] == "bfloat16"
    new = {k: v for k, v in written.items() if k not in ("rope_scaling", "rope_theta")}
    old = {k: v for k, v in written.items() if k != "rope_parameters"}
    for spelling in (new, old):
        assert DecoderConfig(**fields_from_hf(spelling, "c.json", model_type="llama")) == config
    typed = old | {"rope_scaling": {**old["rope_scaling"], "type": "llama3"}}
    del typed["rope_scaling"]["rope_type"]  # the oldest files say "type"
    assert DecoderConfig(**fields_from_hf(typed, "c.json", model_type="llama")) == config
    broken = old | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(CheckpointError, match=r"c.json: rope_scaling = .* needs 'low_freq_factor'"):
        fields_from_hf(broken, "c.json", model_type="llama")


def test_stale_blocks_find_a_planted_difference_and_rewrite_fixes_it() -> None:
    from dataflow_training.testing.task_doc import rewrite, stale_blocks, task_doc

    args = "toy_moe toy_moe_tiny --batch 2 --seq-len 8 --dtype fp32"
    body = task_doc("toy_moe", "toy_moe_tiny", batch=2, seq_len=8, dtype="fp32")
    assert "| `W_0` | param |" in body and "`embed_0_0_emb`" in body
    page = f"# page\n\n<!-- task_doc {args} -->\n{body}<!-- /task_doc -->\n"
    assert stale_blocks(page) == []
    planted = page.replace(" | param | ", " | param | 1", 1)
    assert stale_blocks(planted) == [args]
    assert rewrite(planted) == page
