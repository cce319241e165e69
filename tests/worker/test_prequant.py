"""Checkpoints quantised ahead of time (GPTQ, AWQ, compressed-tensors, fp8) load as the
weights they stand for: the paged forward on the quantised checkpoint equals transformers
on the dense one (or on the quantised one itself, where transformers reads it on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from pagedserve.worker.config import ModelConfig
from pagedserve.worker.loaders.prequant import _unpack, dequantized_weights
from pagedserve.worker.loaders.prequant_config import prequant_config
from pagedserve.worker.testing_prequant import (
    pack_dense,
    write_awq,
    write_compressed_tensors,
    write_fp8,
    write_gptq,
)
from tests.worker.helpers import (
    BlockAllocator,
    all_logits,
    load_hf,
    make_worker,
    plan,
    request,
    save_tiny_model,
)

PROMPTS = {"a": [5, 9, 17, 33, 4, 61, 8], "b": [8, 70, 12, 44, 90, 3, 61, 22, 7, 40, 13]}


def _paged_logits(path, **kw) -> torch.Tensor:
    """Logits of both prompts (a prefill, then one decode each) through the engine's
    worker; rows in ``PROMPTS`` order, prompt tokens then the decode token."""
    worker = make_worker(path, num_blocks=32, block_size=4, **kw)
    alloc = BlockAllocator(32, 4, seed=1)
    first = all_logits(worker, plan(0, [request(alloc, r, p, 0) for r, p in PROMPTS.items()]))
    second = all_logits(worker, plan(1, [request(alloc, r, [11], len(p))
                                         for r, p in PROMPTS.items()]))
    return torch.cat([first, second])


def _hf_logits(hf) -> torch.Tensor:
    rows, last = [], []
    with torch.no_grad():
        for p in PROMPTS.values():
            out = hf(torch.tensor([[*p, 11]])).logits[0]
            rows.append(out[:-1])
            last.append(out[-1:])
    return torch.cat([*rows, *last])


@pytest.fixture(scope="module")
def dense_src(tmp_path_factory):
    """A tiny Llama whose projections have 64 / 96 inputs (whole groups of 32)."""
    return save_tiny_model(tmp_path_factory.mktemp("src") / "m", "llama", seed=5)


@pytest.mark.parametrize("bits,group,desc_act,sym,v1", [
    (4, 32, False, True, True),    # the common GPTQ-Int4 release
    (4, 32, True, False, True),    # act-order: g_idx shuffles the groups; asymmetric
    (8, -1, False, True, False),   # one group per row, GPTQModel's v2 zero points
    (3, 32, True, True, True),     # codes straddle words
    (2, 32, False, False, False),
], ids=["int4", "int4_act_order_asym", "int8_per_row_v2", "int3_act_order", "int2_v2"])
def test_gptq_equals_dense(tmp_path, dense_src, bits, group, desc_act, sym, v1):
    qpath, dense = write_gptq(dense_src, tmp_path / "gptq", bits, group, desc_act, sym, v1)
    torch.testing.assert_close(_paged_logits(qpath), _hf_logits(load_hf(dense)),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_gptq_of_other_families_equals_dense(tmp_path, kind):
    """Qwen2's q/k/v biases stay (only bias-free projections get AutoGPTQ's zero ones);
    routed experts and a shared expert are dequantised one by one; routers stay dense."""
    src = save_tiny_model(tmp_path / "m", kind, seed=3)
    qpath, dense = write_gptq(src, tmp_path / "gptq", desc_act=True)
    torch.testing.assert_close(_paged_logits(qpath), _hf_logits(load_hf(dense)),
                               atol=2e-5, rtol=1e-4)


def test_awq_equals_dense(tmp_path, dense_src):
    qpath, dense = write_awq(dense_src, tmp_path / "awq")
    torch.testing.assert_close(_paged_logits(qpath), _hf_logits(load_hf(dense)),
                               atol=2e-5, rtol=1e-4)


def test_fp8_block_scales_equal_dense(tmp_path, dense_src):
    qpath, dense = write_fp8(dense_src, tmp_path / "fp8")
    torch.testing.assert_close(_paged_logits(qpath), _hf_logits(load_hf(dense)),
                               atol=2e-5, rtol=1e-4)


def test_deepseek_fp8_block_scales_equal_dense(tmp_path):
    """DeepSeek-V3 / R1 ship fine-grained fp8: every projection of latent attention and
    of the experts in E4M3 with a scale per block, dequantised as they load (before
    the RoPE rows are reordered); the router and norms stay dense."""
    src = save_tiny_model(tmp_path / "m", "deepseek_v3", seed=6, num_key_value_heads=4)
    qpath, dense = write_fp8(src, tmp_path / "fp8")
    from safetensors import safe_open

    with safe_open(str(qpath / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    scaled = {k.rsplit(".", 2)[-2] for k in keys if k.endswith("weight_scale_inv")}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= scaled
    torch.testing.assert_close(_paged_logits(qpath), _hf_logits(load_hf(dense)),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_bits,strategy,group", [(4, "group", 32), (8, "channel", None)],
                         ids=["w4a16_group32", "w8a16_channel"])
def test_compressed_tensors_equals_transformers(tmp_path, dense_src, num_bits, strategy,
                                                group):
    """transformers reads the compressed checkpoint itself (its compressed-tensors
    integration decompresses each projection): the oracle is not our unpacking."""
    pytest.importorskip("compressed_tensors")
    path = write_compressed_tensors(dense_src, tmp_path / "ct", num_bits, strategy, group)
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized"
    torch.testing.assert_close(_paged_logits(path), _hf_logits(load_hf(path)),
                               atol=2e-5, rtol=1e-4)


def test_compressed_tensors_asymmetric_equals_its_decompressor(tmp_path, dense_src):
    """Asymmetric zero points are packed down the columns; transformers cannot read them
    back in this version, so each projection is checked against compressed-tensors' own
    ``decompress``."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    path = write_compressed_tensors(dense_src, tmp_path / "ct", 4, "group", 32, symmetric=False)
    state = load_file(str(path / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(path).prequant
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=32))
    got = dict(dequantized_weights(state.items(), cfg, state.keys()))
    prefixes = {k[:-len(".weight_packed")] for k in state if k.endswith(".weight_packed")}
    assert len(prefixes) == 14
    for prefix in sorted(prefixes):
        parts = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
        ref = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        torch.testing.assert_close(got[prefix + ".weight"][:], ref, atol=0, rtol=0)
    assert not any(k.endswith(("weight_scale", "weight_zero_point")) for k in got)


