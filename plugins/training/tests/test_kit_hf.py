"""The kit's HF checkpoint I/O: a key map of every kind of rule, checkpoints built by hand
(the HF layout written out independently of the key map) read into family state, family
state written into files that are checked tensor by tensor, single and sharded, and every
error naming its file and tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dataflow_training.kit import hf as kit_hf
from dataflow_training.kit.hf import (
    TRANSPOSE,
    CheckpointError,
    KeyMap,
    KeyRule,
    offset,
    read_config,
    read_state,
    write_config,
    write_state,
)
from safetensors import safe_open
from safetensors.torch import save_file

# The names HF loaders look for, spelled out (not the kit's constants).
SAFETENSORS, SAFETENSORS_INDEX, CONFIG = (
    "model.safetensors",
    "model.safetensors.index.json",
    "config.json",
)
VOCAB, DIM, FFN, EXPERTS, Q, KV = 10, 4, 3, 2, 8, 4
LAYERS = ("0", "1")

#: Every kind of rule: rename (+ tie), transpose, 1 + w, stacked experts of fused parts,
#: a concatenation of unequal parts; skips and an alias of a VL-style prefix.
KEYS = KeyMap(
    "toy",
    rules=[
        KeyRule("emb.tok", "model.embed_tokens.weight", tied="lm_head.weight"),
        KeyRule("{layer}.proj", "model.layers.{layer}.proj.weight", TRANSPOSE),
        KeyRule("{layer}.norm", "model.layers.{layer}.norm.weight", offset(1.0)),
        KeyRule(
            "{layer}.experts.gate_up",
            (
                "model.layers.{layer}.experts.{expert}.gate.weight",
                "model.layers.{layer}.experts.{expert}.up.weight",
            ),
            stack="expert",
        ),
        KeyRule(
            "{layer}.qkv",
            (
                "model.layers.{layer}.attn.q.weight",
                "model.layers.{layer}.attn.k.weight",
                "model.layers.{layer}.attn.v.weight",
            ),
            split=(Q, KV, KV),
        ),
    ],
    skip=[r"model\.layers\.\d+\.rotary\.inv_freq", r"mtp\..+"],
    aliases=[(r"model\.language_model\.(.+)", r"model.\1")],
)

EXPECTED = {
    "emb.tok": (VOCAB, DIM),
    **{
        key: shape
        for layer in LAYERS
        for key, shape in {
            f"{layer}.proj": (6, DIM),
            f"{layer}.norm": (DIM,),
            f"{layer}.experts.gate_up": (EXPERTS, 2 * FFN, DIM),
            f"{layer}.qkv": (Q + 2 * KV, DIM),
        }.items()
    },
}


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {key: torch.randn(shape, generator=generator) for key, shape in EXPECTED.items()}


def hf_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors of ``state``, written out by hand (not through the key map)."""
    out = {"model.embed_tokens.weight": state["emb.tok"]}
    for layer in LAYERS:
        prefix = f"model.layers.{layer}"
        out[f"{prefix}.proj.weight"] = state[f"{layer}.proj"].T.contiguous()
        out[f"{prefix}.norm.weight"] = state[f"{layer}.norm"] - 1
        for expert in range(EXPERTS):
            gate_up = state[f"{layer}.experts.gate_up"][expert]
            out[f"{prefix}.experts.{expert}.gate.weight"] = gate_up[:FFN].clone()
            out[f"{prefix}.experts.{expert}.up.weight"] = gate_up[FFN:].clone()
        qkv = state[f"{layer}.qkv"]
        out[f"{prefix}.attn.q.weight"] = qkv[:Q].clone()
        out[f"{prefix}.attn.k.weight"] = qkv[Q : Q + KV].clone()
        out[f"{prefix}.attn.v.weight"] = qkv[Q + KV :].clone()
    return out


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file in ``folder``."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def save(folder: Path, tensors: dict[str, torch.Tensor], name: str = SAFETENSORS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    return folder / name


