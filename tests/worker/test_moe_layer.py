"""``SparseMoE`` against Hugging Face's MoE blocks on the same weights, row by row
(Mixtral, Qwen2/3-MoE, and DeepSeek-V2/V3's grouped routing and plain shared experts).

Batches from one row (a decode of one sequence: two experts) to 300 rows (a
prefill where every expert takes dozens), through each path: plain
``F.linear`` (CUDA's, and bf16 where the CPU lacks bf16 dot products), the
experts packed for oneDNN (bf16 on CPUs with bf16 dot products), and the
native kernel (CPU fp32, ``kernels/cpu_moe.c``).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_int8, cpu_moe, cpu_native
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.packed import can_pack
from pagedserve.worker.layers.quant import weight_bytes
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.testing import MOE_DEFAULTS

HIDDEN = 64


def _hf_block(kind: str, **overrides):
    import transformers as tf

    cfg_cls, block_mod, block_cls = {
        "mixtral": (tf.MixtralConfig, "mixtral", "MixtralSparseMoeBlock"),
        "qwen2_moe": (tf.Qwen2MoeConfig, "qwen2_moe", "Qwen2MoeSparseMoeBlock"),
        "qwen3_moe": (tf.Qwen3MoeConfig, "qwen3_moe", "Qwen3MoeSparseMoeBlock"),
        "deepseek_v2": (tf.DeepseekV2Config, "deepseek_v2", "DeepseekV2Moe"),
        "deepseek_v3": (tf.DeepseekV3Config, "deepseek_v3", "DeepseekV3MoE"),
    }[kind]
    module = __import__(f"transformers.models.{block_mod}.modeling_{block_mod}",
                        fromlist=[block_cls])
    cfg = cfg_cls(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2,
                  **{**MOE_DEFAULTS[kind], **overrides})
    torch.manual_seed(0)
    block = getattr(module, block_cls)(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        for name, b in block.named_buffers():  # DeepSeek-V3's routing bias
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    return cfg, block


def _checkpoint_tensors(block, mixtral: bool) -> dict[str, torch.Tensor]:
    """The block's weights under their on-disk names (experts one by one)."""
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, torch.Tensor] = {}
    for name, t in block.state_dict().items():
        if name in ("gate.weight", "gate.e_score_correction_bias") \
                or name.startswith("shared_expert"):
            out[name] = t
        elif name == "experts.gate_up_proj":
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"experts.{e}.{names[0]}.weight"] = t[e, :i]
                out[f"experts.{e}.{names[1]}.weight"] = t[e, i:]
        elif name == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"experts.{e}.{names[2]}.weight"] = t[e]
        else:
            raise AssertionError(f"unexpected HF parameter {name}")
    return out


@pytest.mark.parametrize("path", ["plain", "onednn", "native"])
@pytest.mark.parametrize("kind,overrides", [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3)),
    ("deepseek_v3", {}),
    ("deepseek_v2", {}),
    ("deepseek_v2", dict(topk_method="greedy", n_group=None, topk_group=None)),
], ids=["mixtral", "qwen2_moe_shared", "qwen3_moe_top3_of_8", "deepseek_v3_sigmoid_groups",
        "deepseek_v2_limited_groups", "deepseek_v2_greedy"])
def test_layer_equals_hugging_face_block(kind, overrides, path, monkeypatch) -> None:
    if path == "onednn" and not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN weight packing in this torch build")
    if path == "native" and cpu_native.load() is None:
        pytest.skip("no C compiler: native CPU kernels off")
    if path == "onednn":
        monkeypatch.setattr(cpu_moe, "available", lambda *a: False)
    cfg, block = _hf_block(kind, **overrides)
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": kind,
                                        "num_hidden_layers": 1}).moe
    ours = SparseMoE(HIDDEN, moe_cfg, ParallelContext(), torch.float32, torch.device("cpu"))
    tensors = _checkpoint_tensors(block, moe_cfg.mixtral_names)
    assert set(tensors) == ours.expected_names()
    for name, t in tensors.items():
        assert ours.load(name, t)
    if path != "plain":
        ours.pack()
        assert ours.w13.numel() == 0
        assert (ours.native if path == "native" else ours.packed) is not None
    g = torch.Generator().manual_seed(1)
    for rows in (1, 7, 300):
        x = torch.randn(rows, HIDDEN, generator=g)
        with torch.no_grad():
            ref = block(x.unsqueeze(0))
            ref = ref[0] if isinstance(ref, tuple) else ref
            got = ours(x)
        torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)


def test_unknown_or_misshapen_expert_weights_are_refused() -> None:
    cfg, _ = _hf_block("qwen3_moe")
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": "qwen3_moe",
                                        "num_hidden_layers": 1}).moe
    ours = SparseMoE(HIDDEN, moe_cfg, ParallelContext(), torch.float32, torch.device("cpu"))
    assert not ours.load("experts.4.gate_proj.weight", torch.zeros(32, HIDDEN))  # 4 experts
    assert not ours.load("experts.0.w1.weight", torch.zeros(32, HIDDEN))  # Mixtral's name
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight: checkpoint shape"):
        ours.load("experts.0.down_proj.weight", torch.zeros(32, HIDDEN))


