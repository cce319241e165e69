"""MXFP4 checkpoints (gpt-oss's experts) load as transformers' dense GptOss layout: the
dequantised values equal transformers' own (``convert_moe_packed_tensors``, and its
loader's dequantising path) bit for bit, and ``dequantized_weights`` hands the model the
dense checkpoint's names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.worker.loaders.hf import checkpoint_names, iter_safetensors
from pagedserve.worker.loaders.mxfp4 import Mxfp4Weight, dequantize_mxfp4
from pagedserve.worker.loaders.prequant import dequantized_weights
from pagedserve.worker.loaders.prequant_config import prequant_config
from pagedserve.worker.testing_mxfp4 import (
    QUANTIZATION_CONFIG,
    mxfp4_values,
    quantize_mxfp4,
    write_mxfp4_checkpoint,
)

EXPERTS = ("gate_up_proj", "down_proj")
_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (-0.0 is not 0.0, and infinities match)."""
    return a.dtype == b.dtype and a.shape == b.shape \
        and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny random GPT-OSS saved by transformers (hidden 64 != intermediate 96, so a
    swapped in / out would show), with a tokenizer file to copy."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # the init's experts are tiny; spread them over many scales
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(torch.randn_like(p) * torch.logspace(-4, 1, p.shape[-1]))
    path = tmp_path_factory.mktemp("gpt_oss") / "dense"
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def packed(dense, tmp_path_factory):
    return write_mxfp4_checkpoint(dense, tmp_path_factory.mktemp("gpt_oss") / "mxfp4")


def _expert_names(state) -> list[str]:
    return sorted(k for k in state if k.endswith(tuple(f"experts.{p}" for p in EXPERTS)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (3, 40, 5), dtype=torch.uint8, generator=g)
    scales.view(-1)[:4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)  # the extremes
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (3, 5 * 32, 40)
    assert _same_bits(got, want)


def test_writer_rounds_to_nearest_fp4_ties_to_even():
    """One group whose largest magnitude is 6 (scale 2**0): each value to the nearest
    E2M1 value, a tie to the even code; a group of zeros gets e8m0's smallest scale."""
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.1, -0.3, 0.2, 2.9, *[0.0] * 20]
    dense = torch.zeros(1, 64, 1)
    dense[0, :32, 0] = torch.tensor(row)
    blocks, scales = quantize_mxfp4("w", dense)
    assert scales.tolist() == [[[127, 0]]]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0, -0.5, 0.0, 3.0, *[0.0] * 20]
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got[0, :32, 0].tolist() == want and not got[0, 32:].any()
    assert blocks[0, 0, 0, 0] == 0x07  # 6.0 (code 7) in the low nibble, then 0.0