def test_compressed_tensors_group_index_follows_each_input():
    """Older llm-compressor files (``actorder: group``) carry ``weight_g_idx``: each input's
    group. compressed-tensors 0.20 no longer writes or reads it, so the reference here is
    the formula on the signed codes, ``(code - zp[g_idx]) * scale[g_idx]``, packed by
    compressed-tensors' own ``pack_to_int32``."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(7)
    n_out, n_in, size = 48, 128, 32
    g_idx = torch.randperm(n_in, generator=g) // size
    codes = torch.randint(-8, 8, (n_out, n_in), generator=g, dtype=torch.int8)
    zp = torch.randint(-3, 3, (n_out, n_in // size), generator=g, dtype=torch.int8)
    scale = torch.rand(n_out, n_in // size, generator=g) * 0.01
    parts = {"weight_packed": pack_to_int32(codes, 4), "weight_scale": scale,
             "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0),
             "weight_shape": torch.tensor([n_out, n_in]),
             "weight_g_idx": g_idx.to(torch.int32)}
    cfg = prequant_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"g": {"targets": ["Linear"], "weights": {
                               "num_bits": 4, "type": "int", "symmetric": False,
                               "strategy": "group", "group_size": size}}}})
    state = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in parts.items()}
    (name, got), = dequantized_weights(state.items(), cfg, state.keys())
    assert name == "model.layers.0.mlp.up_proj.weight"
    ref = (codes.float() - zp.float()[:, g_idx]) * scale[:, g_idx]
    torch.testing.assert_close(got[:], ref, atol=0, rtol=0)


@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_unpack_reads_every_width(byteorder, monkeypatch):
    """Dense little-end packing, 1-8 bits, codes across word boundaries included; the
    byte-splitting path (1, 2, 4, 8 bits on little-endian hosts) and the word-shifting
    one give the same codes."""
    import sys

    monkeypatch.setattr(sys, "byteorder", byteorder)
    g = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        codes = torch.randint(0, 1 << bits, (3, 70), generator=g)
        got = _unpack(pack_dense(codes, bits), bits, 70)
        assert got.dtype == (torch.uint8 if byteorder == "little" and 8 % bits == 0
                             else torch.int32)
        assert torch.equal(got.to(torch.int64), codes)
        assert torch.equal(_unpack(pack_dense(codes, bits).t().contiguous().t(), bits, 70)
                           .to(torch.int64), codes)  # strided words


def test_zero_gptq_biases_are_dropped_nonzero_ones_refused(tmp_path, dense_src):
    """AutoGPTQ saves a zero bias for every projection; a Llama has none, so a zero one is
    skipped and a real one is an error naming it."""
    from safetensors.torch import load_file, save_file

    qpath, _ = write_gptq(dense_src, tmp_path / "gptq")
    assert make_worker(qpath, num_blocks=8, block_size=4).get_model_info()[
        "checkpoint_quantization"] == "gptq"
    state = load_file(str(qpath / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.bias"] = torch.ones(64, dtype=torch.float16)
    save_file(state, str(qpath / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.bias"):
        make_worker(qpath, num_blocks=8, block_size=4)


def test_missing_part_is_named(tmp_path, dense_src):
    from safetensors.torch import load_file, save_file

    qpath, _ = write_gptq(dense_src, tmp_path / "gptq")
    state = load_file(str(qpath / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.scales"]
    save_file(state, str(qpath / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.o_proj lacks \['scales'\]"):
        make_worker(qpath, num_blocks=8, block_size=4)


@pytest.mark.parametrize("raw,field", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "zero_point"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}},
      "format": "pack-quantized", "sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity_config.format"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "float"}}}, "format": "nvfp4-pack-quantized"},
     "config_groups.g.format"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "config_groups"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ("gptq", "must be an object"),
])
def test_bad_quantization_config_names_the_field(raw, field):
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        prequant_config(raw)


def test_int8_on_a_gptq_checkpoint_quantises_the_dequantised_weights(tmp_path, dense_src):
    """``quantization="int8"`` over a GPTQ model: our own groups of 32 over the weights the
    checkpoint stands for, so the logits stay within int8's error of the dense model's."""
    qpath, dense = write_gptq(dense_src, tmp_path / "gptq")
    got = _paged_logits(qpath, quantization="int8")
    ref = _hf_logits(load_hf(dense))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_int4_on_a_gptq_checkpoint_keeps_its_codes(tmp_path, dense_src):
    """``quantization="int4"`` over a 4-bit GPTQ model with groups of 64: each group of 32
    keeps the checkpoint's grid (``cpu_int8.quantize_asymmetric4``), so the weights the
    kernel reads are the checkpoint's to 16-bit rounding, not quantised a second time."""
    from safetensors.torch import load_file

    qpath, dense = write_gptq(dense_src, tmp_path / "gptq", bits=4, group_size=64, sym=False)
    ref = load_file(str(dense / "model.safetensors"))
    worker = make_worker(qpath, num_blocks=8, block_size=4, quantization="int4")
    layer = worker.model.layers[1]
    for module, names in ((layer.self_attn.qkv_proj, ("q", "k", "v")),
                          (layer.self_attn.o_proj, ("o",))):
        want = torch.cat([ref[f"model.layers.1.self_attn.{n}_proj.weight"] for n in names])
        got = module.quant.dequantize()
        torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)


