"""HF parity against ``transformers.DeepseekV32ForCausalLM``: DeepSeek V3's parity tests
(``test_deepseek_v3_hf``: logits, the objective, export, the MTP layers, FP8 refused) on
random small V3.2 configs whose indexer keeps 6 of the 20 tokens (the sparse path; 8
indexer heads, so that exact ties of the ReLU'd scores at the top-k's edge are
unlikely), and one training step: transformers' indexer runs under ``no_grad`` and has
no loss, so the main model's gradients are held to transformers' (its objective: the
cross-entropy and the balance term) and the indexer's to autograd of the plain
reference's KL loss (``kit.dsa_reference``), then AdamW over both against
``torch.optim.AdamW``."""

from __future__ import annotations

from dataflow_family_deepseek.testing import DeepseekV32HFParity


class TestDeepseekV32Parity(DeepseekV32HFParity):
    """DeepSeek V3.2: V3's attention with the lightning indexer on every layer."""
