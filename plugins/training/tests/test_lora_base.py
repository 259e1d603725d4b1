"""LoRA on a quantized base (``--lora-base int8|nf4|bf16``) and ``--lora-dropout``, on the
CPU with llama3_tiny.

The formats against independent references (int8's error bound per element; NF4 against
a quantizer written here from the code table); the lowered step's base objects shrink as
the bytes per weight say; runs from a Hugging Face folder whose losses track the run
with the base in the run's dtype and whose quantized base comes out bit-identical to the
quantization of the folder's weights; the adapters' gradients under dropout (and an nf4
base) equal autograd's through PEFT with the same masks; ``export --peft`` and
``--merge``; a resumed run equals an uninterrupted one. Skipped without transformers and
peft."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dataflow_training.drive.checkpoint import read_checkpoint
from dataflow_training.kit.lora import dropout_keep, init_adapters, name_salt, task_seed
from dataflow_training.kit.lora_base import (
    NF4,
    dense_base,
    dequantize_int8,
    dequantize_nf4,
    quantize_int8,
    quantize_nf4,
)
from dataflow_training.step.config import DtypePolicy, OptimizerPolicy, TrainConfig
from dataflow_training.step.family import TensorSpec, load_family
from dataflow_training.step.freezing import parameter_counts
from dataflow_training.step.lora import LoraConfig, LoraError, base_specs, lora_layers
from dataflow_training.step.lowering import lower
from dataflow_training.step.ops import load_ops

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_llama3")
transformers = pytest.importorskip("transformers", reason="these tests need transformers")
if importlib.util.find_spec("peft") is None:
    pytest.skip("these tests need peft", allow_module_level=True)

PRESET = "llama3_tiny"
RANK = 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: how far a quantized base's 6-step losses may stray from the float32 base's (the
#: perturbed tiny model's losses are about 5.5; measured: bf16 and int8 within 0.002, nf4
#: with dropout 0.1 within 0.026, all of it at step 0, before the adapters move)
LOSS_TOLERANCE = {"int8": 0.01, "nf4": 0.06, "bf16": 0.01}


def _peft():
    """peft, imported by a test, not while pytest collects (test_lora.py says why)."""
    import peft

    return peft


# -- the formats ------------------------------------------------------------------------


def test_int8_is_within_half_a_step_of_each_row() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 80, generator=g) * torch.linspace(0.01, 3, 48)[:, None]
    weight[5] = 0.0  # a zero row: scale 0, codes 0
    codes, scale = quantize_int8(weight)
    assert codes.dtype == torch.int8 and codes.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (48,)
    absmax = weight.abs().amax(1)
    torch.testing.assert_close(scale, absmax / 127)
    error = (dequantize_int8(codes, scale, torch.float32) - weight).abs()
    bound = (absmax / 127 / 2)[:, None]
    assert (error <= bound * (1 + 1e-6) + 1e-12).all()
    assert codes.abs().max() == 127 and (codes[5] == 0).all()
    assert dequantize_int8(codes, scale, torch.bfloat16).dtype == torch.bfloat16


def _nf4_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 as QLoRA describes it, written from the code table alone: blocks of 64
    consecutive elements, each scaled by its absmax, each element the index of the
    nearest table value (the first on a tie), two indices a byte, the first high."""
    table = torch.tensor(NF4, dtype=torch.float64)
    blocks = weight.double().reshape(-1, 64)
    absmax = blocks.abs().amax(1)
    nearest = (blocks[..., None] / absmax[:, None, None] - table).abs().argmin(-1)
    flat = nearest.reshape(-1)
    packed = flat[0::2] * 16 + flat[1::2]
    return packed.to(torch.uint8).reshape(weight.shape[0], -1), absmax.float()


