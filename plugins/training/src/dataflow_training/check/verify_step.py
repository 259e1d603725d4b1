"""The step level of ``dataflow verify`` (``verify.py`` has the ladder): the lowered step
run by ``TrainingRun`` for several steps of several rounds against the family's
plain-autograd reference in float64, trained with ``torch.optim.AdamW`` one step at a time
from the engine's own weights and moments: every round's loss, every weight gradient, every
weight after the step (with AdamW's allowance for the two gradients,
``dataflow_training.check.tolerances``); for a mixture of experts, the routing decisions
(``routing_checks``). In bf16 each gradient check also carries its yardstick: how far the
same step's gradients by plain bf16 autograd of the reference model are from float64, at
most, over three samples (``Check.yardstick``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from dataflow_training.check.tolerances import adam_update_gap, sign_flips, weight_error
from dataflow_training.check.verify_checks import YARDSTICK_LOSS_SCALES, Check, compare
from dataflow_training.drive.run import TrainingRun
from dataflow_training.drive.trainer import plan_line
from dataflow_training.drive.values import state_layouts
from dataflow_training.step.config import DtypePolicy, OptimizerPolicy, TrainConfig
from dataflow_training.step.family import FamilyContractError, embed_layer
from dataflow_training.step.precision import precision as precision_policy


def check_state_keys(family: Any, config: Any, state: Any) -> None:
    """The reference model's parameters are exactly the declared ones."""
    declared = {f"{layer.name}.{p.name}" for layer in family.layers(config) for p in layer.params}
    extra, missing = sorted(set(state) - declared), sorted(declared - set(state))
    if extra or missing:
        raise FamilyContractError(
            f"family {family.name!r}: the reference model's parameters differ from the "
            f"declared layers: not declared by any layer {extra}; declared but missing {missing}"
        )


