"""Probe, 2026-12-05 (session 23): how far is plain bf16 autograd from float64 on qwen3_0_6b?

Answer: on the query/key path 3.4-3.9 % (median) every step, up to 6.9 % in the third
(results/yardstick_qwen3_0_6b_cuda.json, docs/correctness_compare.md); ``dataflow verify
--dtype bf16`` has computed this yardstick itself since, each step.

How far plain bf16 autograd is from float64 on a family's gradients: the yardstick for
``dataflow verify``'s bf16 step checks (docs/correctness_compare.md).

The family's reference model starts from ``verify``'s weights (its seed, rounded to bf16)
and takes ``verify``'s step tokens (batch 2 x seq 16, 2 rounds). Each step, the gradients
are computed twice from the same bf16 weights, by the reference in float64 and in bf16
(plain autograd), and the relative error ``||g_bf16 - g_64|| / ||g_64||`` of every
parameter whose name has one of ``--match`` is summarised (median, largest, how many over
5 %). The weights then take an AdamW step on the bf16 gradients (float32 moments and
arithmetic, decay on the matrices, weights rounded to bf16: verify's step policy), so later
steps start where a bf16 run would be.

Run: ``python -m benchmarks.probes.bf16_yardstick --family qwen3 --preset qwen3_0_6b --steps 3
--device cuda`` (session 23 on the H200, a few seconds a step:
results/yardstick_qwen3_0_6b_cuda.json; on the 24 GB CPU machine about 4 minutes a step).
``--json PATH`` writes every error; ``--device cuda`` runs both models on the GPU (float64
products included), as a stock bf16 run would. Since session 23 the reference's attention
is ``F.scaled_dot_product_attention`` (fused kernels in bf16 on a GPU); that JSON predates
it (softmax and matmuls in bf16). ``dataflow verify --dtype bf16`` computes the same
yardstick from the engine's own weights each step (its ``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from dataflow_training.check.verify_checks import compare
from dataflow_training.check.verify_step import Reference, start_weights, step_config, step_tokens
from dataflow_training.step.family import embed_layer, load_family

#: verify's step shape and optimizer (``verify.verify`` defaults, ``step_config``)
BATCH, SEQ_LEN, ROUNDS, SEED = 2, 16, 2, 0
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _grads(family, config, state, dtype, batches, device, keep=None) -> dict[str, torch.Tensor]:
    """The gradients of the reference model in ``dtype`` from ``state`` (verify's
    ``Reference.grads``, the model built for this call alone and freed after it), on the
    CPU; ``keep``: only those whose names have one of these keys."""
    train = step_config("bf16", batch=BATCH, seq_len=SEQ_LEN, rounds=ROUNDS)
    found = Reference(family, config, train, dtype=dtype, device=device).grads(state, batches)
    return {n: g.cpu() for n, g in found.grads.items() if keep is None or any(k in n for k in keep)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--match", default="q_norm,k_norm,q_proj,k_proj")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--device", default="cpu", help="where both models run (cuda: the GPU's bf16 kernels)"
    )
    args = parser.parse_args()
    family = load_family(args.family)
    config = family.config(args.preset)
    state = start_weights(family, config, SEED, torch.bfloat16)
    vocab = embed_layer(family.layers(config)).params[0].shape[0]
    keys = args.match.split(",")
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    found: list[dict] = []
    for step in range(args.steps):
        batches = [step_tokens(SEED, vocab, BATCH, SEQ_LEN, step, r) for r in range(ROUNDS)]
        exact = _grads(family, config, state, torch.float64, batches, args.device, keys)
        rounded = _grads(family, config, state, torch.bfloat16, batches, args.device)
        for key in keys:
            errors = {
                name: compare("step", name, rounded[name], g, 0.0).rel
                for name, g in exact.items()
                if key in name
            }
            if not errors:
                continue
            found += [{"step": step, "param": n, "rel": e} for n, e in errors.items()]
            values = list(errors.values())
            print(
                f"step {step} {key}: median {statistics.median(values):.3e} largest "
                f"{max(values):.3e} over 5e-2: {sum(v > 5e-2 for v in values)} of {len(values)}",
                flush=True,
            )
        del exact
        for name, g in rounded.items():  # AdamW: float32 moments and arithmetic, bf16 weights
            g = g.float()
            m, v = moments.get(name, (torch.zeros_like(g), torch.zeros_like(g)))
            m, v = BETAS[0] * m + (1 - BETAS[0]) * g, BETAS[1] * v + (1 - BETAS[1]) * g * g
            moments[name] = (m, v)
            m_hat, v_hat = m / (1 - BETAS[0] ** (step + 1)), v / (1 - BETAS[1] ** (step + 1))
            w = state[name].float()
            decay = WEIGHT_DECAY if w.dim() > 1 else 0.0
            w = w * (1 - LR * decay) - LR * m_hat / (v_hat.sqrt() + EPS)
            state[name] = w.to(torch.bfloat16)
        del rounded
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"family": args.family, "preset": args.preset, "errors": found}, out)


if __name__ == "__main__":
    main()