def test_nf4_equals_a_reference_from_the_code_table() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 160, generator=g)  # 160 inputs: blocks cross the rows
    codes, absmax = quantize_nf4(weight)
    assert codes.shape == (24, 80) and codes.dtype == torch.uint8
    assert absmax.shape == (24 * 160 // 64,)
    their_codes, their_absmax = _nf4_reference(weight)
    torch.testing.assert_close(absmax, their_absmax, rtol=0, atol=0)
    assert torch.equal(codes, their_codes)
    table = torch.tensor(NF4)
    dense = dequantize_nf4(codes, absmax, torch.float32)
    flat = torch.stack((their_codes >> 4, their_codes & 15), -1).reshape(-1, 64).long()
    torch.testing.assert_close(dense, (table[flat] * their_absmax[:, None]).reshape(24, 160))
    # the error is at most half the widest gap of the table, times the block's absmax
    half_gap = (table[1:] - table[:-1]).max() / 2
    error = (dense - weight).reshape(-1, 64).abs()
    assert (error <= half_gap * absmax[:, None] * (1 + 1e-6)).all()


def test_the_dequantize_ops_are_registered_for_cpu_and_cuda() -> None:
    ops = load_ops("cpu", ("dequantize_int8", "dequantize_nf4"))
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    codes, scale = quantize_int8(weight)
    torch.testing.assert_close(
        ops["dequantize_int8"](codes, scale, torch.float32),
        dequantize_int8(codes, scale, torch.float32),
    )
    from dataflow import kernels

    for op in ("dequantize_int8", "dequantize_nf4"):
        assert kernels().for_op(op, device="cuda"), op


# -- the lowered step -------------------------------------------------------------------


def _w_bytes(program, ids) -> int:
    sizes = {o.id: o.size_bytes for o in program.objects}
    return sum(sizes[i] for i in ids)


def test_the_base_objects_shrink_as_their_bytes_per_weight_say() -> None:
    """Llama 3.2 1B's blocks in bf16 (lowered only): an int8 base's ``W_i`` is about half
    the bf16 one's (1 byte a weight and 4 a row, the norms as they were), nf4's about
    0.28 (half a byte and 4 bytes a block of 64); the adapters' objects do not change."""
    llama3 = load_family("llama3")
    sizes = {}
    for base in (None, "bf16", "int8", "nf4"):
        train = TrainConfig(
            seq_len=64, batch=1, dtype=DtypePolicy.named("bf16"), lora=LoraConfig(16, base=base)
        )
        program = lower(llama3, "l3_1b", train).program
        blocks = [o.id for o in program.objects if o.id.startswith("W_") and o.id[2:].isdigit()]
        adapters = [o.id for o in program.objects if o.id.endswith(".lora")]
        sizes[base] = (_w_bytes(program, blocks), _w_bytes(program, adapters))
    assert sizes["bf16"] == sizes[None]  # a bf16 run's base is bf16 already
    assert {s[1] for s in sizes.values()} == {sizes[None][1]}
    assert 0.5 < sizes["int8"][0] / sizes[None][0] < 0.502
    assert 0.281 < sizes["nf4"][0] / sizes[None][0] < 0.283


def test_quantized_specs_and_a_weight_nf4_cannot_block() -> None:
    llama3 = load_family("llama3")
    layers = lora_layers(llama3.layers(llama3.config(PRESET)), LoraConfig(RANK, base="nf4"))
    specs = {p.name: p for p in layers[1].params}
    assert specs["mlp.down_proj.weight"].shape == (64, 80)
    assert specs["mlp.down_proj.weight"].dtype == "uint8"
    assert specs["mlp.down_proj.weight_scale"].shape == (64 * 160 // 64,)
    assert specs["input_layernorm.weight"].dtype == "policy"  # norms stay
    assert not any(p.trainable for p in layers[1].groups[0].params)
    dense = lora_layers(llama3.layers(llama3.config(PRESET)), LoraConfig(RANK))
    assert parameter_counts(layers) == parameter_counts(dense)  # the weights stood for
    with pytest.raises(LoraError, match="--lora-base nf4: 0.odd.weight"):
        base_specs(TensorSpec("odd.weight", (3, 30)), "nf4", "0")
    with pytest.raises(LoraError, match="--lora-base 'fp8'"):
        LoraConfig(RANK, base="fp8")


# -- runs from a Hugging Face folder ----------------------------------------------------


@pytest.fixture(scope="module")
def llama3():
    return load_family("llama3")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, llama3) -> Path:
    """A llama3_tiny-shaped ``LlamaForCausalLM``, every weight perturbed, saved by
    transformers."""
    config = transformers.LlamaConfig(**llama3.config_to_hf(llama3.config(PRESET), torch.float32))
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("hf") / "llama3_tiny"
    model.save_pretrained(folder)
    return folder


def _args(out: Path, hf: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--init", str(hf), "--steps", str(steps), "--batch", "2", "--seq-len", "16",
        "--ga-rounds", "2", "--device", "cpu", "--lr", "1e-2", "--warmup", "0",
        "--checkpoint-every", "2", "--lora", str(RANK), "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_folder) -> dict[str, Path]:
    """6-step LoRA runs from the HF folder: the base in the run's float32, in bf16, int8
    and nf4 (the nf4 one with dropout 0.1 on the adapters' input too)."""
    out = {}
    for base in ("float32", "bf16", "int8", "nf4"):
        folder = tmp_path_factory.mktemp(base) / "run"
        extra = () if base == "float32" else ("--lora-base", base)
        if base == "nf4":
            extra += ("--lora-dropout", "0.1")
        result = invoke(*_args(folder, hf_folder, 6, *extra))
        assert result.exit_code == 0, result.output
        out[base] = folder
    return out


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_quantized_bases_track_the_float_base_and_stay_bit_identical(
    llama3, hf_folder, runs
) -> None:
    _, hf = llama3.import_hf(hf_folder, dtype=torch.float32)
    reference = _losses(runs["float32"])
    assert reference[-1] < reference[0] - 0.05, reference
    for base in ("bf16", "int8", "nf4"):
        losses = _losses(runs[base])
        assert (
            max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < (LOSS_TOLERANCE[base])
        ), (base, losses, reference)
        weights, _, manifest, _ = read_checkpoint(runs[base] / "step_000006")
        assert manifest["train"]["lora"]["base"] == base
        for key in (f"{i}.{m}.weight" for i in (0, 1) for m in _MODULES):
            if base == "bf16":
                assert torch.equal(weights[key], hf[key].to(torch.bfloat16)), key
                continue
            codes, scale = (quantize_int8 if base == "int8" else quantize_nf4)(hf[key])
            assert torch.equal(weights[key], codes), key
            assert torch.equal(weights[f"{key}_scale"], scale), key
        for key in ("emb.embed_tokens.weight", "0.input_layernorm.weight", "head.norm.weight"):
            assert torch.equal(weights[key], hf[key]), key


_MODULES = tuple(
    f"{'self_attn' if t[0] in 'qkvo' else 'mlp'}.{t}" for t in TARGETS
)  # self_attn.q_proj ... mlp.down_proj


def test_the_adapters_gradients_under_dropout_on_an_nf4_base_equal_peft_s(
    llama3, hf_folder
) -> None:
    """One step with dropout 0.25 on an nf4 base: dataflow's hand-written backward against
    autograd through PEFT's LoRA on the transformers model of the dequantized base, each
    ``lora_dropout`` replaced by the mask dataflow draws for that update, round, layer and
    weight (``kit.lora.dropout_keep``)."""
    from dataflow_training.drive.run import TrainingRun

    p = 0.25
    lora = LoraConfig(RANK, alpha=8.0, dropout=p, base="nf4")
    _, state = llama3.import_hf(hf_folder, dtype=torch.float32)
    init_adapters(lora_layers(llama3.layers(llama3.config(PRESET)), lora), state, 0, torch.float32)
    g = torch.Generator().manual_seed(1)
    start = {
        k: (torch.randn(v.shape, generator=g) * 0.1 if ".lora_B." in k else v)
        for k, v in state.items()
    }
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    train = TrainConfig(seq_len=16, batch=2, lora=lora, optimizer=OptimizerPolicy(lr=0.0))
    run = TrainingRun.of(
        "llama3", PRESET, train, device="cpu", resolver="torch", state=start, keep_grads=True
    )
    run.step([(tokens, targets)])
    mine = {k: v for k, v in run.grads().items() if ".lora_" in k}
    base, _ = run.state()
    run.close()

    hf_base = {k: v for k, v in dense_base(base).items() if ".lora_" not in k}
    (folder := hf_folder.parent / "dequantized").mkdir(exist_ok=True)
    llama3.export_hf(llama3.config(PRESET), hf_base, folder)
    model = _peft().get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32),
        _peft().LoraConfig(r=RANK, lora_alpha=8, lora_dropout=p, target_modules=list(TARGETS)),
    )
    model.train()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in start.items():
            if ".lora_" in key:
                named[_peft_name(key)].copy_(value)
    for layer in (0, 1):
        for module in _MODULES:
            owner = model.get_submodule(f"base_model.model.model.layers.{layer}.{module}")
            # the step's layers: emb is 0, block i is i + 1; update 1, round 0
            seed = task_seed(1, 0, layer + 1)
            owner.lora_dropout["default"] = _Mask(seed, name_salt(f"{module}.weight"), p)
    logits = model(input_ids=tokens).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    theirs = {n: q.grad for n, q in model.named_parameters() if q.requires_grad}
    assert set(theirs) == {_peft_name(k) for k in mine}
    for key, grad in mine.items():
        torch.testing.assert_close(grad, theirs[_peft_name(key)], rtol=1e-4, atol=1e-6, msg=key)


