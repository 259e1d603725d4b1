"""LoRA (``TrainConfig.lora``, ``dataflow train --lora``) on llama3_tiny and the CPU.

From a Hugging Face folder (a ``LlamaForCausalLM`` of llama3_tiny's config, every weight
perturbed, saved by ``save_pretrained``): the lowered step holds the adapters as objects
of their own and no gradient or optimizer state of the base; the adapters' gradients
equal PEFT's (autograd through ``peft`` on the same model); a run's base weights come out
bit-identical while the loss falls; ``export --peft`` loads in ``peft`` and ``export --hf
--merge`` in transformers, both with logits equal to dataflow's own math (float32,
within 1e-5); a resumed LoRA run equals an uninterrupted one. Skipped without
transformers and peft."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dataflow_training.drive.checkpoint import read_checkpoint
from dataflow_training.kit.lora import init_adapters, with_lora
from dataflow_training.step.config import OptimizerPolicy, TrainConfig
from dataflow_training.step.family import Env, load_family
from dataflow_training.step.freezing import parameter_counts
from dataflow_training.step.lora import LoraConfig, LoraError, lora_layers
from dataflow_training.step.lowering import lower
from dataflow_training.step.ops import load_ops

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_llama3")
transformers = pytest.importorskip("transformers", reason="the LoRA tests need transformers")
if importlib.util.find_spec("peft") is None:
    pytest.skip("the LoRA tests need peft", allow_module_level=True)


def _peft():
    """peft, imported by a test, not while pytest collects: it imports transformers'
    models, which import the installed ``kernels`` package, and during collection the
    repository's ``kernels/`` folder holds that name (conftest.py)."""
    import peft

    return peft


PRESET = "llama3_tiny"  # 2 blocks; the head ties the embedding's table
RANK = 4
TOLERANCE = 1e-5  # float32, relative and absolute


@pytest.fixture(scope="module")
def llama3():
    return load_family("llama3")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, llama3) -> Path:
    """A llama3_tiny-shaped ``LlamaForCausalLM`` saved by transformers."""
    # the family's config.json fields, as transformers reads them
    fields = llama3.config_to_hf(llama3.config(PRESET), torch.float32)
    config = transformers.LlamaConfig(**fields)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # HF init leaves norms at 1: perturb everything
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("hf") / "llama3_tiny"
    model.save_pretrained(folder)
    return folder


