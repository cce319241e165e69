"""TII's Falcon-H1 (``model_type: falcon_h1``: Falcon-H1 0.5B to 34B, base and
instruct; Falcon-H1R): every layer runs a Mamba-2 mixer and an attention in parallel
on the same normalised input, their outputs added, then a SwiGLU MLP.

The files carry the mixer's shapes under Granite 4.0-H's names (``mamba_n_heads``,
``mamba_d_head``, ``mamba_d_state``, ``mamba_n_groups``...), its width as
``mamba_d_ssm`` (else ``mamba_expand * hidden_size``), and whether its output is
RMS-normalised before (``mamba_norm_before_gate``) or after the ``silu(z)`` gate, or not
at all (``mamba_rms_norm: false``: the gate alone). And muP multipliers, which
transformers applies to activations:

- ``embedding_multiplier`` (the embeddings) and ``lm_head_multiplier`` (the logits);
- ``attention_in_multiplier`` (the attention's input), ``key_multiplier`` (k, after
  its bias), ``attention_out_multiplier`` (the attention's output);
- ``ssm_in_multiplier`` (the mixer's input), ``ssm_multipliers`` (five: the z, x, B, C
  and dt parts of its input projection), ``ssm_out_multiplier`` (its output);
- ``mlp_multipliers`` (two: the gate projection's output, the down projection's).

All but the first two are linear in one projection's weights, so ``models.falcon_h1``
folds them in as the tensors load; the embedding and the logits (possibly one tied
tensor) are scaled as they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.worker.config_fields import count, positive_int
from pagedserve.worker.mamba_config import MambaConfig, time_step_limit


@dataclass(frozen=True)
class FalconH1Multipliers:
    """The muP multipliers (see the module docstring)."""

    embedding: float = 1.0
    lm_head: float = 1.0
    attention_in: float = 1.0
    key: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm: tuple[float, float, float, float, float] = (1.0,) * 5
    ssm_out: float = 1.0
    mlp: tuple[float, float] = (1.0, 1.0)

    def projection_scale(self, name: str) -> float | None:
        """The factor a layer's tensor ``name`` (under the layer) is multiplied by as it
        loads; None where none applies (the mixer's input projection, scaled by part:
        ``ssm_in`` and ``ssm``)."""
        weight = name.endswith(".weight")
        module = name.rsplit(".", 1)[0]
        scales = {
            "self_attn.q_proj": self.attention_in if weight else 1.0,
            "self_attn.k_proj": self.key * (self.attention_in if weight else 1.0),
            "self_attn.v_proj": self.attention_in if weight else 1.0,
            "self_attn.o_proj": self.attention_out,
            "mlp.gate_proj": self.mlp[0],
            "mlp.down_proj": self.mlp[1],
            "mamba.out_proj": self.ssm_out,
        }
        return scales.get(module)


def _number(cfg: dict[str, Any], key: str) -> float:
    v = cfg.get(key, 1.0)
    if v is None:
        return 1.0
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"model config field {key!r} must be a number, got {v!r}")
    return float(v)


def _numbers(cfg: dict[str, Any], key: str, n: int) -> tuple[float, ...]:
    v = cfg.get(key) or [1.0] * n
    if (not isinstance(v, (list, tuple)) or len(v) != n
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)):
        raise ValueError(f"model config field {key!r} must be {n} numbers, got {v!r}")
    return tuple(float(x) for x in v)


def falcon_h1_multipliers(cfg: dict[str, Any]) -> FalconH1Multipliers:
    """A Falcon-H1 file's multipliers (absent ones: 1)."""
    ssm = _numbers(cfg, "ssm_multipliers", 5)
    mlp = _numbers(cfg, "mlp_multipliers", 2)
    return FalconH1Multipliers(
        embedding=_number(cfg, "embedding_multiplier"), lm_head=_number(cfg, "lm_head_multiplier"),
        attention_in=_number(cfg, "attention_in_multiplier"), key=_number(cfg, "key_multiplier"),
        attention_out=_number(cfg, "attention_out_multiplier"),
        ssm_in=_number(cfg, "ssm_in_multiplier"), ssm=ssm,  # type: ignore[arg-type]
        ssm_out=_number(cfg, "ssm_out_multiplier"), mlp=mlp)  # type: ignore[arg-type]


def falcon_h1_mamba_config(cfg: dict[str, Any], num_layers: int) -> MambaConfig:
    """The mixer of every layer (each layer attends too)."""
    hidden = positive_int("hidden_size", cfg.get("hidden_size"))
    width = cfg.get("mamba_d_ssm") or count(cfg, "mamba_expand", 2) * hidden
    width = positive_int("mamba_d_ssm", width)
    heads = count(cfg, "mamba_n_heads", 128)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = positive_int("mamba_d_head", width // heads if head_dim == "auto" else head_dim)
    if heads * head_dim != width:
        raise ValueError(f"model config fields 'mamba_n_heads' ({heads}) x 'mamba_d_head' "
                         f"({head_dim}) must equal the mixer's width 'mamba_d_ssm' ({width})")
    groups = count(cfg, "mamba_n_groups", 1)
    if heads % groups:
        raise ValueError(f"model config field 'mamba_n_groups' ({groups}) must divide "
                         f"'mamba_n_heads' ({heads})")
    in_bias, out_bias = bool(cfg.get("mamba_proj_bias", False)), bool(
        cfg.get("projectors_bias", False))
    if in_bias != out_bias:
        raise ValueError("model config fields 'mamba_proj_bias' and 'projectors_bias' must "
                         "agree (the mixer's input and output projections' biases)")
    if not cfg.get("mamba_rms_norm", False):
        norm = "gate_only"
    else:
        norm = "norm_then_gate" if cfg.get("mamba_norm_before_gate", True) \
            else "gate_then_norm"
    limit = time_step_limit(cfg.get("time_step_limit"), "time_step_limit")
    every = tuple(range(num_layers))
    return MambaConfig(
        layers=every, attention=every, num_heads=heads, head_dim=head_dim,
        d_state=count(cfg, "mamba_d_state", 256), num_groups=groups,
        d_conv=count(cfg, "mamba_d_conv", 4), chunk_size=count(cfg, "mamba_chunk_size", 256),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), proj_bias=in_bias,
        dt_min=float(limit[0]), dt_max=float(limit[1]), gate_norm=norm)