def test_tp2_gptq_equals_tp1(tmp_path, dense_src):
    """Each rank dequantises a projection whole, then takes its slice."""
    from tests.worker.test_tensor_parallel import _free_port, _rank_main, _run

    qpath, _ = write_gptq(dense_src, tmp_path / "gptq", desc_act=True)
    ref_logits, ref_toks = _run(make_worker(qpath, num_blocks=40, block_size=4), 4)
    result = tmp_path / "tp2.pt"
    mp.spawn(_rank_main, args=(str(qpath), f"tcp://127.0.0.1:{_free_port()}", str(result)),
             nprocs=2, join=True)
    got = torch.load(result)
    torch.testing.assert_close(got["logits"], ref_logits, atol=2e-5, rtol=1e-4)
    assert got["toks"] == ref_toks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gptq_equals_dense(tmp_path, dense_src):
    """On a GPU the dequantised weights are the dense file's too (fp32, both on CUDA)."""
    qpath, dense = write_gptq(dense_src, tmp_path / "gptq", desc_act=True)
    got = _paged_logits(qpath, device="cuda", dtype="float32")
    ref = _paged_logits(dense, device="cuda", dtype="float32")
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), ref.cpu(), atol=1e-4, rtol=1e-4)


def test_vllm_checkpoint_method_names_must_match_the_file(tmp_path, dense_src):
    """``quantization="gptq"`` (vLLM's way of naming the file's method) serves a GPTQ
    file as it is; naming another method, or one for a dense file, is a ``ValueError``
    naming both."""
    qpath, dense = write_gptq(dense_src, tmp_path / "gptq")
    torch.testing.assert_close(_paged_logits(qpath, quantization="gptq"),
                               _hf_logits(load_hf(dense)), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="quantization='awq', but the checkpoint's "
                                         "quantization_config says 'gptq'"):
        make_worker(qpath, num_blocks=8, block_size=4, quantization="awq")
    with pytest.raises(ValueError, match="quantization='fp8', but the checkpoint is not "
                                         "quantised"):
        make_worker(dense, num_blocks=8, block_size=4, quantization="fp8")