def test_bf16_native_experts_agree_with_the_torch_path() -> None:
    """A bf16 model's experts through the kernel (fp32 sums, one rounding) and through
    bf16 torch matmuls: same router, same choices, outputs within bf16 rounding."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler: native CPU kernels off")
    cfg, block = _hf_block("qwen2_moe")
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": "qwen2_moe",
                                        "num_hidden_layers": 1}).moe
    layers = []
    for native in (False, True):
        layer = SparseMoE(HIDDEN, moe_cfg, ParallelContext(), torch.bfloat16,
                          torch.device("cpu"))
        for name, t in _checkpoint_tensors(block, False).items():
            layer.load(name, t)
        if native:
            layer.pack()
            assert layer.native is not None and layer.native[0].dtype == torch.bfloat16
        layers.append(layer)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        plain, native = (layer(x).float() for layer in layers)
    scale = plain.abs().max()
    assert (native - plain).abs().max() <= 0.03 * scale


def test_int8_experts_follow_the_block_and_each_row_alone() -> None:
    """``quantize`` turns every expert into int8 codes (the stacks dropped, ``pack`` then a
    no-op): the layer stays within int8's rounding of HF's block, and a row's output does
    not depend on the rows beside it (activations are quantised per row; only the fp32
    router matmul's summation order differs with the batch)."""
    cfg, block = _hf_block("qwen3_moe", num_experts=8, num_experts_per_tok=3)
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": "qwen3_moe",
                                        "num_hidden_layers": 1}).moe
    ours = SparseMoE(HIDDEN, moe_cfg, ParallelContext(), torch.float32, torch.device("cpu"))
    for name, t in _checkpoint_tensors(block, False).items():
        ours.load(name, t)
    nbytes = ours.quantize("layers.0.mlp")
    ours.pack()
    assert ours.native is None and ours.w13.numel() == 0
    if cpu_int8.native_available():
        assert ours.int8 is None and ours.int8_native[0][0].shape[0] == 8
    else:
        assert ours.int8 is not None and len(ours.int8) == 8
    assert nbytes + ours.router.numel() * 4 == weight_bytes(ours)
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = block(x.unsqueeze(0))
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        got = ours(x)
        rows = torch.cat([ours(x[i:i + 1]) for i in range(50)])
    assert float((got - ref).norm() / ref.norm()) < 0.02
    torch.testing.assert_close(rows, got, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp experts have 64 / 48 inputs"):
        odd = SparseMoE(HIDDEN, ModelConfig.from_hf_dict(
            {**cfg.to_dict(), "model_type": "qwen3_moe", "num_hidden_layers": 1,
             "moe_intermediate_size": 48}).moe, ParallelContext(), torch.float32,
            torch.device("cpu"))
        odd.quantize("layers.0.mlp")


@pytest.mark.skipif(not cpu_int8.native_available(), reason="no native int8 kernel here")
@pytest.mark.parametrize("rows", [1, 5, 33, 200])
def test_int8_expert_kernel_equals_the_expert_loop(rows, monkeypatch) -> None:
    """One native call per layer (``moe_int8``) against the loop of int8 matmuls per expert
    on the same codes: the same integers and scales, so equal up to the combine's fused
    multiply-add; top-3 of 8 experts, some idle at one row."""
    cfg, block = _hf_block("qwen3_moe", num_experts=8, num_experts_per_tok=3)
    moe_cfg = ModelConfig.from_hf_dict({**cfg.to_dict(), "model_type": "qwen3_moe",
                                        "num_hidden_layers": 1}).moe
    layers = []
    for native in (True, False):
        monkeypatch.setattr(cpu_int8, "native_available", lambda n=native: n)
        layer = SparseMoE(HIDDEN, moe_cfg, ParallelContext(), torch.float32,
                          torch.device("cpu"))
        for name, t in _checkpoint_tensors(block, False).items():
            layer.load(name, t)
        layer.quantize("layers.0.mlp")
        layers.append(layer)
    fused, loop = layers
    assert fused.int8_native is not None and loop.int8 is not None
    loop.int8 = [(cpu_int8.pack(a), cpu_int8.pack(b)) for a, b in loop.int8]  # the kernel
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), loop(x), atol=1e-5, rtol=1e-5)
    # A bf16 model's experts: quantised from bf16 weights, activations widened.
    monkeypatch.setattr(cpu_int8, "native_available", lambda: True)
    bf16 = SparseMoE(HIDDEN, moe_cfg, ParallelContext(), torch.bfloat16, torch.device("cpu"))
    for name, t in _checkpoint_tensors(block, False).items():
        bf16.load(name, t)
    bf16.quantize("layers.0.mlp")
    with torch.no_grad():
        got, want = bf16(x.bfloat16()).float(), fused(x)
    assert float((got - want).norm() / want.norm()) < 0.03