class _Mask(torch.nn.Module):
    """Dropout with dataflow's mask of one projection."""

    def __init__(self, seed: int, salt: int, p: float) -> None:
        super().__init__()
        self.seed, self.salt, self.p = seed, salt, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = dropout_keep(tuple(x.shape), self.seed, self.salt, self.p, x.device)
        assert 0.6 < keep.float().mean() < 0.9  # about 1 - p of them
        return x * keep / (1 - self.p)


def _peft_name(key: str) -> str:
    layer, _, name = key.partition(".")
    return f"base_model.model.model.layers.{layer}.{name}".replace(".weight", ".default.weight")


def test_the_dropout_masks_differ_by_update_round_layer_and_weight() -> None:
    shape = (2, 16, 64)
    masks = [
        dropout_keep(shape, task_seed(update, round_, layer), name_salt(name), 0.5, "cpu")
        for update, round_, layer, name in (
            (1, 0, 1, "q.weight"),
            (2, 0, 1, "q.weight"),
            (1, 1, 1, "q.weight"),
            (1, 0, 2, "q.weight"),
            (1, 0, 1, "k.weight"),
        )
    ]
    for i, mask in enumerate(masks):
        assert 0.45 < mask.float().mean() < 0.55
        for other in masks[i + 1 :]:
            assert 0.4 < (mask != other).float().mean() < 0.6
    again = dropout_keep(shape, 1 * 1_000_003 + 1, name_salt("q.weight"), 0.5, "cpu")
    assert torch.equal(again, masks[0])  # an int seed draws its tensor's mask