def shard(folder: Path, tensors: dict[str, torch.Tensor], parts: int = 2) -> None:
    """An index and ``parts`` shards, names dealt round-robin."""
    names = sorted(tensors)
    files = [f"model-{i:05d}-of-{parts:05d}.safetensors" for i in range(1, parts + 1)]
    for i, file in enumerate(files):
        save(folder, {name: tensors[name] for name in names[i::parts]}, file)
    weight_map = {name: files[i % parts] for i, name in enumerate(names)}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].is_contiguous(), key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)


# -- Reading and writing ---------------------------------------------------------------


def test_read_of_a_hand_built_checkpoint(tmp_path: Path, state) -> None:
    save(tmp_path, hf_layout(state))
    # 1 + w in float32 is exact only to rounding: atol 1e-6 for norms near 1.
    assert_state_equal(read_state(tmp_path, KEYS, EXPECTED), state)


def test_write_gives_the_hand_built_layout_and_reads_back_bit_exact(tmp_path: Path, state) -> None:
    files = write_state(tmp_path, KEYS, state, EXPECTED)
    assert files == [tmp_path / SAFETENSORS]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SAFETENSORS]  # no temp left
    written, want = tensors_of(tmp_path), hf_layout(state)
    assert sorted(written) == sorted(want)  # tied lm_head not written
    for name, tensor in want.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=1e-6, msg=name)
    with safe_open(tmp_path / SAFETENSORS, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    back = read_state(tmp_path, KEYS, EXPECTED)
    for key in ("emb.tok", "0.proj", "1.experts.gate_up", "1.qkv"):  # no arithmetic: exact
        assert torch.equal(back[key], state[key]), key


def test_sharded_write_and_read(tmp_path: Path, state) -> None:
    limit = 100  # bytes: a few tensors per shard; embed_tokens (160 bytes) alone
    files = write_state(tmp_path, KEYS, state, EXPECTED, max_shard_bytes=limit)
    index = json.loads((tmp_path / SAFETENSORS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert files == [tmp_path / name for name in (*shards, SAFETENSORS_INDEX)]
    assert len(shards) > 2 and not (tmp_path / SAFETENSORS).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    want = hf_layout(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in want.values())
    assert sorted(index["weight_map"]) == sorted(want)
    for file in shards:
        with safe_open(tmp_path / file, framework="pt") as handle:
            names = set(handle.keys())
            sizes = [handle.get_tensor(name).nbytes for name in names]
        assert names == {name for name, f in index["weight_map"].items() if f == file}
        assert sum(sizes) <= limit or len(sizes) == 1
    for source in (tmp_path, tmp_path / SAFETENSORS_INDEX):
        assert_state_equal(read_state(source, KEYS, EXPECTED), state)


def test_read_of_a_hand_sharded_checkpoint_with_alias_skips_and_tie(tmp_path: Path, state) -> None:
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in hf_layout(state).items()
    }
    tensors["lm_head.weight"] = state["emb.tok"].clone()
    tensors["model.language_model.layers.0.rotary.inv_freq"] = torch.ones(2)  # aliased, skipped
    tensors["mtp.layers.0.proj.weight"] = torch.ones(2)
    shard(tmp_path, tensors, parts=3)
    assert_state_equal(read_state(tmp_path, KEYS, EXPECTED), state)


def test_rewriting_a_folder_removes_the_other_layout(tmp_path: Path, state) -> None:
    write_state(tmp_path, KEYS, state, EXPECTED, max_shard_bytes=100)
    many = sorted(p.name for p in tmp_path.iterdir())
    write_state(tmp_path, KEYS, state, EXPECTED, max_shard_bytes=400)  # fewer shards
    fewer = sorted(p.name for p in tmp_path.iterdir())
    assert len(fewer) < len(many) and set(fewer) == {
        *json.loads((tmp_path / SAFETENSORS_INDEX).read_text())["weight_map"].values(),
        SAFETENSORS_INDEX,
    }
    (tmp_path / "notes.txt").write_text("kept")
    write_state(tmp_path, KEYS, state, EXPECTED)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SAFETENSORS, "notes.txt"]
    write_state(tmp_path, KEYS, state, EXPECTED, max_shard_bytes=400)
    assert SAFETENSORS not in {p.name for p in tmp_path.iterdir()}
    assert_state_equal(read_state(tmp_path, KEYS, EXPECTED), state)


def test_read_casts_after_converting(tmp_path: Path, state) -> None:
    save(tmp_path, hf_layout(state))
    back = read_state(tmp_path, KEYS, EXPECTED, dtype=torch.bfloat16)
    assert {t.dtype for t in back.values()} == {torch.bfloat16}
    # 1 + w is computed in float32 and rounded once, not w rounded and then 1 + w again.
    w = hf_layout(state)["model.layers.0.norm.weight"]
    assert torch.equal(back["0.norm"], (w + 1).to(torch.bfloat16))


def test_write_of_views_of_one_buffer_and_of_one_tensor_twice(tmp_path: Path, state) -> None:
    """Family state often views one flat buffer per layer (written without a copy); two
    keys holding one tensor overlap, which safetensors refuses unless one is copied."""
    flat = torch.cat([t.flatten() for t in state.values()])
    views, start = {}, 0
    for key, tensor in state.items():
        views[key] = flat[start : start + tensor.numel()].view(tensor.shape)
        start += tensor.numel()
    views["1.qkv"] = views["0.qkv"]  # split without a copy: the same bytes twice
    write_state(tmp_path, KEYS, views, EXPECTED)
    back = read_state(tmp_path, KEYS, EXPECTED)
    assert torch.equal(back["0.experts.gate_up"], state["0.experts.gate_up"])
    assert torch.equal(back["1.qkv"], state["0.qkv"])


def test_write_metadata_keeps_the_format(tmp_path: Path, state) -> None:
    write_state(tmp_path, KEYS, state, EXPECTED, metadata={"step": "7"})
    with safe_open(tmp_path / SAFETENSORS, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "step": "7"}


def test_config_round_trip_and_errors(tmp_path: Path) -> None:
    assert write_config(tmp_path / "new", {"a": 1, "b": [2]}) == tmp_path / "new" / CONFIG
    assert read_config(tmp_path / "new" / SAFETENSORS) == {"a": 1, "b": [2]}  # a file beside it
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: no config.json beside the weights$"):
        read_config(tmp_path)
    (tmp_path / CONFIG).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / CONFIG}: not valid JSON"):
        read_config(tmp_path)
    (tmp_path / CONFIG).write_text("[1]")
    with pytest.raises(CheckpointError, match="holds a list, not a JSON object"):
        read_config(tmp_path)


