"""HF parity checks every Gated DeltaNet hybrid family shares (Qwen 3.5 dense and MoE): a
mixin placed before ``DecoderHFParity`` or ``MoEHFParity``.

``adjust`` draws each linear-attention layer's decay (``A_log``) so a token decays by at
most 1: HF's chunked rule sums a chunk's log decays in float32, which over 20 tokens of
decays near 16 (HF draws ``A`` up to 16) loses the digits the smallest ``in_proj_a``
gradients are made of (the kernels here sum them in float64).

``test_a_published_layout_imports_its_text_model`` rewrites the saved checkpoint as the
published vision-language one is laid out: the text config nested under ``text_config``,
the text tensors under ``model.language_model``, multi-token-prediction (``mtp.*``) and
vision (``model.visual.*``) tensors beside them, which the import drops with one line
naming the family.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file


class HybridHFChecks:
    #: how many leading layers of ``hf_config`` are Gated DeltaNet (linear attention)
    linear_layers: ClassVar[int] = 3
    #: the published checkpoint's ``architectures`` entry
    published_class: ClassVar[str] = ""
    #: a tensor of the MTP layer's MLP as the published checkpoint names it
    mtp_mlp_tensor: ClassVar[str] = "mtp.layers.0.mlp.up_proj.weight"
    family_name: ClassVar[str]

    def adjust(self, model: Any) -> None:
        """Decays of at most 1 a token (module docstring)."""
        generator = torch.Generator().manual_seed(3)
        for layer in model.model.layers[: self.linear_layers]:
            a_log = layer.linear_attn.A_log
            a_log.copy_(torch.empty(a_log.shape).uniform_(0.01, 1.0, generator=generator).log())

    def test_a_published_layout_imports_its_text_model(
        self, family: Any, hf_checkpoint: Any, caplog: Any
    ) -> None:
        model, folder = hf_checkpoint
        config, state = family.import_hf(folder)
        tensors = load_file(folder / "model.safetensors")
        renamed = {
            name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()
        }
        renamed["mtp.fc.weight"] = torch.zeros(4, 4)
        renamed[self.mtp_mlp_tensor] = torch.zeros(4, 4)
        renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
        save_file(renamed, folder / "model.safetensors")
        hf = json.loads((folder / "config.json").read_text())
        published = {
            "architectures": [self.published_class],
            "model_type": self.family_name,
            "tie_word_embeddings": hf["tie_word_embeddings"],
            "text_config": hf,
            "vision_config": {"depth": 2},
        }
        (folder / "config.json").write_text(json.dumps(published))
        with caplog.at_level(logging.WARNING):
            again, read = family.import_hf(folder)
        assert again == config
        assert all(torch.equal(read[key], state[key]) for key in state)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "dropped 2 mtp tensors, 1 vision tensors" in lines[0]
        assert f"{self.family_name} family" in lines[0]
