"""What every hybrid recurrent / attention decoder does the same way (Granite 4.0-H,
Bamba, Nemotron-H, Qwen3-Next / Qwen3.5, LFM2): a mixin over ``LlamaForCausalLM``
whose layers each hold a paged attention (``self_attn``), a recurrent mixer
(``mamba``: Mamba-2, gated DeltaNet or a short convolution), or neither; the mixer's
tensors load under ``mixer_prefix`` in the files, and a Llama-shaped layer around
a mixer is ``RecurrentLayer``.

The KV pool holds the attention layers only (``worker.kv_layers``), so the
forward gets their caches and hands each to its layer; the mixers number their
slot tensors in layer order (``state_index``); a model without RoPE anywhere
(both families' releases) rotates by an identity table; and no step is captured
as a CUDA graph (the mixers pick each step's prompt rows on the host).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.models.llama import KVCaches
from pagedserve.worker.pipeline import IntermediateTensors


def _paged(layer: Any) -> PagedAttention | None:
    attn = getattr(layer, "self_attn", None)
    return attn.attn if attn is not None else None


class RecurrentHybridMixin:
    """Put before ``LlamaForCausalLM`` in the bases. A family whose files spell
    tensors otherwise sets ``checkpoint_name`` (a file's name -> Llama's), and
    ``mixer_prefix`` where a layer's mixer tensors sit."""

    layers: Any
    config: Any
    mixer_prefix = "mamba."
    # A layer with a mixer has no attention (Falcon-H1's layers have both).
    mixer_replaces_attention = True

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_hybrid()

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]],
                     on_layer: Callable[[str, nn.Module], None] | None = None) -> None:
        super().load_weights(  # type: ignore[misc]
            ((self.checkpoint_name(n), t) for n, t in weights), on_layer)

    def owns_tensor(self, name: str) -> bool:
        return super().owns_tensor(self.checkpoint_name(name))  # type: ignore[misc]

    def _layer_names(self, layer: nn.Module) -> set[str]:
        names = super()._layer_names(layer)  # type: ignore[misc]
        mixer = getattr(layer, "mamba", None)
        if mixer is None:
            return names
        if self.mixer_replaces_attention:
            names = {n for n in names if not n.startswith("self_attn.")}
        return names | {self.mixer_prefix + n for n in mixer.checkpoint_names()}

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)  # type: ignore[attr-defined]
        if found is None or not found[1].startswith(self.mixer_prefix):
            return super()._load_one(name, lazy)  # type: ignore[misc]
        mixer = getattr(found[0], "mamba", None)
        if mixer is None or not mixer.load(found[1][len(self.mixer_prefix):], lazy):
            raise ValueError(f"unexpected weight {name!r} in checkpoint")

    def _init_hybrid(self) -> None:
        self._paged_layers = [_paged(layer) for layer in self.layers]
        for j, mixer in enumerate(self.mamba_mixers()):
            mixer.state_index = j
        self._rotates = bool(set(range(self.config.num_layers)) - set(self.config.nope_layers))

    def mamba_mixers(self) -> list[nn.Module]:
        """This stage's recurrent mixers (a layer's ``mamba``: Mamba-2 or gated
        DeltaNet) in order (their ``state_index`` order)."""
        mixers = (getattr(layer, "mamba", None) for layer in self.layers)
        return [m for m in mixers if m is not None]

    def attention_layers(self) -> list[PagedAttention]:
        return [a for a in self._paged_layers if a is not None]

    @property
    def num_kv_heads_per_rank(self) -> int:
        attn = self.attention_layers()
        return attn[0].num_kv_heads if attn else self.config.num_kv_heads

    @property
    def graph_capturable(self) -> bool:
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                md: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """``LlamaForCausalLM.forward`` with ``kv_caches`` holding the attention layers'
        caches only, in order."""
        caches = iter(kv_caches)
        per_layer = [None if a is None else next(caches) for a in self._paged_layers]
        return super().forward(input_ids, positions, per_layer, md,  # type: ignore[misc]
                               intermediate, image_embeds)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ropes = super().layer_ropes(positions, dtype)  # type: ignore[misc]
        if self._rotates or not ropes:
            return ropes
        cos, sin = ropes[0]  # (NoPE: an identity table, as SmolLM3's NoPE layers take)
        return [(torch.ones_like(cos), torch.zeros_like(sin))] * len(self.layers)


class RecurrentLayer(nn.Module):
    """A hybrid's layer whose mixer is recurrent, in Llama's shape: norm, the mixer
    (``mamba``), norm, ``mlp``, each after its residual add (Bamba's and LFM2's)."""

    def __init__(self, cfg: Any, mixer: nn.Module, mlp: nn.Module, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mamba = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: None, md: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.mamba(h, md.mamba), residual)
        return self.mlp(h), residual