def test_export_peft_and_merge_of_a_quantized_run(llama3, runs, tmp_path) -> None:
    """``--peft`` writes the adapters alone; ``--merge`` dequantizes the int8 base, folds
    the adapters in and writes float32: its logits equal PEFT's on the dequantized base
    (within 1e-5)."""
    run = runs["int8"]
    peft_dir, merged_dir, base_dir = tmp_path / "peft", tmp_path / "merged", tmp_path / "base"
    for mode in (["--peft", str(peft_dir)], ["--hf", str(merged_dir), "--merge"]):
        result = invoke("export", *mode, "--from", str(run))
        assert result.exit_code == 0, result.output
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == RANK and sorted(config["target_modules"]) == sorted(TARGETS)
    weights, _, _, _ = read_checkpoint(run / "step_000006")
    dense = dense_base(weights)
    assert dense["0.self_attn.q_proj.weight"].dtype == torch.float32
    llama3.export_hf(
        llama3.config(PRESET), {k: v for k, v in dense.items() if ".lora_" not in k}, base_dir
    )
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        plain = base(input_ids=tokens).logits
        adapted = _peft().PeftModel.from_pretrained(base, peft_dir)(input_ids=tokens).logits
        merged_model = transformers.LlamaForCausalLM.from_pretrained(merged_dir)
        assert merged_model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
        merged = merged_model(input_ids=tokens).logits
    assert not torch.allclose(plain, merged, rtol=1e-5, atol=1e-5)  # the adapters trained
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


