"""Tests every family built on the kit's MoE decoder subclasses (they need pytest): the
decoder families' checks (``decoder_testing``) with the MoE's parameter count, state and
HF objective, and what is MoE's own.

``MoEFamilyChecks``: the decoder checks, plus the experts as a parameter group of their
own, the router's AuxTemp and the Aux counts declared with exact shapes.

``MoEHFParity``: the decoder's HF parity tests against an MoE ``transformers`` class
built with ``output_router_logits=True`` (so its loss includes ``router_aux_loss_coef``
times ``load_balancing_loss_func``): the HF model's objective is its ``loss``, the
cross-entropy a step reports is ``loss - router_aux_loss_coef * aux_loss``. A subclass's
``hf_config`` has ONE layer: transformers pools the layers' router statistics before the
balance product, the family averages per-layer terms (``kit/moe.py``), and the two agree
exactly for one layer. Multi-layer logits are checked by the exported preset's test.
The checkpoint must carry no ``router_z_loss_coef`` (transformers has no z-loss).
Tolerances are the decoder's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dataflow_training.kit.decoder_testing import DecoderFamilyChecks, DecoderHFParity
from dataflow_training.kit.moe import EXPERTS_GROUP, moe_parameter_count


class MoEFamilyChecks(DecoderFamilyChecks):
    block_tensor: ClassVar[str] = "0.mlp.experts.down_proj"

    @staticmethod
    def count(config: Any) -> int:
        return moe_parameter_count(config)

    def test_experts_are_a_group_and_the_router_state_has_exact_shapes(self, family):
        config = family.config(self.preset)
        e, k, n, inner = (
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
        )
        block = family.layers(config)[1]
        main, experts = block.groups
        assert (main.name, experts.name) == ("", EXPERTS_GROUP)
        assert {p.name: p.shape for p in experts.params} == {
            "mlp.experts.gate_up_proj": (e, 2 * inner, n),
            "mlp.experts.down_proj": (e, n, inner),
        }
        assert ("mlp.gate.weight", (e, n)) in {(p.name, p.shape) for p in main.params}
        assert [(a.name, a.shape, a.dtype) for a in block.aux] == [("counts", (e,), "float32")]
        temp = {t.name: (t.shape, t.dtype) for t in family.math("moe").aux_temp(config, 2, 5)}
        assert temp["ids"] == ((10, k), "int32") and temp["order"] == ((10 * k,), "int32")
        assert temp["offsets"] == ((e + 1,), "int32") and temp["weights"][0] == (10, k)

    def test_recompute_reads_the_routing_verbatim(self, family):
        """With the router changed after forward, recompute still uses forward's routing
        (AuxTemp): the experts' rows come out bit for bit as forward saved them, while
        routing afresh would choose other experts."""
        from dataflow_training.family import Env
        from dataflow_training.ops import load_ops

        config = family.config(self.preset)
        state = family.reference_model(config).state_dict()
        params = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("0.")}
        for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
            params[name] = torch.randn_like(params[name])
        env, math = Env(load_ops("cpu", family.ops)), family.math("moe")
        x = torch.randn(2, 7, config.hidden_size)
        _, saved, temp = math.forward(config, params, x, env)
        rerouted = params | {"mlp.gate.weight": -params["mlp.gate.weight"]}
        again = math.recompute(config, rerouted, x, temp, env)
        assert torch.equal(again["gate_up"], saved["gate_up"])
        _, _, fresh = math.forward(config, rerouted, x, env)
        assert not torch.equal(fresh["ids"], temp["ids"])


class MoEHFParity(DecoderHFParity):
    def _hf_objective(self, model, tokens, targets):
        out = model(input_ids=tokens, labels=None, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100
        )
        return ce + model.config.router_aux_loss_coef * out.aux_loss, ce

    def _reference_objective(self, reference, tokens, targets):
        losses, terms = reference([(tokens, targets)])
        return losses[0] + terms

    def _hf_names(self, family, config):
        names = {
            "emb.embed_tokens.weight": "model.embed_tokens.weight",
            "head.norm.weight": "model.norm.weight",
            "head.lm_head.weight": "lm_head.weight",
        }
        state = family.reference_model(config).state_dict()
        return {
            key: names.get(key) or f"model.layers.{key}"
            for key in state
            if key in names or key.split(".")[0].isdigit()
        }
