"""NVIDIA's Nemotron-H (``nemotron_h``: Nemotron-H 8B / 47B, Nemotron Nano 2 9B / 12B,
Nemotron 3 Nano): blocks of one norm and one mixer each, the mixer a Mamba-2 layer,
attention without positional rotation, a squared-ReLU MLP, or Nemotron 3's
squared-ReLU experts (``layers.moe_nemotron``; ``nemotron_h_config``), every block
adding its output to the residual stream.

A block is the Llama loop's layer: it normalises ``x + residual`` and returns its
mixer's output with the new residual, so the stack, the final norm and the head are
``LlamaForCausalLM``'s, and what hybrids share (KV for the attention blocks only,
state slots for the Mamba ones) is ``models.hybrid``'s. The files spell the decoder
``backbone`` and its ends ``embeddings`` / ``norm_f``; they load under Llama's names.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.linear import ColumnParallelLinear, LazyTensor, RowParallelLinear
from pagedserve.worker.layers.mamba1 import Mamba1Mixer
from pagedserve.worker.layers.mamba2 import Mamba2Mixer
from pagedserve.worker.layers.moe_nemotron import NemotronMoE
from pagedserve.worker.layers.norm import RMSNorm
from pagedserve.worker.mamba1_config import Mamba1Config
from pagedserve.worker.models.hybrid import RecurrentHybridMixin
from pagedserve.worker.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.worker.models.llama_loading import _copy_full

_RENAMES = {"model.embeddings.weight": "model.embed_tokens.weight",
            "model.norm_f.weight": "model.norm.weight"}
_LORA_MIXER = re.compile(r"^(model\.layers\.\d+\.)mixer\.([qkvo]_proj|up_proj|down_proj)\.")


def _renamed(name: str) -> str:
    """A checkpoint name as ``LlamaWeightLoading`` reads it."""
    if name.startswith("backbone."):
        name = "model." + name[9:]
    return _RENAMES.get(name, name)


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x)) ** 2)``: Nemotron-H's MLP block, ungated."""

    def __init__(self, cfg: Any, ctx: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, False, ctx,
                                            dtype, device)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx,
                                           dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    """One block: ``norm`` and its ``mixer`` (Mamba-2, attention, MLP or experts; Mamba-1
    in the attention-free Mamba models, ``models.mamba_lm``)."""

    def __init__(self, cfg: Any, ctx: Any, backend: Any, dtype: torch.dtype,
                 device: torch.device, index: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.kind = ("mamba" if index in cfg.mamba.layers
                     else "attention" if index in cfg.mamba.attention
                     else "moe" if cfg.moe is not None and index in cfg.moe.sparse_layers
                     else "mlp")
        self.mixer: nn.Module
        if self.kind == "mamba" and isinstance(cfg.mamba, Mamba1Config):  # (Mamba-1 LMs)
            self.mixer = Mamba1Mixer(cfg.hidden_size, cfg.mamba, ctx, dtype, device,
                                     state_index=0)
        elif self.kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps, ctx, dtype,
                                     device, state_index=0)
        elif self.kind == "attention":
            self.mixer = LlamaAttention(cfg, ctx, backend, dtype, device, index)
        elif self.kind == "moe":
            self.mixer = NemotronMoE(cfg.hidden_size, cfg.moe, ctx, dtype, device)
        else:
            self.mixer = ReluSquaredMLP(cfg, ctx, dtype, device)

    @property
    def self_attn(self) -> nn.Module | None:
        return self.mixer if self.kind == "attention" else None

    @property
    def mamba(self) -> nn.Module | None:
        return self.mixer if self.kind == "mamba" else None

    @property
    def mlp(self) -> nn.Module | None:
        """The ungated MLP of an MLP block (where LoRA adapters find its projections)."""
        return self.mixer if self.kind == "mlp" else None

    def checkpoint_names(self) -> set[str]:
        """Its tensors, as named under the block (``model.layers.{i}.``)."""
        if self.kind == "mamba":
            mixer = {"mixer." + n for n in self.mixer.checkpoint_names()}
        elif self.kind == "attention":
            mixer = {f"mixer.{m}_proj.weight" for m in "qkvo"}
        elif self.kind == "moe":
            mixer = {"mixer." + n for n in self.mixer.expected_names()}
        else:
            mixer = {"mixer.up_proj.weight", "mixer.down_proj.weight"}
        return mixer | {"norm.weight"}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.norm(x, residual)
        if self.kind == "mamba":
            return self.mixer(h, md.mamba), residual
        if self.kind == "attention":
            return self.mixer(h, cos, sin, kv_cache, md), residual
        return self.mixer(h), residual


def _lora_renamed(name: str) -> str:
    """An adapter's module name as Llama's: a block's attention projections under
    ``self_attn``, its MLP's under ``mlp`` (an expert's or a Mamba mixer's stay under
    ``mixer``, which adapters are refused on)."""
    def under(m: re.Match[str]) -> str:
        parent = "mlp" if m.group(2) in ("up_proj", "down_proj") else "self_attn"
        return f"{m.group(1)}{parent}.{m.group(2)}."

    return _LORA_MIXER.sub(under, _renamed(name))


class NemotronHForCausalLM(RecurrentHybridMixin, LlamaForCausalLM):
    """Nemotron-H (see the module docstring)."""

    layer_cls = NemotronHBlock
    checkpoint_name = staticmethod(_renamed)
    lora_name = staticmethod(_lora_renamed)

    def _layer_names(self, layer: nn.Module) -> set[str]:
        return layer.checkpoint_names()

    def _load_one(self, name: str, lazy: LazyTensor) -> None:
        found = self._layer_tensor(name)
        if found is None:
            return super()._load_one(name, lazy)
        layer, rest = found
        sub = rest.removeprefix("mixer.")
        module, _, kind = sub.rpartition(".")
        if rest == "norm.weight":
            _copy_full(name, layer.norm.weight, lazy)
            return
        mixer = rest.startswith("mixer.")
        if mixer and layer.kind in ("mamba", "moe") and layer.mixer.load(sub, lazy):
            return
        if mixer and layer.kind == "attention" and kind == "weight" \
                and self._load_attention(layer.mixer, module, False, name, lazy):
            return
        if mixer and layer.kind == "mlp" and kind == "weight" \
                and module in ("up_proj", "down_proj"):
            getattr(layer.mixer, module).load(lazy)
            return
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