def test_a_resumed_nf4_run_with_dropout_equals_an_uninterrupted_one(
    hf_folder, runs, tmp_path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(runs["nf4"], out)
    for later in ("step_000004", "step_000006"):
        shutil.rmtree(out / later)
    resumed = invoke(*_args(out, hf_folder, 6, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "lora_base nf4" in resumed.output or "lora_base 'nf4'" in resumed.output
    theirs, their_opt, _, _ = read_checkpoint(runs["nf4"] / "step_000006")
    ours, our_opt, _, _ = read_checkpoint(out / "step_000006")
    assert set(ours) == set(theirs) and set(our_opt) == set(their_opt)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    for key in their_opt:
        assert torch.equal(our_opt[key], their_opt[key]), key


def test_lora_base_without_lora_is_one_line(tmp_path, hf_folder) -> None:
    args = _args(tmp_path / "a", hf_folder, 1, "--lora-base", "int8")
    args.remove("--lora")
    args.remove(str(RANK))
    assert_one_line_error(invoke(*args), 2, "--lora-base", "needs --lora RANK")


def test_an_evaluation_sees_the_adapters_on_the_quantized_base(runs) -> None:
    """``dataflow eval`` of the int8 run's checkpoints: the forward-only step holds the
    adapters and the int8 base as training does, so two checkpoints that differ only in
    their adapters score differently."""
    scores = []
    for step in ("step_000002", "step_000006"):
        result = invoke(
            "eval", "--from", str(runs["int8"] / step), "--json", "--eval-tokens", "64",
            "--val-data", "embedded:python-stdlib",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        scores.append(json.loads(result.stdout.splitlines()[-1])["val_loss"])
    assert all(3 < s < 8 for s in scores) and scores[0] != scores[1], scores


@pytest.mark.gpu
@pytest.mark.parametrize("base", ["int8", "nf4"])
def test_a_quantized_base_on_cuda_stays_bit_identical_and_learns(base) -> None:
    """On CUDA (bf16, the steps after the first replayed from a CUDA graph, which reads
    the update's number for the dropout masks from the device): the quantized base comes
    back bit-identical, the adapters move, the loss falls; the masks equal the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from dataflow_training.drive.run import TrainingRun

    train = TrainConfig(
        seq_len=16,
        batch=2,
        dtype=DtypePolicy.named("bf16"),
        optimizer=OptimizerPolicy(lr=1e-2),
        lora=LoraConfig(RANK, dropout=0.1, base=base),
    )
    run = TrainingRun.of("llama3", PRESET, train, device="cuda")
    tokens = torch.randint(0, run.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[:, :-1].contiguous().cuda(), tokens[:, 1:].contiguous().cuda())]
    before, _ = run.state()
    losses = [run.step(batch).loss for _ in range(4)]
    after, _ = run.state()
    run.close()
    for key in before:
        assert torch.equal(before[key], after[key]) == (".lora_" not in key), key
    assert before["0.self_attn.q_proj.weight"].dtype == getattr(
        torch, {"int8": "int8"}.get(base, "uint8")
    )
    assert losses[-1] < losses[0], losses
    seed = task_seed(torch.tensor(3.0, device="cuda"), 0, 1)  # as a replayed graph reads it
    on_cuda = dropout_keep((2, 16, 64), seed, name_salt("q.weight"), 0.1, "cuda")
    assert on_cuda.device.type == "cuda"
    assert torch.equal(
        on_cuda.cpu(),
        dropout_keep((2, 16, 64), task_seed(3, 0, 1), name_salt("q.weight"), 0.1, "cpu"),
    )


@pytest.mark.slow  # compiling the block functions: about 10 s of CPU
def test_the_compiled_resolver_runs_dropout_on_an_int8_base_as_eager_does(monkeypatch) -> None:
    """``aot_eager`` traces what inductor compiles: the dequantize ops and the dropout's
    mask, its seed a tensor input (no recompiling as the update changes)."""
    pytest.importorskip("dataflow_resolver_torch")
    from dataflow_resolver_torch import compiled
    from dataflow_training.drive.run import TrainingRun
    from dataflow_training.step.costs import RooflineCost

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    lora = LoraConfig(RANK, dropout=0.2, base="int8")
    train = TrainConfig(seq_len=16, batch=2, optimizer=OptimizerPolicy(lr=1e-2), lora=lora)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    batch = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
    losses = {}
    for resolver in ("torch", "torch-compiled"):
        torch._dynamo.reset()
        run = TrainingRun.of("llama3", PRESET, train, resolver=resolver, cost=RooflineCost())
        losses[resolver] = [run.step(batch).loss for _ in range(4)]
        run.close()
    torch._dynamo.reset()
    assert losses["torch-compiled"] == losses["torch"]
