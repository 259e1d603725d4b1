"""The program: ``layers`` steps of ``h_{i+1} = tanh(h_i @ W_i)`` forward, then backward.

Objects: weights ``W_i`` (all but ``W_0`` start in slow memory, as if the model did
not fit), the input
``h_0`` (fast), saved activations ``h_i``, gradients ``g_i`` (d loss / d h_i) and weight
gradients ``dW_i`` (end in slow memory). Loss: ``0.5 * sum(h_L ** 2)``, so ``g_L = h_L``.
Task costs come from a flop count over an assumed rate; pass a measured ``flops_per_us``
for predictions that match your machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataflow import Link, Links, Obj, Program, Task, TensorMeta

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "float64": 8}


def build_program(
    layers: int = 4,
    dim: int = 64,
    batch: int = 128,
    *,
    dtype: str = "float32",
    flops_per_us: float = 20_000.0,
    links: Links | None = None,
) -> Program:
    """A bare chain (no directives): plan it with ``dataflow.planning.plan``."""
    elem = DTYPE_BYTES[dtype]

    def obj(name: str, shape: tuple[int, ...], role: str, location: str = "fast") -> Obj:
        meta = TensorMeta(dtype, shape)
        return Obj(name, meta.nbytes, role, location, meta)

    act, weight = (batch, dim), (dim, dim)
    objects = [obj("h_0", act, "data")]
    # W_0 starts in fast memory: directives fire when a task ends, so nothing could
    # prefetch the first layer's weight before the first task.
    objects += [obj(f"W_{i}", weight, "param", "fast" if i == 0 else "slow") for i in range(layers)]
    objects += [obj(f"h_{i + 1}", act, "activation") for i in range(layers)]
    objects += [obj(f"g_{i}", act, "grad") for i in range(layers + 1)]
    objects += [obj(f"dW_{i}", weight, "grad") for i in range(layers)]
    matmul_us = 2 * batch * dim * dim / flops_per_us
    tasks = [
        Task(
            f"fwd_{i}",
            "fwd",
            "tanh_matmul",
            inputs=(f"h_{i}", f"W_{i}"),
            outputs=(f"h_{i + 1}",),
            cost_us=matmul_us,
            label=f"layer {i} forward",
        )
        for i in range(layers)
    ]
    tasks.append(
        Task(
            "loss",
            "loss",
            "half_square_grad",
            inputs=(f"h_{layers}",),
            outputs=(f"g_{layers}",),
            cost_us=batch * dim * elem / flops_per_us,
        )
    )
    tasks += [
        Task(
            f"bwd_{i}",
            "bwd",
            "tanh_matmul_backward",
            inputs=(f"g_{i + 1}", f"h_{i + 1}", f"h_{i}", f"W_{i}"),
            outputs=(f"g_{i}", f"dW_{i}"),
            cost_us=2 * matmul_us,
            label=f"layer {i} backward",
            workspace_bytes=batch * dim * elem,  # the gradient through tanh
        )
        for i in reversed(range(layers))
    ]
    return Program(
        name=f"matmul-chain-{layers}x{dim}",
        objects=tuple(objects),
        tasks=tuple(tasks),
        final_locations={f"dW_{i}": "slow" for i in range(layers)} | {"g_0": "fast"},
        links=links or Links(h2d=Link(10_000.0, 5.0), d2h=Link(10_000.0, 5.0)),
        metadata={"example": "custom_program"},
    )


def initial_values(program: Program, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random start values for the objects that exist at start (input and weights)."""
    import torch  # here, not above: the package's entry point must not import torch

    generator = torch.Generator().manual_seed(seed)
    values = {}
    for obj in program.objects:
        if program.exists_at_start(obj.id):
            scale = obj.tensor.shape[0] ** -0.5 if obj.id.startswith("W_") else 1.0
            values[obj.id] = scale * torch.randn(
                obj.tensor.shape, generator=generator, dtype=getattr(torch, obj.tensor.dtype)
            )
    return values