def step_config(
    policy: str,
    *,
    batch: int,
    seq_len: int,
    rounds: int,
    clip: float | None = None,
    order: str = "round",
    precision: str | None = None,
) -> TrainConfig:
    """The training step the step level lowers (``dataflow verify`` checks its budget):
    ``policy``'s dtypes (fp32 or bf16) with a plain AdamW of float32 moments, or with
    ``precision`` that policy's dtypes and optimizer (``step.precision``)."""
    dtype, optimizer = DtypePolicy.named(policy), OptimizerPolicy(lr=1e-3)
    if precision is not None:
        chosen = precision_policy(precision)
        dtype, optimizer = chosen.dtype, chosen.optimizer_policy(lr=1e-3)
    return TrainConfig(
        seq_len=seq_len,
        batch=batch,
        rounds=rounds,
        dtype=dtype,
        optimizer=optimizer,
        chunk_tokens=max(1, batch * seq_len // 3),
        clip=clip,
        order=order,
    )


def follows_routing(family: Any) -> bool:
    """Whether the family's reference model routes with given expert choices: its step
    check then keeps the engine's AuxTemp and routes the reference with it
    (``routing_checks``)."""
    return bool(getattr(getattr(family, "reference", None), "follows_routing", False))


def start_weights(family: Any, config: Any, seed: int, dtype: torch.dtype) -> dict:
    """The step checks' first weights: the reference model's initialisation under
    ``seed``, in ``dtype`` (``{"<layer>.<param>": tensor}``); the float32 model they come
    from is not kept."""
    torch.manual_seed(seed)
    start = family.reference_model(config)
    return {k: v.detach().to(dtype) for k, v in start.state_dict().items()}


def step_tokens(
    seed: int, vocab: int, batch: int, seq_len: int, step: int, round_: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (tokens, targets) of ``step`` and ``round_`` in the step checks: random ids
    below ``vocab``, fixed by ``seed``, step and round."""
    g = torch.Generator().manual_seed(seed * 7919 + 1000 * step + round_)
    return (
        torch.randint(0, vocab, (batch, seq_len), generator=g),
        torch.randint(0, vocab, (batch, seq_len), generator=g),
    )


def step_checks(
    family: Any,
    preset: str,
    *,
    device: str,
    policy: str,
    steps: int,
    rounds: int,
    batch: int,
    seq_len: int,
    budget_bytes: int | None,
    seed: int,
    tolerance: float,
    resolver: str = "torch",
    clip: float | None = None,
    overrides: dict[str, Any] | None = None,
    order: str = "round",
    note: Callable[[str], None] | None = None,
    planner: Any = None,
    yardstick: bool = True,
    precision: str | None = None,
) -> list[Check]:
    """The lowered step run by ``TrainingRun`` against the reference; with ``clip`` both
    clip the global gradient norm (the reference through ``clip_grad_norm_``), and each
    step's measured norm is checked too. ``overrides``: config fields of the preset
    changed, for both. ``order``: the lowered chain's order (``TrainConfig.order``).
    ``note`` is given the run's plan line (``trainer.plan_line``: what it recomputes), then
    a line as each step's checks are done.
    ``planner``: the run's planner spec (default: ``TrainingRun``'s).

    ``yardstick`` (ignored where the policy's weights are float32): each step's gradients
    are also computed by plain autograd of the family's reference model in the weights'
    dtype on ``device``, from the same start-of-step weights, batches and routing as the
    float64 reference, once for each of ``YARDSTICK_LOSS_SCALES`` (the loss scaled: the
    backward rounded along another path); each gradient check carries the largest of
    their relative errors against the float64 gradients as its ``yardstick``
    (``Check.effective_tolerance``). That is three forwards and backwards of the
    whole model a step, on the device."""

    config = family.config(preset, **(overrides or {}))
    shape = {"batch": batch, "seq_len": seq_len, "rounds": rounds}
    train = step_config(policy, **shape, clip=clip, order=order, precision=precision)
    param_dtype = getattr(torch, train.dtype.param)
    state = start_weights(family, config, seed, param_dtype)
    check_state_keys(family, config, state)
    vocab = embed_layer(family.layers(config)).params[0].state_shape[0]

    follows = follows_routing(family)
    run = TrainingRun.of(
        family,
        preset,
        train,
        budget_bytes=budget_bytes,
        device=device,
        state=state,
        resolver=resolver,
        keep_grads=True,
        keep_aux_temp=follows,
        overrides=overrides,
        planner=planner,
    )
    if note is not None:
        note(f"{plan_line(run.compiled)}; tasks run by the {resolver} resolver")
    reference = Reference(family, config, train)
    plain = (
        Reference(family, config, train, dtype=param_dtype, device=device)
        if yardstick and param_dtype != torch.float32
        else None
    )
    opt = train.optimizer
    checks: list[Check] = []
    routing, ref_routing = [], []
    with run:
        # each step from the state the engine's step starts from: the reference takes the
        # engine's weights and AdamW moments, so what is compared is that one step, not
        # differences carried from earlier steps (docs/correctness_compare.md). A step's
        # end state is the next one's start, read back once
        weights, opt_state = run.state()
        for step in range(steps):
            began = time.perf_counter()
            moments = adam_moments(run.compiled.running, opt_state)
            batches = [step_tokens(seed, vocab, batch, seq_len, step, r) for r in range(rounds)]
            stats = run.step(batches)
            grads, (after, after_opt) = run.grads(), run.state()
            if follows:
                routing.append(run.aux_temps())
            step_routing = routing[-1] if follows else None
            engine_s, began = time.perf_counter() - began, time.perf_counter()
            ref = reference.step(weights, moments, step, batches, step_routing)
            if follows:
                ref_routing.append(ref.decisions)
            plain_samples = [
                plain.grads(weights, batches, step_routing, loss_scale=scale).grads
                for scale in (YARDSTICK_LOSS_SCALES if plain is not None else ())
            ]
            reference_s, first = time.perf_counter() - began, len(checks)
            checks += [
                compare(
                    "step", f"loss step {step} round {r}", torch.tensor(loss), ref_loss, tolerance
                )
                for r, (loss, ref_loss) in enumerate(zip(stats.losses, ref.losses, strict=True))
            ]
            if clip is not None:
                checks.append(
                    compare(
                        "step",
                        f"grad norm step {step} (clip {clip:g})",
                        torch.tensor(stats.grad_norm),
                        ref.norm,
                        tolerance,
                    )
                )
            for name in sorted(ref.grads):
                check = compare(
                    "step", f"grad {name} (step {step})", grads[name], ref.grads[name], tolerance
                )
                if plain_samples:  # plain autograd's largest error on the same gradient
                    bf16 = max(
                        compare("step", name, sample[name], ref.grads[name], tolerance).rel
                        for sample in plain_samples
                    )
                    check = attrs.evolve(check, yardstick=bf16)
                checks.append(check)
            for name in sorted(ref.weights):
                if grads[name].shape != ref.grads[name].shape:  # its grad check says so
                    checks.append(
                        Check(
                            "step",
                            f"weight {name} (after step {step}; its gradients' shapes differ)",
                            math.inf,
                            math.inf,
                            tolerance,
                        )
                    )
                    continue
                # what the two gradients alone make AdamW's update differ by: near-zero
                # entries move by up to 2 lr either way (tolerances.py)
                exp_avg, exp_avg_sq = moments[name]
                gap = adam_update_gap(
                    grads[name],
                    ref.grads[name],
                    exp_avg,
                    exp_avg_sq,
                    step=step + 1,
                    lr=opt.lr,
                    betas=(opt.beta1, opt.beta2),
                    eps=opt.eps,
                )
                n = sign_flips(grads[name], ref.grads[name])
                error = weight_error(after[name], ref.weights[name], gap, n)
                flips = f"; {n} sign flip{'s' * (n != 1)}" if n else ""
                checks.append(
                    Check(
                        "step",
                        f"weight {name} (after step {step}{flips})",
                        error.max_abs,
                        error.rel,
                        tolerance,
                    )
                )
            checks += [
                compare(
                    "step",
                    f"weight {name} (its rule, after step {step})",
                    after[name],
                    t,
                    tolerance,
                )
                for name, t in sorted(ref.ruled.items())
            ]
            weights, opt_state = after, after_opt
            if note is not None:  # a full-size preset's step takes minutes on a CPU
                failed = sum(not check.ok for check in checks[first:])
                note(
                    f"step {step + 1} of {steps}: engine {engine_s:.1f} s, reference "
                    f"{reference_s:.1f} s; {len(checks) - first} checks, {failed} failed"
                )
    if follows:
        checks = routing_checks(config, routing, ref_routing, tolerance) + checks
    return checks


def adam_moments(lowered: Any, opt_state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """``{"<layer>.<param>": (exp_avg, exp_avg_sq)}`` from a run's raw ``O`` objects
    (``TrainingRun.state``: laid out for the state's shapes, ``values.state_layouts``)
    of the step ``lowered``."""
    layouts = state_layouts(lowered)
    moments: dict[str, dict[str, list[torch.Tensor]]] = {}
    # an expert shard's group holds a piece of each state tensor: joined in group order
    ordered = sorted(lowered.layout.of_kind("O"), key=lambda p: _shard_index(lowered, p))
    for packed in ordered:
        for name, view in layouts[packed.id].views(opt_state[packed.id]).items():
            param, field = name.rsplit("/", 1)
            moments.setdefault(f"{packed.layer}.{param}", {}).setdefault(field, []).append(view)
    return {
        k: tuple(
            torch.cat(parts) if len(parts) > 1 else parts[0]
            for parts in (v["exp_avg"], v["exp_avg_sq"])
        )
        for k, v in moments.items()
    }


def _shard_index(lowered: Any, packed: Any) -> int:
    """The shard index of ``packed``'s parameter group (0 for a group that is no shard)."""
    for layer in lowered.layers:
        if layer.name == packed.layer:
            for group in layer.groups:
                if group.name == packed.group and group.shard is not None:
                    return group.shard[0]
    return 0


def routing_checks(
    config: Any,
    engine: list[list[dict[str, dict[str, torch.Tensor]]]],
    reference: list[list[list[tuple[torch.Tensor, torch.Tensor]]]],
    tolerance: float,
) -> list[Check]:
    """The routers' discrete decisions, per layer over every step and round: the
    reference routed with the engine's recorded choices (AuxTemp ``ids``), so its
    probabilities must agree with the engine's recorded ``weights`` at them, and every
    choice must be the reference's own top-k up to a near tie: an expert the engine took
    in place of one the reference ranks higher has a reference probability within the
    relative ``tolerance`` of the k-th largest (docs/correctness_compare.md)."""
    k = config.num_experts_per_tok
    layers = list(engine[0][0])
    checks = []
    for i, layer in enumerate(layers):
        recorded = [r[layer] for step in engine for r in step]
        logits = torch.cat([r[i][0] for step in reference for r in step]).double().cpu()
        ids = torch.cat([t["ids"] for t in recorded]).long()
        weights = torch.cat([t["weights"] for t in recorded])
        probs = torch.softmax(logits, -1)
        chosen = probs.gather(1, ids)
        kth = probs.topk(k, -1).values[:, -1]
        shortfall = ((kth - chosen.min(-1).values) / kth).clamp(min=0)
        n = int((shortfall > 0).sum())
        checks.append(
            Check(
                "step",
                f"routing {layer}: {n} of {ids.shape[0]} token choices differ from the "
                "reference's top-k",
                shortfall.max().item(),
                shortfall.max().item(),
                tolerance,
            )
        )
        if config.norm_topk_prob:
            chosen = chosen / chosen.sum(-1, keepdim=True)
        checks.append(compare("step", f"router weights {layer}", weights, chosen, tolerance))
    return checks


@attrs.frozen
class _Grads:
    """One step of plain autograd: every round's loss, every trainable weight's gradient
    (clipped where the step clips), the norm measured by the clip, and for a reference
    that ``follows_routing`` every round's and layer's (router logits, expert choices)."""

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    norm: torch.Tensor | None
    decisions: list


@attrs.frozen
class _RefStep:
    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    norm: torch.Tensor | None
    decisions: list
    #: tensors updated by a rule (``TensorSpec.rule``) after the step, by state key
    ruled: dict[str, torch.Tensor] = attrs.field(factory=dict)


class Reference:
    """The family's reference model in ``dtype`` on ``device``: one step's gradients by
    plain autograd from given weights (``grads``); in float64 on the CPU (the default) the
    truth of the step checks, also trained with ``torch.optim.AdamW`` one step at a time
    from given weights and moments (``step``); in the run's bf16 on its device, the
    yardstick of the bf16 gradient checks."""

    def __init__(
        self,
        family: Any,
        config: Any,
        train: TrainConfig,
        *,
        dtype: torch.dtype = torch.float64,
        device: str = "cpu",
    ) -> None:
        self.model = family.reference_model(config).to(dtype=dtype, device=device)
        self.dtype, self.device = dtype, device
        self.train = train
        layers = family.layers(config)
        params = [(f"{layer.name}.{p.name}", p) for layer in layers for p in layer.params]
        trainable = {name for name, p in params if p.trainable}
        self.decay = {name for name, p in params if p.decay}
        self.named = {n: p for n, p in self.model.named_parameters() if n in trainable}
        #: state keys of the tensors a rule updates: the model's ``apply_rules()`` moves
        #: them after the optimizer step, from what its last forward counted
        self.ruled = tuple(name for name, p in params if p.rule is not None)
        self.multi_round = getattr(self.model, "steps_over_rounds", False)

    def grads(self, weights, batches, routing=None, *, loss_scale: float = 1.0) -> _Grads:
        """The gradients of one step from ``weights`` (``{"<layer>.<param>": tensor}``,
        taken in this model's dtype) over ``batches`` (the rounds' ``(tokens, targets)``):
        each round's ``loss / rounds`` accumulated by autograd, or the step's objective at
        once for a model whose objective spans the rounds (``steps_over_rounds``), routed
        with ``routing``'s ``ids`` (the engine's AuxTemp per round and layer) for one that
        ``follows_routing``; then clipped where the step clips. ``loss_scale``: the
        objective times that, the gradients divided by it again in float64 on the host (then
        clipped there): the same gradients, their backward rounded along another path (the
        yardstick's samples, ``YARDSTICK_LOSS_SCALES``)."""
        model, rounds = self.model, len(batches)
        scale = loss_scale
        model.load_state_dict({k: v.to(self.dtype) for k, v in weights.items()})
        model.zero_grad(set_to_none=True)
        batches = [(x.to(self.device), t.to(self.device)) for x, t in batches]
        losses, decisions = [], []
        if routing is not None:
            ids = [[temp["ids"] for temp in r.values()] for r in routing]
            round_losses, extra = model(batches, routing=ids)
            ((sum(loss / rounds for loss in round_losses) + extra) * scale).backward()
            losses = [loss.detach() for loss in round_losses]
            decisions = [[(lg.detach(), i) for lg, i in r] for r in model.recorded]
        elif self.multi_round:  # a model whose objective spans the rounds (Aux over the step)
            round_losses, extra = model(batches)
            ((sum(loss / rounds for loss in round_losses) + extra) * scale).backward()
            losses = [loss.detach() for loss in round_losses]
        else:
            for x, t in batches:
                loss = model(x, t)
                (loss / rounds * scale).backward()
                losses.append(loss.detach())
        norm = None
        if scale != 1.0:  # on the host, where compare() reads them: none held on the device
            grads = {
                n: p.grad.detach().to("cpu", torch.float64) / scale for n, p in self.named.items()
            }
            if self.train.clip is not None:
                norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
                grads = {
                    n: g * (self.train.clip / (norm + 1e-6)).clamp(max=1.0)
                    for n, g in grads.items()
                }
            return _Grads(losses, grads, norm, decisions)
        if self.train.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(self.named.values()), self.train.clip)
        # the tensors themselves, not copies: the next step's zero_grad(set_to_none) leaves
        # them to this dict, and AdamW's step reads them without writing
        grads = {n: p.grad.detach() for n, p in self.named.items()}
        return _Grads(losses, grads, norm, decisions)

    def step(self, weights, moments, step: int, batches, routing=None) -> _RefStep:
        """Step ``step`` (0-based) from ``weights`` and ``moments`` (``adam_moments``): the
        gradients of ``grads`` (``routing`` as there), then one AdamW step."""
        opt, named = self.train.optimizer, self.named
        optimizer = torch.optim.AdamW(
            [
                {
                    "params": [p for n, p in named.items() if n in self.decay],
                    "weight_decay": opt.weight_decay,
                },
                {
                    "params": [p for n, p in named.items() if n not in self.decay],
                    "weight_decay": 0.0,
                },
            ],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
        )
        for name, param in named.items():
            exp_avg, exp_avg_sq = moments[name]
            optimizer.state[param] = {
                "step": torch.tensor(float(step), dtype=torch.float64),
                "exp_avg": exp_avg.to(self.dtype, copy=True),
                "exp_avg_sq": exp_avg_sq.to(self.dtype, copy=True),
            }
        found = self.grads(weights, batches, routing)
        optimizer.step()
        ruled = {}
        if self.ruled:
            self.model.apply_rules()
            state = self.model.state_dict()
            ruled = {n: state[n].detach().clone() for n in self.ruled}
        return _RefStep(
            found.losses,
            found.grads,
            {n: p.detach().clone() for n, p in named.items()},
            found.norm,
            found.decisions,
            ruled,
        )