def _args(out: Path, hf: Path, steps: int, *extra: str) -> list[str]:
    return [
        # the shape pinned (2 x 2 rounds): a searched one is priced by this CPU's timings,
        # and another batch a step moves the 6-step losses the test reads
        "train", "--init", str(hf), "--steps", str(steps), "--batch", "2", "--seq-len", "16",
        "--ga-rounds", "2", "--device", "cpu", "--lr", "1e-2", "--warmup", "0",
        "--checkpoint-every", "2",
        "--lora", str(RANK), "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hf_folder) -> Path:
    """A 6-step LoRA run from the HF folder, a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("lora") / "run"
    result = invoke(*_args(out, hf_folder, 6))
    assert result.exit_code == 0, result.output
    return out


def test_the_adapters_are_objects_of_their_own_on_a_frozen_base(llama3) -> None:
    lora = LoraConfig(RANK)
    layers = lora_layers(llama3.layers(llama3.config(PRESET)), lora)
    block = layers[1]
    (group,) = [g for g in block.groups if g.name == "lora"]
    assert [p.name for p in group.params][:2] == [
        "self_attn.q_proj.lora_A.weight",
        "self_attn.q_proj.lora_B.weight",
    ]
    assert len(group.params) == 2 * 7  # q, k, v, o, gate, up, down
    shapes = {p.name: p.shape for p in group.params}
    assert shapes["mlp.down_proj.lora_A.weight"] == (RANK, llama3.config(PRESET).intermediate_size)
    assert shapes["self_attn.q_proj.lora_B.weight"] == (llama3.config(PRESET).q_width, RANK)
    assert all(
        not p.trainable
        for layer in layers
        for g in layer.groups
        if g.name != "lora"
        for p in g.params
    )
    total, trainable = parameter_counts(layers)
    per_block = sum(shape[0] * shape[1] for shape in shapes.values())
    assert trainable == 2 * per_block and trainable < total / 4
    program = lower(llama3, PRESET, TrainConfig(seq_len=16, batch=2, lora=lora)).program
    ids = {o.id for o in program.objects}
    assert {"W_0.lora", "dW_0.lora", "O_0.lora", "W_1.lora", "dW_1.lora", "O_1.lora"} <= ids
    assert not {"dW_emb", "O_emb", "dW_0", "O_0", "dW_1", "O_1", "dW_head", "O_head"} & ids
    opt = sorted(t.id for t in program.tasks if t.id.startswith("opt_"))
    assert opt == ["opt_0_0_0.lora", "opt_0_0_1.lora"]
    assert not any(t.id.startswith("embbwd") for t in program.tasks)
    # the base is only ever read
    assert not any({"W_emb", "W_0", "W_1", "W_head"} & set(t.mutates) for t in program.tasks)
    # priced: the adapters' matmuls added, no dW of their targets (Llama 3.2 1B at
    # 2 x 4096 tokens, compute-bound on the roofline)
    full, adapted = (
        lower(llama3, "l3_1b", TrainConfig(seq_len=4096, batch=2, lora=x)).program
        for x in (None, LoraConfig(16))
    )

    def cost_us(program, kind):
        return sum(t.cost_us for t in program.tasks if t.id.startswith(f"{kind}_"))

    assert cost_us(full, "fwd") < cost_us(adapted, "fwd") < 1.02 * cost_us(full, "fwd")
    assert cost_us(adapted, "bwd") < 0.7 * cost_us(full, "bwd")
    with pytest.raises(LoraError, match="--lora-targets c_attn: no linear"):
        lora_layers(layers, LoraConfig(RANK, targets=("c_attn",)))
    with pytest.raises(LoraError, match="experts"):
        lora_layers(layers, LoraConfig(RANK, targets=("experts",)))


def _state_and_batch(llama3, hf_folder):
    _, state = llama3.import_hf(hf_folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, llama3.config(PRESET).vocab_size, (2, 17), generator=g)
    return state, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _dataflow_logits(llama3, state, tokens, lora: LoraConfig) -> torch.Tensor:
    """Logits of dataflow's own math (the kit's block forwards through ``env.ops``, the
    adapters unmerged), the head's norm and tied projection written out."""
    config = llama3.config(PRESET)
    layers = lora_layers(llama3.layers(config), lora)
    env = Env(with_lora(load_ops("cpu", llama3.ops), lora))

    def params(layer):
        return {p.name: state[f"{layer.name}.{p.name}"] for p in layer.params}

    hidden = llama3.math("embed").forward(config, params(layers[0]), tokens, env)
    for layer in layers[1:-1]:
        hidden, _, _ = llama3.math(layer.kind).forward(config, params(layer), hidden, env)
    norm = env.ops["rms_norm_fwd"](hidden, state["head.norm.weight"], config.rms_norm_eps)[0]
    return norm @ state["emb.embed_tokens.weight"][: config.vocab_size].t()