def test_layers_are_quantised_as_they_load(tmp_path, dense_src, monkeypatch):
    """Under ``quantization``, each decoder layer is quantised as soon as its last tensor
    is in, before the next layer's first tensor arrives (a model quantised on load is
    never whole in full precision); the LM head follows at the end."""
    from pagedserve.worker import worker as worker_mod

    events: list[str] = []
    stream, quantize = worker_mod.iter_safetensors, worker_mod.quantize_model

    def recording_stream(path, **kw):
        for name, lazy in stream(path, **kw):
            events.append(name)
            yield name, lazy

    def recording_quantize(model, method, shared=None, skip=None, prefix=""):
        events.append(f"quantize {prefix or 'model'}")
        return quantize(model, method, shared, skip, prefix)

    monkeypatch.setattr(worker_mod, "iter_safetensors", recording_stream)
    monkeypatch.setattr(worker_mod, "quantize_model", recording_quantize)
    qpath, _ = write_gptq(dense_src, tmp_path / "gptq")
    worker = make_worker(qpath, num_blocks=8, block_size=4, quantization="int8")
    assert events.index("quantize model.layers.0.") < min(
        i for i, e in enumerate(events) if e.startswith("model.layers.1."))
    assert events[-1] == "quantize model" and events.count("quantize model.layers.1.") == 1
    assert worker.model.layers[1].mlp.down_proj.quant is not None
    assert worker.model.lm_head.quant is not None


@pytest.mark.parametrize("writer,legacy", [(write_gptq, "quantize_config.json"),
                                           (write_awq, "quant_config.json")])
