"""The stock rows' speed tricks (``benchmarks/harness/stock.py``'s ``StockTricks``, issue
44): the vocabulary padded to a multiple of 64 with the logits sliced back changes no
loss and no gradient of the real rows (float32 on the CPU, to rounding), the padded rows
stay zero through AdamW, and the settings are recorded and restored."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from benchmarks import compare  # noqa: E402
from benchmarks.harness import stock, stock_decoder  # noqa: E402
from dataflow.plugins import families  # noqa: E402

VOCAB = 300  # padded to 320
CCE = importlib.util.find_spec("cut_cross_entropy") is not None


def _batch(seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, seq + 1), generator=g)
    tokens[0, 0] = VOCAB - 1
    return tokens[:, :-1], tokens[:, 1:]


def _gpt2(multiple: int) -> torch.nn.Module:
    config = families().get("gpt2").load().config("gpt2_tiny")
    torch.manual_seed(0)
    return stock.StockGPT2(
        VOCAB, config.n_positions, config.n_embd, config.n_layer, config.n_head,
        vocab_multiple=multiple,
    )  # fmt: skip


def _decoder(multiple: int) -> torch.nn.Module:
    family = families().get("llama3").load()
    config = family.config("llama3_tiny", vocab_size=VOCAB, tie_word_embeddings=False)
    torch.manual_seed(0)
    return stock_decoder.StockDecoder(config, 16, vocab_multiple=multiple)


def _same_real_weights(padded: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Copy ``plain``'s weights into ``padded``'s real rows."""
    with torch.no_grad():
        for name, param in padded.named_parameters():
            source = dict(plain.named_parameters())[name]
            param[: source.shape[0]].copy_(source)


@pytest.mark.parametrize(
    ("build", "tables"),
    [(_gpt2, ["wte.weight"]), (_decoder, ["emb.embed_tokens.weight", "head.lm_head.weight"])],
    ids=["gpt2", "llama3 untied"],
)
def test_padded_stock_model_equals_the_unpadded_one(build, tables) -> None:
    padded, plain = build(64), build(1)
    params = dict(padded.named_parameters())
    for name in tables:
        assert params[name].shape[0] == 320 and params[name][VOCAB:].count_nonzero() == 0
        assert dict(plain.named_parameters())[name].shape[0] == VOCAB
    _same_real_weights(padded, plain)
    tokens, targets = _batch()
    losses = []
    for model in (padded, plain):
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    plain_params = dict(plain.named_parameters())
    for name, param in params.items():
        rows = plain_params[name].shape[0]
        torch.testing.assert_close(param.grad[:rows], plain_params[name].grad, rtol=1e-5, atol=1e-7)
        assert param.grad[rows:].count_nonzero() == 0, name  # the padding gets no gradient
    if hasattr(padded, "logits"):  # sliced back: the real vocabulary's logits
        assert padded.logits(tokens).shape[-1] == VOCAB


def test_padded_rows_stay_zero_through_adamw_with_weight_decay() -> None:
    """The stock step's model and optimizer (``_decay_groups``: decay on the table)."""
    config = families().get("gpt2").load().config("gpt2_tiny", vocab_size=VOCAB)
    tricks = stock.StockTricks(fused_ce="torch")
    step = stock.build_stock(config, 2, 16, dtype="bf16", device="cpu", tricks=tricks)
    step(0)  # the whole stock step runs padded
    model = stock.stock_model(config, 16, device="cpu", dtype="autocast", tricks=tricks)
    assert model.wte.weight.shape[0] == 320
    optim = torch.optim.AdamW(stock._decay_groups(model, 0.1), lr=1e-2)
    tokens, targets = _batch()
    for _ in range(3):
        model(tokens, targets).backward()
        optim.step()
        optim.zero_grad()
    assert model.wte.weight[VOCAB:].count_nonzero() == 0
    assert model.wte.weight[:VOCAB].count_nonzero() > 0


def test_tricks_default_to_the_fastest_stock_setup_and_are_described() -> None:
    tricks = stock.StockTricks()
    assert (tricks.vocab_multiple, tricks.tf32, tricks.compile_mode) == (64, True, None)
    assert tricks.described()["fused_ce"] == ("cce" if CCE else "torch")
    assert stock.padded(50257, 64) == 50304 and stock.padded(128256, 64) == 128256
    for bad in ({"vocab_multiple": 0}, {"compile_mode": "fast"}, {"fused_ce": "liger"}):
        with pytest.raises(ValueError):
            stock.StockTricks(**bad)


@pytest.mark.skipif(CCE, reason="cut_cross_entropy is installed")
def test_cce_asked_for_but_not_installed_is_one_line(capsys) -> None:
    assert compare.main(["--stock-ce", "cce", "--rows", "stock", "--device", "cpu"]) == 2
    assert "cut_cross_entropy is not installed" in capsys.readouterr().err
    assert compare.main(["--stock-vocab-multiple", "0", "--device", "cpu"]) == 2
    assert "--stock-vocab-multiple must be >= 1" in capsys.readouterr().err


def test_stock_settings_turn_tf32_on_for_the_row_and_restore_it() -> None:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        with stock.stock_settings(stock.StockTricks()):
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.gpu
@pytest.mark.skipif(not CCE, reason="needs cut_cross_entropy")
def test_cce_loss_equals_the_sliced_logits_loss() -> None:
    """The fused linear cross-entropy over the real rows against the padded matmul sliced
    back, bf16 on the GPU: the loss within 1e-2 relative."""
    config = families().get("gpt2").load().config("gpt2_tiny", vocab_size=VOCAB)
    tokens, targets = (t.cuda() for t in _batch())
    losses = []
    for cce in (True, False):
        torch.manual_seed(0)
        model = stock.stock_model(
            config,
            16,
            device="cuda",
            dtype="bf16",
            tricks=stock.StockTricks(fused_ce="cce" if cce else "torch"),
        )
        losses.append(model(tokens, targets).float())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=0)