def test_the_adapters_gradients_equal_peft_s(llama3, hf_folder) -> None:
    """One step's gradients (dataflow's hand-written backward) against autograd through
    peft's LoRA on the transformers model, the same adapters in both."""
    from dataflow_training.drive.run import TrainingRun

    lora = LoraConfig(RANK, alpha=8.0)
    state, tokens, targets = _state_and_batch(llama3, hf_folder)
    init_adapters(lora_layers(llama3.layers(llama3.config(PRESET)), lora), state, 0, torch.float32)
    g = torch.Generator().manual_seed(1)  # B nonzero, so dA is too
    start = {
        k: (torch.randn(v.shape, generator=g) * 0.1 if ".lora_B." in k else v)
        for k, v in state.items()
    }
    train = TrainConfig(seq_len=16, batch=2, lora=lora, optimizer=OptimizerPolicy(lr=0.0))
    run = TrainingRun.of(
        "llama3", PRESET, train, device="cpu", resolver="torch", state=start, keep_grads=True
    )
    run.step([(tokens, targets)])
    grads = run.grads()
    model = _peft().get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(hf_folder, dtype=torch.float32),
        _peft().LoraConfig(r=RANK, lora_alpha=8, target_modules=list(_TARGETS)),
    )
    _load_adapters(model, start)
    logits = model(input_ids=tokens).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    theirs = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    mine = _by_peft_name(grads)
    assert set(mine) == set(theirs)
    for name, grad in theirs.items():
        torch.testing.assert_close(mine[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    run.close()


_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft_name(key: str) -> str:
    layer, _, name = key.partition(".")
    return f"base_model.model.model.layers.{layer}.{name}".replace(".weight", ".default.weight")


def _by_peft_name(tensors) -> dict[str, torch.Tensor]:
    return {_peft_name(k): v for k, v in tensors.items() if ".lora_" in k}


def _load_adapters(model, state) -> None:
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in _by_peft_name(state).items():
            named[name].copy_(value)


def test_a_lora_run_keeps_its_base_bit_identical_and_learns(llama3, hf_folder, lora_run) -> None:
    _, base = llama3.import_hf(hf_folder, dtype=torch.float32)
    weights, opt, manifest, _ = read_checkpoint(lora_run / "step_000006")
    assert manifest["train"]["lora"]["rank"] == RANK
    assert set(opt) == {"O_0.lora", "O_1.lora"}
    for key, tensor in base.items():
        assert torch.equal(weights[key], tensor), key
    adapters = {k for k in weights if ".lora_" in k}
    assert len(adapters) == 2 * 2 * 7 and set(weights) == set(base) | adapters
    assert any(weights[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)
    metrics = [json.loads(x) for x in (lora_run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.05, losses


def test_the_peft_export_and_the_merged_model_give_dataflow_s_logits(
    llama3, hf_folder, lora_run, tmp_path
) -> None:
    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    result = invoke("export", "--peft", str(peft_dir), "--from", str(lora_run))
    assert result.exit_code == 0, result.output
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == 2 * RANK
    assert sorted(config["target_modules"]) == sorted(_TARGETS)
    result = invoke("export", "--hf", str(merged_dir), "--from", str(lora_run), "--merge")
    assert result.exit_code == 0, result.output

    weights, _, _, _ = read_checkpoint(lora_run / "step_000006")
    _, tokens, _ = _state_and_batch(llama3, hf_folder)
    ours = _dataflow_logits(llama3, weights, tokens, LoraConfig(RANK))
    base_model = transformers.LlamaForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    with torch.no_grad():
        plain = base_model(input_ids=tokens).logits
        adapted = _peft().PeftModel.from_pretrained(base_model, peft_dir)(input_ids=tokens).logits
        merged_model = transformers.LlamaForCausalLM.from_pretrained(
            merged_dir, dtype=torch.float32
        )
        merged = merged_model(input_ids=tokens).logits
    assert not torch.allclose(plain, ours, rtol=TOLERANCE, atol=TOLERANCE)  # it trained
    torch.testing.assert_close(adapted, ours, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(merged, ours, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_resumed_lora_run_equals_an_uninterrupted_one(hf_folder, lora_run, tmp_path) -> None:
    """The run's folder as it was after step 2 (its later checkpoints removed), resumed to
    step 6: the weights and the optimizer state equal the uninterrupted run's, bit for bit."""
    out = tmp_path / "run"
    shutil.copytree(lora_run, out)
    for later in ("step_000004", "step_000006"):
        shutil.rmtree(out / later)
    resumed = invoke(*_args(out, hf_folder, 6, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output
    theirs, their_opt, _, _ = read_checkpoint(lora_run / "step_000006")
    ours, our_opt, _, _ = read_checkpoint(out / "step_000006")
    assert set(ours) == set(theirs) and set(our_opt) == set(their_opt)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    for key in their_opt:
        assert torch.equal(our_opt[key], their_opt[key]), key


def test_bad_lora_options_are_one_line(tmp_path, hf_folder) -> None:
    result = invoke(*_args(tmp_path / "a", hf_folder, 1, "--lora-targets", "q_proj,nope"))
    assert_one_line_error(result, 1, "--lora-targets nope", "no linear of the model")
    result = invoke(*_args(tmp_path / "b", hf_folder, 1, "--lora-dropout", "1.5"))
    assert_one_line_error(result, 2, "--lora-dropout 1.5", "[0, 1)")


def _lora_losses(family: str, preset: str, resolver: str, device: str = "cpu", **train):
    """(losses, weights before, weights after) of a 3-step LoRA run on one batch."""
    from dataflow_training.drive.run import TrainingRun
    from dataflow_training.step.costs import RooflineCost

    config = TrainConfig(
        seq_len=16, batch=2, optimizer=OptimizerPolicy(lr=1e-2), lora=LoraConfig(RANK), **train
    )
    options = {"cost": RooflineCost()} if device == "cpu" else {}
    run = TrainingRun.of(family, preset, config, device=device, resolver=resolver, **options)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.vocab_size, (2, 17), generator=g).to(device)
    batch = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
    before, _ = run.state()
    losses = [run.step(batch).loss for _ in range(3)]
    after, _ = run.state()
    run.close()
    return losses, before, after


def _only_adapters_moved(before, after) -> None:
    for key in before:
        assert torch.equal(before[key], after[key]) == (".lora_" not in key), key


def test_a_bf16_base_stays_bit_identical() -> None:
    from dataflow_training.step.config import DtypePolicy

    losses, before, after = _lora_losses("llama3", PRESET, "torch", dtype=DtypePolicy.named("bf16"))
    assert before["0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    _only_adapters_moved(before, after)
    assert losses[-1] < losses[0], losses


@pytest.mark.slow  # compiling the block functions: about 10 s of CPU
def test_the_compiled_resolver_runs_the_adapters_as_eager_does(monkeypatch) -> None:
    """``aot_eager`` traces what inductor compiles: the ops' ``lora`` entry and the
    adapters' math trace into the block functions."""
    pytest.importorskip("dataflow_resolver_torch")
    from dataflow_resolver_torch import compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    torch._dynamo.reset()
    eager = _lora_losses("llama3", PRESET, "torch")[0]
    assert _lora_losses("llama3", PRESET, "torch-compiled")[0] == eager
    torch._dynamo.reset()


def test_gpt2_s_fused_linears_take_adapters_and_export_to_peft(tmp_path) -> None:
    """GPT-2's ``Conv1D`` linears (stored transposed in HF's files): the adapters train on
    ``c_attn``, ``c_proj`` and ``c_fc`` with their biases frozen, and the PEFT export says
    ``fan_in_fan_out``; PEFT's logits equal the merged model's."""
    pytest.importorskip("dataflow_family_gpt2")
    from dataflow_training.drive.checkpoint import latest_checkpoint
    from dataflow_training.drive.peft_export import base_state

    out = tmp_path / "run"
    result = invoke(
        "train", "--preset", "gpt2_tiny", "--lora", str(RANK), "--steps", "3", "--batch", "2",
        "--seq-len", "16", "--device", "cpu", "--lr", "1e-2", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for mode in (["--peft", str(tmp_path / "peft")], ["--hf", str(tmp_path / "merged"), "--merge"]):
        result = invoke("export", *mode, "--from", str(out))
        assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] and config["target_modules"] == ["c_attn", "c_fc", "c_proj"]
    gpt2 = load_family("gpt2")
    weights, _, _, _ = read_checkpoint(latest_checkpoint(out))
    gpt2.export_hf(gpt2.config("gpt2_tiny"), base_state(weights), tmp_path / "base")
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        plain = base(tokens).logits
        adapted = _peft().PeftModel.from_pretrained(base, tmp_path / "peft")(tokens).logits
        merged = merged_model(tokens).logits
    assert not torch.allclose(plain, merged, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(adapted, merged, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("resolver", ["torch", "torch-compiled"])
def test_a_lora_run_on_cuda_keeps_its_base_and_learns(resolver) -> None:
    """On CUDA (bf16, the steps after the first replayed from a CUDA graph): the base comes
    back bit-identical and the loss falls."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("dataflow_resolver_torch")
    from dataflow_training.step.config import DtypePolicy

    losses, before, after = _lora_losses(
        "llama3", PRESET, resolver, device="cuda", dtype=DtypePolicy.named("bf16")
    )
    _only_adapters_moved(before, after)
    assert losses[-1] < losses[0], losses
