"""ModelConfig for the Gemma 2 / 3 and Phi-3 families: released config layouts read as
transformers 5's rewrites of them, and fields we cannot serve named."""

from __future__ import annotations

import math

import pytest

from pagedserve.worker.config import ModelConfig
from tests.worker.test_config_loader import BASE

GEMMA = dict(model_type="gemma3_text", vocab_size=100, hidden_size=64, intermediate_size=96,
             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             query_pre_attn_scalar=24, sliding_window=512, max_position_embeddings=32768,
             eos_token_id=1, bos_token_id=2)


def test_gemma3_release_layout_reads_as_transformers_5() -> None:
    """A released Gemma 3 config.json (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types) reads as the same model as transformers 5's
    own rewrite of it (rope_parameters per layer type, layer_types spelt out)."""
    from transformers import AutoConfig

    released = {**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "sliding_window_pattern": 3, "hidden_activation": "gelu_pytorch_tanh"}
    hf = AutoConfig.for_model(**released)
    ours = ModelConfig.from_hf_dict(released)
    assert ours == ModelConfig.from_hf_dict(hf.to_dict())
    assert ours.sliding_layers == (0, 1, 3, 4) and ours.sliding_window == 512
    assert ours.rope_theta == 1e6 and ours.rope_scaling["factor"] == 8.0
    assert ours.gemma.local_rope_theta == 1e4 and ours.gemma.query_pre_attn_scalar == 24
    assert ours.tie_word_embeddings and ours.qk_norm and ours.max_model_len == 32768


@pytest.mark.parametrize(("extra", "field"), [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}),
     "sliding_attention.rope_type"),
])
def test_gemma3_fields_we_cannot_serve_are_named(extra: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**GEMMA, **extra})


def test_phi3_longrope_reads_as_transformers() -> None:
    """Phi-3.5's layout (``type: longrope`` in rope_scaling, the pre-trained length at the
    top level) and transformers 5's give the same scaling, with transformers' attention
    factor; a partial rotary factor turns that share of each head."""
    from transformers import AutoConfig

    factors = dict(short_factor=[1.0, 1.5, 2.0, 2.5], long_factor=[3.0, 4.0, 5.0, 6.0])
    released = {**BASE, "model_type": "phi3", "max_position_embeddings": 4096,
                "original_max_position_embeddings": 256, "partial_rotary_factor": 0.5,
                "rms_norm_eps": 1e-5, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0,
                "rope_scaling": {"type": "longrope", **factors}}
    ours = ModelConfig.from_hf_dict(released)
    hf = AutoConfig.for_model(**released)
    assert ours == ModelConfig.from_hf_dict(hf.to_dict())
    assert ours.rotary_dim == 8 and ours.long_rope_from == 256
    assert ours.rope_scaling["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(16) / math.log(256)))


@pytest.mark.parametrize(("extra", "field"), [
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                        "long_factor": [2.0] * 8}), "original_max_position_embeddings"),
    (dict(original_max_position_embeddings=64,
          rope_scaling={"type": "longrope", "short_factor": [1.0] * 3,
                        "long_factor": [2.0] * 8}), "short_factor"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.0}), "partial_rotary_factor"),
])
def test_phi3_rope_we_cannot_serve_is_named(extra: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**BASE, "model_type": "phi3", **extra})


def test_gemma2_release_layout_reads_as_transformers_5() -> None:
    """A released Gemma 2 config.json (no layer_types, rope_theta at the top, both
    softcaps) reads as transformers 5's rewrite of it: every other layer slides, one
    RoPE base, no q/k norms."""
    from transformers import AutoConfig

    released = {**GEMMA, "model_type": "gemma2", "rope_theta": 10000.0,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 4}
    ours = ModelConfig.from_hf_dict(released)
    assert ours == ModelConfig.from_hf_dict(AutoConfig.for_model(**released).to_dict())
    assert ours.sliding_layers == (0, 2) and ours.rope_theta == 10000.0
    assert ours.gemma.attn_logit_softcapping == 50.0 and ours.gemma.local_rope_theta == 1e4
    assert ours.gemma.final_logit_softcapping == 30.0 and not ours.qk_norm