@pytest.mark.gpu
def test_write_from_cuda_and_read_to_cpu(tmp_path: Path, state) -> None:
    on_gpu = {key: tensor.cuda() for key, tensor in state.items()}
    write_state(tmp_path, KEYS, on_gpu, EXPECTED, max_shard_bytes=200)
    back = read_state(tmp_path, KEYS, EXPECTED)
    assert all(tensor.device.type == "cpu" for tensor in back.values())
    assert torch.equal(back["1.experts.gate_up"], state["1.experts.gate_up"])


# -- Read errors: one error, every culprit named ----------------------------------------


def read_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as failure:
        read_state(path, KEYS, EXPECTED)
    return str(failure.value)


def test_missing_tensors_are_all_named_with_their_keys(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    del tensors["model.layers.1.attn.v.weight"], tensors["model.layers.0.experts.1.up.weight"]
    file = save(tmp_path, tensors)
    message = read_error(tmp_path)
    assert message == (
        f"{file}: tensors 'model.layers.0.experts.1.up.weight', 'model.layers.1.attn.v.weight' "
        "are missing (for toy keys '0.experts.gate_up', '1.qkv')"
    )


def test_unexpected_tensors_are_all_named_per_file(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    tensors["model.layers.2.proj.weight"] = torch.ones(DIM, 6)
    tensors["model.layers.0.rotary.extra"] = torch.ones(2)
    tensors["model.layers.0.experts.2.gate.weight"] = torch.ones(FFN, DIM)
    shard(tmp_path, tensors, parts=2)
    message = read_error(tmp_path)
    for name in (
        "model.layers.2.proj.weight",
        "model.layers.0.rotary.extra",
        "model.layers.0.experts.2.gate.weight",
    ):
        assert f"'{name}'" in message
    assert message.count(": unexpected") == 2  # one part per shard that holds some
    assert str(tmp_path / "model-00001-of-00002.safetensors") in message


def test_a_shape_mismatch_names_both_shapes_and_the_file(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    tensors["model.layers.1.proj.weight"] = state["1.proj"]  # not transposed
    tensors["model.layers.0.experts.0.gate.weight"] = torch.ones(FFN + 1, DIM)
    file = save(tmp_path, tensors)
    message = read_error(tmp_path)
    assert (
        f"{file}: tensor 'model.layers.1.proj.weight' has shape (6, 4), expected (4, 6) "
        "(toy key '1.proj')"
    ) in message
    assert "'model.layers.0.experts.0.gate.weight' has shape (4, 4), expected (3, 4)" in message


def test_every_kind_of_problem_in_one_error(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    del tensors["model.layers.0.attn.q.weight"]
    tensors["model.layers.1.norm.weight"] = torch.ones(DIM + 1)
    tensors["surprise"] = torch.ones(1)
    file = save(tmp_path, tensors)
    parts = read_error(tmp_path).split("; ")
    assert len(parts) == 3 and all(part.startswith(str(file)) for part in parts)
    assert "'model.layers.0.attn.q.weight' is missing" in parts[1]
    assert "'model.layers.1.norm.weight' has shape (5,), expected (4,)" in parts[0]
    assert "unexpected tensor 'surprise'" in parts[2]


def test_a_shard_the_index_names_that_is_missing(tmp_path: Path, state) -> None:
    shard(tmp_path, hf_layout(state), parts=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    message = read_error(tmp_path)
    assert message.startswith(
        f"{tmp_path / SAFETENSORS_INDEX}: names file 'model-00002-of-00002.safetensors', which "
        "does not exist (it holds tensors "
    )
    assert "'model.layers.0.attn.k.weight'" in message
    assert "missing" not in message  # its tensors are not reported a second time


def test_a_tensor_the_index_names_that_the_shard_lacks(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    shard(tmp_path, tensors, parts=2)
    index = json.loads((tmp_path / SAFETENSORS_INDEX).read_text())
    index["weight_map"]["model.layers.1.norm.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["model.layers.1.proj.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps(index))
    lacked = [
        name
        for name in ("model.layers.1.norm.weight", "model.layers.1.proj.weight")
        if sorted(tensors).index(name) % 2 == 0  # it really is in shard 1
    ]
    assert lacked
    message = read_error(tmp_path)
    assert (
        f"{tmp_path / 'model-00002-of-00002.safetensors'}: lacks "
        f"{'tensors' if len(lacked) > 1 else 'tensor'} {', '.join(map(repr, lacked))} that "
        f"{SAFETENSORS_INDEX} puts there"
    ) in message


def test_a_tied_copy_that_differs_is_named(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    tensors["lm_head.weight"] = state["emb.tok"] + 1
    file = save(tmp_path, tensors)
    assert read_error(tmp_path) == (
        f"{file}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but toy "
        "ties them (key 'emb.tok')"
    )
    tensors["lm_head.weight"] = torch.ones(3)
    save(tmp_path, tensors)
    assert "'lm_head.weight' has shape (3,), expected (10, 4)" in read_error(tmp_path)


def test_two_stored_names_for_one_tensor(tmp_path: Path, state) -> None:
    tensors = hf_layout(state)
    tensors["model.language_model.layers.0.norm.weight"] = torch.ones(DIM)
    save(tmp_path, tensors)
    assert (
        "tensors 'model.language_model.layers.0.norm.weight' and 'model.layers.0.norm.weight' "
        "are both 'model.layers.0.norm.weight'"
    ) in read_error(tmp_path)


def test_pickles_are_refused_by_name(tmp_path: Path, state) -> None:
    for name in ("pytorch_model.bin", "weights.pt", "model.pth"):
        (tmp_path / name).write_bytes(b"\x80\x04not to be unpickled")
        with pytest.raises(CheckpointError, match=f"^{tmp_path / name}: a pickle checkpoint"):
            read_state(tmp_path / name, KEYS, EXPECTED)
    with pytest.raises(
        CheckpointError,
        match=r"no model.safetensors or model.safetensors.index.json \(found: model.pth, "
        r"pytorch_model.bin, weights.pt\); .* \(model.pth, pytorch_model.bin, weights.pt: pickle",
    ):
        read_state(tmp_path, KEYS, EXPECTED)
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"x": "weights.pt"}}))
    assert "names file 'weights.pt', which is not a .safetensors file" in read_error(tmp_path)


def test_bad_files_and_indexes_are_named(tmp_path: Path) -> None:
    assert read_error(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'}: no such file or folder"
    (tmp_path / SAFETENSORS).write_bytes(b"garbage")
    assert read_error(tmp_path) == f"{tmp_path / SAFETENSORS}: not a readable safetensors file"
    (tmp_path / SAFETENSORS).unlink()
    index = tmp_path / SAFETENSORS_INDEX
    index.write_text("{")
    assert read_error(tmp_path).startswith(f"{index}: not a safetensors index")
    index.write_text(json.dumps({"metadata": {}}))
    assert read_error(tmp_path) == f"{index}: no 'weight_map' object of tensor name -> file name"
    index.write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    assert "names file '../elsewhere.safetensors', outside the checkpoint's folder" in read_error(
        tmp_path
    )
    (tmp_path / "notes.txt").write_text("")
    assert read_error(tmp_path / "notes.txt").endswith(
        "not a .safetensors file or a .index.json index"
    )


# -- Write errors: nothing written ------------------------------------------------------


def test_write_names_missing_extra_and_mis_shaped_keys_and_writes_nothing(
    tmp_path: Path, state
) -> None:
    folder = tmp_path / "out"
    bad = {key: value for key, value in state.items() if key not in ("0.norm", "1.qkv")}
    bad["0.proj"] = state["0.proj"].T
    bad["2.proj"] = state["0.proj"]
    with pytest.raises(CheckpointError) as failure:
        write_state(folder, KEYS, bad, EXPECTED)
    assert str(failure.value) == (
        f"export to {folder}: state has no tensors '0.norm', '1.qkv'; state has tensor "
        "'2.proj' that the expected toy state does not have; tensor '0.proj' has shape "
        "(4, 6), expected (6, 4)"
    )
    assert not folder.exists()


def test_a_failed_write_leaves_the_old_checkpoint_and_no_partial_file(
    tmp_path: Path, state, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_state(tmp_path, KEYS, state, EXPECTED)
    before = (tmp_path / SAFETENSORS).read_bytes()

    def fail_halfway(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(kit_hf, "save_file", fail_halfway)
    changed = {**state, "0.proj": state["0.proj"] + 1}
    for limit in (None, 100):
        with pytest.raises(OSError, match="disk full"):
            write_state(tmp_path, KEYS, changed, EXPECTED, max_shard_bytes=limit)
        assert sorted(p.name for p in tmp_path.iterdir()) == [SAFETENSORS]
        assert (tmp_path / SAFETENSORS).read_bytes() == before


# -- Key map definitions ----------------------------------------------------------------


def test_key_map_definition_errors_name_the_rule_or_key() -> None:
    with pytest.raises(ValueError, match="no rule maps state key '0.other'"):
        KEYS.expand({"0.other": (2,)})
    clash = KeyMap("toy", [KeyRule("{layer}.a", "x.{layer}"), KeyRule("{layer}.b", "x.{layer}")])
    with pytest.raises(ValueError, match="state keys '0.a' and '0.b' both map to HF tensor 'x.0'"):
        clash.expand({"0.a": (1,), "0.b": (1,)})
    with pytest.raises(
        ValueError, match=r"'h.{layer}.{expert}' must have exactly the placeholders \['layer'\]"
    ):
        KeyRule("{layer}.w", "h.{layer}.{expert}")
    with pytest.raises(ValueError, match="only a one-to-one rule can be tied"):
        KeyRule("{layer}.w", ("a.{layer}", "b.{layer}"), tied="c.{layer}")
    with pytest.raises(ValueError, match=r"split \(1, 2\) has 2 sizes for 3 HF names"):
        KeyRule("w", ("a", "b", "c"), split=(1, 2))
    with pytest.raises(
        ValueError, match=r"key '0.norm' .* transpose: a transpose needs at least 2"
    ):
        KeyMap("toy", [KeyRule("{layer}.norm", "n.{layer}", TRANSPOSE)]).expand({"0.norm": (4,)})
    with pytest.raises(ValueError, match=r"key '0.qkv' .*: split \(8, 4, 4\) does not sum to 15"):
        KEYS.expand({"0.qkv": (15, DIM)})
    with pytest.raises(ValueError, match="7 does not split into 2 equal parts"):
        KEYS.expand({"0.experts.gate_up": (EXPERTS, 7, DIM)})


def test_a_placeholder_is_one_dot_free_part() -> None:
    rule = KeyRule("{layer}.attn.w", "model.layers.{layer}.self_attn.w")
    assert rule.match("12.attn.w") == {"layer": "12"}
    assert rule.match("a.b.attn.w") is None and rule.match("1.attn.wx") is None
    (entry,) = KeyMap("toy", [rule]).expand({"12.attn.w": (2, 3)})
    assert entry.hf_shapes() == {"model.layers.12.self_attn.w": (2, 3)}


# -- A real MoE checkpoint: per-expert files, stacked family tensors ---------------------


def qwen3_moe_keys() -> KeyMap:
    """A Qwen 3 MoE family's table: experts stacked, gate and up fused, lm_head untied."""
    attn = "model.layers.{layer}.self_attn"
    expert = "model.layers.{layer}.mlp.experts.{expert}"
    plain = {
        "emb.tok": "model.embed_tokens.weight",
        **{f"{{layer}}.attn.{p}": f"{attn}.{p}_proj.weight" for p in ("q", "k", "v", "o")},
        "{layer}.attn.q_norm": f"{attn}.q_norm.weight",
        "{layer}.attn.k_norm": f"{attn}.k_norm.weight",
        "{layer}.norm_1": "model.layers.{layer}.input_layernorm.weight",
        "{layer}.norm_2": "model.layers.{layer}.post_attention_layernorm.weight",
        "{layer}.router": "model.layers.{layer}.mlp.gate.weight",
        "head.norm": "model.norm.weight",
        "head.out": "lm_head.weight",
    }
    return KeyMap(
        "qwen3_moe",
        rules=[
            *(KeyRule(key, hf) for key, hf in plain.items()),
            KeyRule(
                "{layer}.experts.gate_up",
                (f"{expert}.gate_proj.weight", f"{expert}.up_proj.weight"),
                stack="expert",
            ),
            KeyRule("{layer}.experts.down", f"{expert}.down_proj.weight", stack="expert"),
        ],
    )


def test_a_transformers_moe_checkpoint_reads_stacked_and_writes_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the MoE round trip needs it")
    config = transformers.Qwen3MoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, moe_intermediate_size=6,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "hf")
    dim, ffn, heads, head_dim = 16, 6, 2, 8
    expected = {"emb.tok": (50, dim), "head.norm": (dim,), "head.out": (50, dim)}
    for layer in ("0", "1"):
        expected |= {
            f"{layer}.attn.q": (heads * head_dim, dim),
            f"{layer}.attn.k": (head_dim, dim),
            f"{layer}.attn.v": (head_dim, dim),
            f"{layer}.attn.o": (dim, heads * head_dim),
            f"{layer}.attn.q_norm": (head_dim,),
            f"{layer}.attn.k_norm": (head_dim,),
            f"{layer}.norm_1": (dim,),
            f"{layer}.norm_2": (dim,),
            f"{layer}.router": (4, dim),
            f"{layer}.experts.gate_up": (4, 2 * ffn, dim),
            f"{layer}.experts.down": (4, dim, ffn),
        }
    state = read_state(tmp_path / "hf", qwen3_moe_keys(), expected)
    hf_state = model.state_dict()
    if "model.layers.1.mlp.experts.gate_up_proj" in hf_state:  # transformers >= 5 fuses too
        assert torch.equal(
            state["1.experts.gate_up"], hf_state["model.layers.1.mlp.experts.gate_up_proj"]
        )
        assert torch.equal(
            state["0.experts.down"], hf_state["model.layers.0.mlp.experts.down_proj"]
        )

    write_state(tmp_path / "back", qwen3_moe_keys(), state, expected, max_shard_bytes=8_000)
    write_config(tmp_path / "back", json.loads((tmp_path / "hf" / CONFIG).read_text()))
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back")
    again = reloaded.state_dict()
    assert set(again) == set(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(again[name], tensor), name
