"""Executables of the chain's three compute keys; each writes only into its ``ctx`` views.

Each only enqueues device work on the current stream (the engine sets it) and never reads
a value back to the host, so each says ``capturable = True``: on CUDA the engine may
capture a whole step into a CUDA graph and replay it."""

from __future__ import annotations

import torch

from dataflow import DictResolver, LaunchContext, Program


class TanhMatmul:
    capturable = True

    def launch(self, ctx: LaunchContext) -> None:
        h, w = ctx.inputs
        (out,) = ctx.outputs
        torch.matmul(h, w, out=out)
        out.tanh_()


class HalfSquareGrad:
    capturable = True

    def launch(self, ctx: LaunchContext) -> None:
        (h,) = ctx.inputs
        (g,) = ctx.outputs
        g.copy_(h)  # d(0.5 * sum(h^2)) / dh


class TanhMatmulBackward:
    capturable = True

    def launch(self, ctx: LaunchContext) -> None:
        g_next, h_next, h, w = ctx.inputs
        g, dw = ctx.outputs
        # The gradient through tanh, g_next * (1 - h_next^2), built in the task's declared
        # workspace: no temporary outside the planned memory.
        pre = ctx.workspace.view(g_next.dtype).view(g_next.shape)
        torch.mul(h_next, h_next, out=pre)
        pre.neg_().add_(1).mul_(g_next)
        torch.matmul(pre, w.t(), out=g)
        torch.matmul(h.t(), pre, out=dw)


def _factory(cls):
    return lambda task: cls()


def build(program: Program) -> DictResolver:
    """The resolver for any program built by ``chain.build_program``."""
    return DictResolver(
        "matmul-chain",
        {
            "tanh_matmul": _factory(TanhMatmul),
            "half_square_grad": _factory(HalfSquareGrad),
            "tanh_matmul_backward": _factory(TanhMatmulBackward),
        },
    )