def test_legacy_quantize_config_files_are_read(tmp_path, dense_src, writer, legacy):
    """Older AutoGPTQ / AutoAWQ repos keep their settings only in ``quantize_config.json``
    / ``quant_config.json`` (no ``quant_method``, AutoAWQ's ``w_bit`` / ``q_group_size`` /
    upper-case ``version``): read as the method they imply."""
    qpath, dense = writer(dense_src, tmp_path / "q")
    cfg = json.loads((qpath / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    quant.pop("quant_method")
    if legacy == "quant_config.json":
        quant = {"w_bit": quant["bits"], "q_group_size": quant["group_size"],
                 "zero_point": True, "version": "GEMM"}
    (qpath / "config.json").write_text(json.dumps(cfg))
    (qpath / legacy).write_text(json.dumps(quant))
    assert ModelConfig.from_pretrained(qpath).prequant is not None
    torch.testing.assert_close(_paged_logits(qpath), _hf_logits(load_hf(dense)),
                               atol=2e-5, rtol=1e-4)


def test_a_pipeline_stage_reads_only_its_layers_packed_parts(tmp_path, dense_src,
                                                             monkeypatch):
    """Stage 1 of 2 of a GPTQ checkpoint reads (and dequantises) no packed part of
    stage 0's layers, and stage 1 still holds the dense file's weights."""
    from pagedserve.worker import worker as worker_mod

    read: list[str] = []
    stream = worker_mod.iter_safetensors

    class Spy:
        def __init__(self, name, lazy):
            self.name, self.lazy, self.shape = name, lazy, lazy.shape

        def __getitem__(self, idx):
            read.append(self.name)
            return self.lazy[idx]

    def spying_stream(path, **kw):
        for name, lazy in stream(path, **kw):
            yield name, Spy(name, lazy)

    monkeypatch.setattr(worker_mod, "iter_safetensors", spying_stream)
    qpath, dense = write_gptq(dense_src, tmp_path / "gptq")
    last = make_worker(qpath, num_blocks=8, block_size=4, pipeline_parallel_size=2, pp_rank=1)
    packed = [n for n in read if n.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))]
    assert packed and all(n.startswith("model.layers.1.") for n in packed), packed
    ref = make_worker(dense, num_blocks=8, block_size=4, pipeline_parallel_size=2, pp_rank=1)
    down = last.model.layers[0].mlp.down_proj, ref.model.layers[0].mlp.down_proj
    x = torch.randn(3, down[1].local_in, generator=torch.Generator().manual_seed(0))
    got, want = (d.matmul(x) for d in down)  # (the weights may be packed for oneDNN)
    torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("kind", ["gptq4-act-order", "gptq8", "gptq3", "awq", "fp8-block",
                                  "ct-w4-group-asym", "ct-w8-channel"])
def test_a_ranks_slice_dequantises_only_that_slice(tmp_path, dense_src, kind, monkeypatch):
    """A column-parallel rank's share (a slice of output rows) and a row-parallel one's
    (a slice of inputs) equal the whole projection's slice bit for bit, cut from the
    packed parts where they split there (whole packed words, whole groups, the group
    index of an act-order file) and dequantised whole where they do not (3-bit codes,
    block scales, a cut inside a packed word or group)."""
    from safetensors.torch import load_file

    from pagedserve.worker.loaders import prequant

    if kind.startswith("gptq"):
        bits = int(kind[4])
        path, _ = write_gptq(dense_src, tmp_path / "q", bits=bits, desc_act="act" in kind)
    elif kind == "awq":
        path, _ = write_awq(dense_src, tmp_path / "q")
    elif kind == "fp8-block":
        path, _ = write_fp8(dense_src, tmp_path / "q")
    else:
        pytest.importorskip("compressed_tensors")
        bits = 4 if "w4" in kind else 8
        path = write_compressed_tensors(dense_src, tmp_path / "q", bits,
                                        "group" if bits == 4 else "channel",
                                        32 if bits == 4 else None, symmetric="asym" not in kind)
    state = load_file(str(path / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(path).prequant
    whole_calls = 0
    make = prequant.DequantizedWeight.__init__

    def counting(self, name, shape, fn, rows=None):
        def counted():
            nonlocal whole_calls
            whole_calls += 1
            return fn()
        make(self, name, shape, counted, rows)

    got = dict(dequantized_weights(state.items(), cfg, state.keys()))
    ref = {k: v[:] for k, v in got.items() if isinstance(v, prequant.DequantizedWeight)}
    assert len(ref) == 14
    monkeypatch.setattr(prequant.DequantizedWeight, "__init__", counting)
    sliced = dict(dequantized_weights(state.items(), cfg, state.keys()))
    splits = kind not in ("gptq3", "fp8-block")
    for name, want in ref.items():
        n, n_in = want.shape
        for a, b in ((0, n // 2), (n // 2, n), (8, n - 8)):
            assert torch.equal(sliced[name][a:b], want[a:b]), (name, a, b)
        for a, b in ((0, 32), (32, n_in)):  # (the tiny model's inputs: 64 or 96)
            assert torch.equal(sliced[name][:, a:b], want[:, a:b]), (name, a, b)
    assert (whole_calls == 0) == splits, whole_calls
    first = next(iter(ref))
    assert torch.equal(sliced[first][3:9], ref[first][3:9])  # inside a packed word: whole
    assert torch.equal(sliced[first][:, 8:16], ref[first][:, 8:16])  # inside a group