def test_writer_round_trip(dense, packed):
    """The file reads back as the writer's FP4 values, each within half a step (the
    group's scale, E2M1's widest half gap) of the dense weight; those values quantise
    to themselves."""
    src, out = load_file(str(dense / "model.safetensors")), load_file(
        str(packed / "model.safetensors"))
    for name in _expert_names(src):
        w, blocks, scales = src[name], out[name + "_blocks"], out[name + "_scales"]
        n_exp, n_in, n_out = w.shape
        assert blocks.dtype == scales.dtype == torch.uint8
        assert blocks.shape == (n_exp, n_out, n_in // 32, 16)
        assert scales.shape == (n_exp, n_out, n_in // 32)
        got = dequantize_mxfp4(blocks, scales, torch.float32)
        values = mxfp4_values(name, w)
        assert _same_bits(got, values), name
        step = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127)
        step = step.repeat_interleave(32, dim=-1).transpose(1, 2)
        assert bool(((got - w).abs() <= step).all()), name
        assert _same_bits(mxfp4_values(name, values), values)
    assert _expert_names(src) and len(out) == len(src) + len(_expert_names(src))
    cfg = json.loads((packed / "config.json").read_text())
    assert cfg["quantization_config"] == QUANTIZATION_CONFIG
    assert (packed / "tokenizer.json").read_text() == "{}"
    assert (packed / "generation_config.json").is_file()


def test_writer_refuses_inputs_not_a_multiple_of_32():
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj.*multiple of 32"):
        quantize_mxfp4("model.layers.0.mlp.experts.down_proj", torch.randn(2, 48, 64))


def _stream(path, read: list[str]):
    """The checkpoint's tensors, noting each one read."""
    class Spy:
        def __init__(self, name, lazy):
            self.name, self.lazy, self.shape = name, lazy, lazy.shape

        def __getitem__(self, idx):
            read.append(self.name)
            return self.lazy[idx]

    for name, lazy in iter_safetensors(path):
        yield name, Spy(name, lazy)


def test_dequantized_weights_yields_the_dense_checkpoint(dense, packed):
    """Every dense name, nothing more: the experts as bf16 ``[E, in, out]`` equal to the
    writer's values (bf16 holds every MXFP4 value), the rest (biases, router, attention,
    embeddings) as the file has them."""
    src = load_file(str(dense / "model.safetensors"))
    cfg = prequant_config(json.loads((packed / "config.json").read_text())
                          ["quantization_config"])
    assert cfg is not None and cfg.method == "mxfp4"
    got = dict(dequantized_weights(_stream(packed, []), cfg, checkpoint_names(packed)))
    assert sorted(got) == sorted(src)
    experts = _expert_names(src)
    for name, lazy in got.items():
        assert tuple(lazy.shape) == tuple(src[name].shape), name
        if name in experts:
            assert isinstance(lazy, Mxfp4Weight)
            full = mxfp4_values(name, src[name])
            # Experts / outputs dequantise alone (EP's experts, TP's outputs, the gates);
            # anything else dequantises the whole, once.
            for idx in (1, -1, slice(2, 4), (slice(None), slice(None), slice(8, 24)),
                        (slice(None), slice(None), slice(None, None, 2)), (0, slice(None), 5)):
                assert _same_bits(lazy[idx], full[idx].bfloat16()), idx
                assert lazy._dense is None
            assert _same_bits(lazy[:], full.bfloat16())
            assert _same_bits(lazy[:].float(), full)
            assert _same_bits(lazy[..., 3], full[..., 3].bfloat16())
        else:
            assert _same_bits(lazy[:], src[name]), name


def test_a_pipeline_stage_reads_only_its_layers_blocks(packed, dense):
    read: list[str] = []
    cfg = prequant_config(QUANTIZATION_CONFIG)
    assert cfg is not None
    keep = lambda name: not name.startswith("model.layers.1.")  # noqa: E731
    got = dict(dequantized_weights(_stream(packed, read), cfg, checkpoint_names(packed), keep))
    src = load_file(str(dense / "model.safetensors"))
    dropped = {n for n in _expert_names(src) if n.startswith("model.layers.1.")}
    assert len(dropped) == 2 and sorted(got) == sorted(set(src) - dropped)
    packed_reads = [n for n in read if n.endswith(("_blocks", "_scales"))]
    assert len(packed_reads) == 4 and all(n.startswith("model.layers.0.") for n in packed_reads)


def test_missing_scales_are_named_before_any_read(tmp_path, packed):
    state = load_file(str(packed / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    read: list[str] = []
    cfg = prequant_config(QUANTIZATION_CONFIG)
    assert cfg is not None
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj_blocks has no "
                                         r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        next(dequantized_weights(_stream(tmp_path, read), cfg, checkpoint_names(tmp_path)))
    assert read == []


def test_a_stream_short_of_a_part_is_named(packed):
    """The names promise a pair the stream never completes (a file gone mid-load)."""
    cfg = prequant_config(QUANTIZATION_CONFIG)
    assert cfg is not None
    stream = ((n, t) for n, t in iter_safetensors(packed)
              if n != "model.layers.0.mlp.experts.gate_up_proj_scales")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj lacks "
                                         r".*gate_up_proj_scales"):
        list(dequantized_weights(stream, cfg, checkpoint_names(packed)))


@pytest.mark.parametrize("blocks,scales,field", [
    (torch.zeros(2, 4, 1, 16, dtype=torch.int8), torch.zeros(2, 4, 1, dtype=torch.uint8),
     "w_blocks"),
    (torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8),
     "w_blocks"),
    (torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8),
     "w_scales"),
    (torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.float32),
     "w_scales"),
], ids=["int8-blocks", "3d-blocks", "scales-shape", "float-scales"])
def test_malformed_parts_are_named(blocks, scales, field):
    with pytest.raises(ValueError, match=field):
        Mxfp4Weight("w", blocks, scales)


@pytest.mark.parametrize("raw,field", [
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", 3]},
     "modules_to_not_convert"),
    ({"quant_method": "mxfp4", "dequantize": "yes"}, "dequantize"),
])
def test_bad_mxfp4_config_names_the_field(raw, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        prequant_config(raw)


def test_mxfp4_configs_parse():
    for raw in (QUANTIZATION_CONFIG, {"quant_method": "MXFP4"},
                {"quant_method": "mxfp4", "modules_to_not_convert": None}):
        cfg = prequant_config(raw)
        assert cfg is not None and cfg.method == "mxfp4"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transformers_reads_the_file_as_we_do(packed, dtype):
    """transformers itself loading the written file (its CPU path: dequantise at load)
    holds our experts bit for bit, and the file's other tensors."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    hf = GptOssForCausalLM.from_pretrained(packed, dtype=dtype,
                                           quantization_config=Mxfp4Config(dequantize=True))
    theirs = hf.state_dict()
    cfg = prequant_config(QUANTIZATION_CONFIG)
    assert cfg is not None
    ours = dict(dequantized_weights(iter_safetensors(packed), cfg, checkpoint_names(packed)))
    assert sorted(ours) == sorted(theirs)
    file = load_file(str(packed / "model.safetensors"))
    for name, lazy in ours.items():
        assert _same_bits(lazy[:].to(dtype), theirs[name]), name
        if isinstance(lazy, Mxfp4Weight):  # and straight to ``dtype``
            direct = dequantize_mxfp4(file[name + "_blocks"], file[name + "_scales"], dtype)
            assert _same_bits(direct, theirs[name]), name
