"""LoRA: low-rank adapters trained on a frozen base (``TrainConfig.lora``).

Each target linear ``W`` (out, in) of a block gets two parameters of its own, PEFT's
names after the weight's module: ``<module>.lora_A.weight`` (rank, in) and
``<module>.lora_B.weight`` (out, rank), e.g. ``self_attn.q_proj.lora_A.weight``. The
forward becomes ``y = x W^T + (alpha / rank) * (x A^T) B^T`` (``kit.linear.Linear``, the
one place the kit's math calls a projection); the backward gives ``dA``, ``dB`` and ``dx``
through ``W`` and the adapter, and no ``dW``.

``lora_layers`` adds the adapters of each block as a parameter group of their own,
``lora`` (object ``W_<layer>.lora``: resident or streamed as the planner chooses, apart
from the frozen base) and freezes every other parameter of the model: the embedding, the
head, the norms, the base weights. Freezing (``step.freezing``) then gives the base no
gradient or optimizer state and prunes the backward of the embedding.

Targets name a linear by the last part of its module (``q_proj``, ``c_attn``); the
default is every dense projection of the builtin families (``DEFAULT_TARGETS``: Llama's
and Qwen's ``q,k,v,o`` and ``gate,up,down``, GPT-2's fused ``c_attn``, ``c_proj``,
``c_fc``). A MoE's routed experts are stacked tensors that no ``Linear`` runs (their
grouped matmuls): they are not targets in this version, and naming ``experts`` is an
error that says so.

The base (``LoraConfig.base``, ``--lora-base``) may be stored apart from the run's
parameter dtype: ``bf16``, or quantized as ``int8`` (per output row, symmetric absmax:
``weight`` int8 (out, in) and ``weight_scale`` float32 (out,), ``w = code * scale``) or
``nf4`` (QLoRA's 4-bit NormalFloat: ``weight`` uint8 (out, in / 2), two codes a byte, the
first element in the high nibble, and ``weight_scale`` float32 (out * in / 64,), the
absmax of each block of 64 consecutive elements of the row-major weight, ``w = NF4[code]
* absmax``). ``lora_layers`` gives every dense projection of a block (``DEFAULT_TARGETS``
and the targets), adapted or not, that storage: the step's ``W`` objects hold those
bytes, so the planner streams fewer of them. The math dequantizes one projection at a
time (``kit.lora_base``). Step-stage code: no torch here (``kit.lora`` and
``kit.lora_base`` hold the math).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dataflow_training.step.family import LayerCost, LayerSpec, ParamGroup, TensorSpec

#: the projections of the kit's dense families (module names' last part)
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "c_attn",
    "c_proj",
    "c_fc",
)

#: the adapter group's name: object ``W_<layer>.lora``
GROUP = "lora"


class LoraError(ValueError):
    """LoRA settings that cannot apply to the model; the message names the option."""


def _rank(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoraError(f"--lora {value!r}: the rank is a whole number >= 1 (e.g. --lora 16)")


def _dropout(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise LoraError(f"--lora-dropout {value}: a probability in [0, 1)")


#: ``--lora-base``: how the frozen base's projections are stored (None: the run's dtype)
BASES = ("bf16", "int8", "nf4")
#: the storage dtype of each base's weight entry
BASE_DTYPES = {"bf16": "bfloat16", "int8": "int8", "nf4": "uint8"}
#: NF4's block: the elements that share one absmax
NF4_BLOCK = 64
#: the suffix of a quantized weight's scales (``<module>.weight_scale``)
SCALE_SUFFIX = "_scale"


def _base(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in BASES:
        raise LoraError(f"--lora-base {value!r}: one of {', '.join(BASES)}")


@attrs.frozen
class LoraConfig:
    """``rank``; ``alpha`` (None: ``2 * rank``, a scale ``alpha / rank`` of 2 whatever the
    rank, so changing the rank keeps the size of the first updates); ``dropout`` on the
    adapters' input (``kit.lora``: the base sees ``x``, the adapter ``dropout(x)``);
    ``targets``, module names (empty: those of ``DEFAULT_TARGETS`` the model has);
    ``base``, how the frozen projections are stored (``BASES``; None: in the run's
    parameter dtype)."""

    rank: int = attrs.field(validator=_rank)
    alpha: float | None = None
    dropout: float = attrs.field(default=0.0, validator=_dropout)
    targets: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    base: str | None = attrs.field(default=None, validator=_base)

    @property
    def scale(self) -> float:
        """``alpha / rank``: what the adapter's product is multiplied by."""
        return (2.0 * self.rank if self.alpha is None else float(self.alpha)) / self.rank

    @property
    def lora_alpha(self) -> float:
        return 2.0 * self.rank if self.alpha is None else float(self.alpha)


def adapter_names(weight: str) -> tuple[str, str]:
    """(A's name, B's name) of the weight named ``weight`` (``self_attn.q_proj.weight`` ->
    ``self_attn.q_proj.lora_A.weight``, ``self_attn.q_proj.lora_B.weight``)."""
    module = weight.removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def is_target(param: TensorSpec, targets: Sequence[str]) -> bool:
    """Whether ``param`` is the weight of a target linear: a 2-D ``<...>.<target>.weight``."""
    parts = param.name.split(".")
    return (
        len(param.shape) == 2
        and parts[-1] == "weight"
        and len(parts) > 1
        and (parts[-2] in targets)
    )


def scale_name(weight: str) -> str:
    """The name of a quantized weight's scales (``<module>.weight_scale``)."""
    return weight + SCALE_SUFFIX


