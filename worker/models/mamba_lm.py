"""Attention-free Mamba language models (``mamba``, ``falcon_mamba``: Mamba-1 mixers,
``layers.mamba1``; ``mamba2``: Mamba-2 mixers, ``layers.mamba2``;
``worker.mamba_lm_config``): a stack of blocks, each a norm and a mixer added to the
residual stream, then a final norm and the head.

That is Nemotron-H's block with only Mamba blocks, and the files name it the same way
(``backbone.embeddings``, ``backbone.layers.{i}.norm`` / ``mixer``, ``backbone.norm_f``),
so the model is ``NemotronHForCausalLM`` with the mixer its config names. No layer
holds KV: the pool is bookkeeping only (``worker.kv_layers``).
"""

from __future__ import annotations

from pagedserve.worker.models.nemotron_h import NemotronHForCausalLM


class MambaForCausalLM(NemotronHForCausalLM):
    """Mamba, Falcon-Mamba and Mamba-2 (see the module docstring)."""
