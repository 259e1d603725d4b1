"""Stock PyTorch training, the baseline every dataflow speed figure is compared with.

What a user would run without dataflow: an ``nn.Module`` GPT-2 (pre-norm blocks,
``F.scaled_dot_product_attention`` with ``is_causal``, tanh GELU, tied output projection),
float32 master weights under ``torch.autocast(bfloat16)`` (or everything in bfloat16),
full-vocabulary logits with ``F.cross_entropy``, ``torch.optim.AdamW(fused=True)``,
optionally ``torch.compile``, optionally every block under ``torch.utils.checkpoint``,
with the speed tricks a user applies (``StockTricks``: the vocabulary padded to a
multiple of 64, TF32 float32 matmuls, optionally a compile mode and a fused linear
cross-entropy). ``build_stock`` makes the step (GPT-2 here; any other family's config, a
Llama-style decoder or its mixture-of-experts kin, is ``stock_decoder.StockDecoder``, a
DeepSeek V3, V3.2 or GLM 5 one ``stock_deepseek.StockDeepseek``);
``time_stock`` times it with CUDA events around forward, backward, optimizer step and
zero_grad.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

#: ``StockTricks.fused_ce`` values: ``auto`` is ``cce`` where ``cut_cross_entropy`` is
#: installed, else ``torch``
FUSED_CE = ("auto", "torch", "cce")
#: ``StockTricks.compile_mode`` values (``torch.compile(mode=...)``; None: its default)
COMPILE_MODES = (None, "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class StockTricks:
    """The speed settings a user adds to stock training, each named in docs/throughput.md.
    The defaults are the fastest stock setup anyone can reproduce with torch alone.

    - ``vocab_multiple``: the token table and the tied output projection get their rows
      rounded up to a multiple of it, and the logits are sliced back to the real
      vocabulary before the loss (the padded rows stay zero and get no gradient).
      nanoGPT and llm.c pad GPT-2's 50,257 to 50,304; issue 44 measured stock
      torch.compile GPT-2 124M on the H200 at 571,000-573,000 tokens/s padded against
      544,000 unpadded. 1: the vocabulary as it is.
    - ``tf32``: ``torch.backends.cuda.matmul.allow_tf32`` and
      ``torch.backends.cudnn.allow_tf32`` on while the row runs (float32 matmuls, the
      autocast rows' few, on the tensor cores), as nanoGPT sets them.
    - ``compile_mode``: ``torch.compile``'s ``mode``; ``"max-autotune-no-cudagraphs"``
      autotunes the matmuls and generated kernels (its compile takes many minutes, so it
      is an option, not the default).
    - ``fused_ce``: ``"cce"`` computes the head and its loss with ``cut_cross_entropy``'s
      ``linear_cross_entropy`` (no logits tensor), ``"torch"`` with a matmul and
      ``F.cross_entropy``, ``"auto"`` the first where it is installed.
    """

    vocab_multiple: int = 64
    tf32: bool = True
    compile_mode: str | None = None
    fused_ce: str = "auto"

    def __post_init__(self) -> None:
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be at least 1, got {self.vocab_multiple}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}")
        if self.fused_ce not in FUSED_CE:
            raise ValueError(f"fused_ce must be one of {', '.join(FUSED_CE)}")

    @property
    def cce(self) -> bool:
        """Whether the loss is ``cut_cross_entropy``'s (``fused_ce``)."""
        installed = importlib.util.find_spec("cut_cross_entropy") is not None
        if self.fused_ce == "cce" and not installed:
            raise ValueError("fused_ce='cce' but cut_cross_entropy is not installed")
        return self.fused_ce == "cce" or (self.fused_ce == "auto" and installed)

    def described(self) -> dict[str, Any]:
        """The settings as a row's details record them (``fused_ce`` resolved)."""
        return dataclasses.asdict(self) | {"fused_ce": "cce" if self.cce else "torch"}


#: the stock model of earlier rows: none of the tricks
PLAIN = StockTricks(vocab_multiple=1, tf32=False, fused_ce="torch")


def padded(vocab: int, multiple: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple``."""
    return -(-vocab // multiple) * multiple


@contextlib.contextmanager
def stock_settings(tricks: StockTricks) -> Iterator[None]:
    """The process-wide torch settings of ``tricks`` while a stock row runs, restored
    after (the dataflow rows of the same run keep torch's defaults)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tricks.tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def vocab_loss(
    hidden: torch.Tensor, weight: torch.Tensor, vocab: int, targets: torch.Tensor, cce: bool
) -> torch.Tensor:
    """The mean cross-entropy of ``hidden`` (batch, seq, dim) against the output
    projection ``weight`` (stored rows, dim) over its first ``vocab`` rows: the logits
    matmul over every stored row (the aligned shape), sliced back before the softmax; or
    ``cut_cross_entropy``'s fused kernel over the real rows (``cce``)."""
    if cce:
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy(hidden, weight[:vocab], targets)
    logits = hidden @ weight.t()
    return F.cross_entropy(logits[..., :vocab].float().flatten(0, 1), targets.flatten())


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.c_fc, self.mlp_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class StockGPT2(nn.Module):
    def __init__(
        self,
        vocab: int,
        positions: int,
        n_embd: int,
        n_layer: int,
        n_head: int,
        *,
        checkpoint: bool = False,
        vocab_multiple: int = 1,
        cce: bool = False,
    ) -> None:
        super().__init__()
        self.checkpoint, self.vocab, self.cce = checkpoint, vocab, cce
        self.wte = nn.Embedding(padded(vocab, vocab_multiple), n_embd)
        self.wpe = nn.Embedding(positions, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        with torch.no_grad():
            self.wte.weight[vocab:].zero_()  # padding: never looked up, no gradient

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return vocab_loss(self.ln_f(x), self.wte.weight, self.vocab, targets, self.cce)


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def is_gpt2(config: Any) -> bool:
    return hasattr(config, "n_positions")


def stock_model(
    config: Any,
    seq_len: int,
    *,
    checkpoint: bool = False,
    device: str = "cuda",
    dtype: str = "bf16",
    tricks: StockTricks = PLAIN,
) -> nn.Module:
    """The stock model of ``config`` on ``device``, initialised there (an 8B model's
    weights are drawn on the GPU, not the host), all bfloat16 for ``dtype='bf16'``, with
    the vocabulary padding and loss of ``tricks``."""
    from benchmarks.harness.stock_decoder import decoder_type

    floating = torch.bfloat16 if dtype == "bf16" else torch.float32
    with torch.device(device):
        if is_gpt2(config):
            model = StockGPT2(
                config.vocab_size,
                config.n_positions,
                config.n_embd,
                config.n_layer,
                config.n_head,
                checkpoint=checkpoint,
                vocab_multiple=tricks.vocab_multiple,
                cce=tricks.cce,
            )
        else:
            model = decoder_type(config)(
                config,
                seq_len,
                checkpoint=checkpoint,
                vocab_multiple=tricks.vocab_multiple,
                cce=tricks.cce,
            )
    return model.to(device=device, dtype=floating)


def build_stock(
    config: Any,
    batch: int,
    seq_len: int,
    *,
    compile: bool = False,
    dtype: str = "autocast",
    checkpoint: bool = False,
    device: str = "cuda",
    compile_backend: str = "inductor",
    tricks: StockTricks = PLAIN,
) -> Callable[[int], None]:
    """One stock training step as a function of the step index (four random batches,
    cycled), with the model and optimizer built.

    ``config`` is GPT-2's or a decoder family's (``stock_model``). ``dtype``: ``autocast``
    (float32 master weights, bf16 autocast) or ``bf16`` (the model, its gradients and
    AdamW state in bfloat16). ``checkpoint`` wraps every block in
    ``torch.utils.checkpoint`` (its activations are recomputed in backward). ``tricks``:
    the vocabulary padding, loss and compile mode (``StockTricks``; its TF32 settings are
    ``stock_settings``', around the steps)."""
    if dtype not in ("autocast", "bf16"):
        raise ValueError(f"dtype: {dtype!r} is not 'autocast' or 'bf16'")
    torch.manual_seed(0)
    model = stock_model(
        config, seq_len, checkpoint=checkpoint, device=device, dtype=dtype, tricks=tricks
    )
    optim = torch.optim.AdamW(
        _decay_groups(model, 0.1),
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.startswith("cuda"),
    )
    forward = (
        torch.compile(model, backend=compile_backend, mode=tricks.compile_mode)
        if compile
        else model
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    data = [
        (
            torch.randint(0, config.vocab_size, (batch, seq_len), generator=g).to(device),
            torch.randint(0, config.vocab_size, (batch, seq_len), generator=g).to(device),
        )
        for _ in range(4)
    ]
    device_type = torch.device(device).type

    def step(i: int) -> None:
        tokens, targets = data[i % len(data)]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=dtype == "autocast"):
            loss = forward(tokens, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return step


def time_stock(
    config: Any,
    batch: int,
    seq_len: int,
    *,
    compile: bool = False,
    steps: int = 10,
    warmup: int = 3,
    dtype: str = "autocast",
) -> dict[str, float]:
    """Median step time (ms) and the allocator's peak of stock training at this shape.

    ``dtype``: ``autocast`` (float32 master weights, bf16 autocast) or ``bf16`` (the model
    and optimizer state in bfloat16)."""
    step = build_stock(config, batch, seq_len, compile=compile, dtype=dtype)
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated()
    return {"step_ms": statistics.median(times), "peak_bytes": peak, "times_ms": times}