def base_specs(param: TensorSpec, base: str | None, layer: str = "") -> tuple[TensorSpec, ...]:
    """How the frozen projection weight ``param`` (out, in) is stored under ``base``
    (module docstring): itself in ``bf16``, codes and scales quantized; ``param`` as it
    is with no base. A weight nf4 cannot block is a ``LoraError`` naming it."""
    if base is None:
        return (param,)
    out_features, in_features = param.shape
    if base == "bf16":
        return (attrs.evolve(param, dtype="bfloat16"),)
    if base == "int8":
        rows = (out_features,)
        codes = attrs.evolve(param, dtype="int8")
    else:
        count = out_features * in_features
        if in_features % 2 or count % NF4_BLOCK:
            raise LoraError(
                f"--lora-base nf4: {layer}.{param.name} ({out_features} x {in_features}) "
                f"has an odd row or a size that is no multiple of the block, {NF4_BLOCK}; "
                "give --lora-base int8"
            )
        rows = (count // NF4_BLOCK,)
        codes = attrs.evolve(param, shape=(out_features, in_features // 2), dtype="uint8")
    scales = TensorSpec(scale_name(param.name), rows, "float32", decay=False, trainable=False)
    return codes, scales


def lora_layers(layers: Sequence[LayerSpec], lora: LoraConfig | None) -> tuple[LayerSpec, ...]:
    """``layers`` with every parameter frozen and, in each block, the adapters of its
    target linears as a trainable group ``lora`` (module docstring), every dense
    projection stored as ``lora.base`` says; ``layers`` as they are without ``lora``. A
    target that names no linear of the model is a ``LoraError``."""
    if lora is None:
        return tuple(layers)
    if "experts" in lora.targets:
        raise LoraError(
            "--lora-targets experts: adapters on a MoE's routed experts are not built yet "
            "(their grouped matmuls take no adapter); target the attention and shared "
            "projections instead"
        )
    found: set[str] = set()
    out = []
    projections = DEFAULT_TARGETS + tuple(lora.targets)
    for index, layer in enumerate(layers):
        block = 0 < index < len(layers) - 1
        frozen = tuple(
            attrs.evolve(
                group,
                params=tuple(
                    spec
                    for p in group.params
                    for spec in (
                        base_specs(attrs.evolve(p, trainable=False), lora.base, layer.name)
                        if block and not group.name and is_target(p, projections)
                        else (attrs.evolve(p, trainable=False),)
                    )
                ),
            )
            for group in layer.groups
        )
        adapters: list[TensorSpec] = []
        for group in layer.groups if block else ():
            if group.name:  # a named group (experts) is not run by a Linear
                continue
            for p in group.params:
                if is_target(p, lora.targets or DEFAULT_TARGETS):
                    found.add(p.name.split(".")[-2])
                    out_features, in_features = p.shape
                    a, b = adapter_names(p.name)
                    adapters += [
                        TensorSpec(a, (lora.rank, in_features)),
                        TensorSpec(b, (out_features, lora.rank)),
                    ]
        groups = frozen + ((ParamGroup(GROUP, adapters),) if adapters else ())
        out.append(attrs.evolve(layer, groups=groups))
    missing = [t for t in lora.targets if t not in found]
    if missing or not found:
        names = sorted(
            {
                p.name.split(".")[-2]
                for layer in layers[1:-1]
                for p in layer.params
                if p.name.count(".")
            }
        )
        raise LoraError(
            f"--lora-targets {','.join(missing or DEFAULT_TARGETS)}: no linear of the model "
            f"is named so; its "
            f"blocks' modules are {', '.join(names)}"
        )
    return tuple(out)


def lora_cost(cost: LayerCost, layer: LayerSpec, tokens: int, act_bytes: int = 2) -> LayerCost:
    """A block's ``cost`` (a family's, for full training) with ``layer``'s adapters: each
    adapter's two small matmuls added to forward and recompute; to backward, its five
    (``x A^T`` made again, ``dB``, the gradient through ``B``, ``dA`` and ``dx`` through
    ``A``), less the ``dW`` matmul its frozen target no longer makes (``kit.lora``). A
    base stored apart (``base_specs``) adds, to each of the three, the dense weight each
    projection dequantizes into (``act_bytes`` an element), written and read again."""
    adapters = [g for g in layer.groups if g.name == GROUP]
    if not adapters:
        return cost
    dense = 0
    for p in layer.params:
        if p.dtype in ("int8", "bfloat16"):
            dense += p.shape[0] * p.shape[1]
        elif p.dtype == "uint8":
            dense += 2 * p.shape[0] * p.shape[1]
    moved = 2.0 * dense * act_bytes
    forward = backward = 0.0
    params = adapters[0].params
    for a, b in zip(params[::2], params[1::2], strict=True):
        rank, in_features = a.shape
        out_features = b.shape[0]
        forward += 2 * tokens * rank * (in_features + out_features)
        backward += 2 * tokens * rank * (3 * in_features + 2 * out_features)
        backward -= 2 * tokens * in_features * out_features  # no dW
    recompute = cost.recompute if cost.recompute is not None else cost.forward
    return attrs.evolve(
        cost,
        forward=attrs.evolve(
            cost.forward, flops=cost.forward.flops + forward, bytes=cost.forward.bytes + moved
        ),
        backward=attrs.evolve(
            cost.backward,
            flops=max(0.0, cost.backward.flops + backward),
            bytes=cost.backward.bytes + moved,
        ),
        recompute=attrs.evolve(
            recompute, flops=recompute.flops + forward, bytes=recompute.bytes + moved
        ),
    )
