"""Zhipu's GLM-4.5 / 4.6 (``model_type: glm4_moe``): a Llama-shaped decoder (GQA with
q/k/v biases but none on ``o_proj``, optional per-head q/k norms under
``use_qk_norm``, RoPE on the first half of each head, ``partial_rotary_factor``
0.5) over DeepSeek-V3's mixture of experts (sigmoid scores, a routing bias, groups
ranked by their two best, shared experts, the first ``first_k_dense_replace``
layers dense; ``moe_config``). The file's multi-token-prediction layers
(``model.layers.{num_hidden_layers}...``, ``num_nextn_predict_layers`` of them) are
not part of the decoder and are never read."""

from __future__ import annotations

from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.llama_loading import _LAYER_RE


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` that skips the file's MTP layers."""

    def _on_this_stage(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_layers:
            return False
        return super()._on_this_stage(name)
