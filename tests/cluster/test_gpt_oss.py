"""GPT-OSS through the engine: Hugging Face parity under chunked prefill, forced
preemption and sliding windows that release blocks; the sinks and the experts'
clamp and biases each change the answer (so parity is not luck); int8 experts on
CPU; a backend without sinks is never picked for it, and asking for one fails.

(The mixed batch with prefix-cache hits is in ``test_hf_parity.py``; TP=2 and
expert parallelism against TP=1 in ``tests/worker/test_tensor_parallel.py``.) The
``gpu`` test runs in ``bench/gpu_check.sh``'s window.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.moe_gpt_oss import GptOssMoE
from pagedserve.worker.parallel import ParallelContext
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_engine_gpu import cuda_only
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_windows_and_preemption_equal_hugging_face(mode,
                                                                   tiny_gpt_oss_dir) -> None:
    """Four-token blocks, eight-token chunks and a pool too small for the batch: the
    sliding layers' blocks behind their 12-token window are released as sequences
    grow, sequences are preempted and come back, and every token is HF's."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(tiny_gpt_oss_dir, prompts, 16)
    llm = LLM(model=tiny_gpt_oss_dir, block_size=4, num_gpu_blocks=40, preemption_mode=mode,
              num_cpu_blocks=64 if mode == "swap" else 0, max_num_batched_tokens=8)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def _variant(src: str, dest: Path, edit) -> str:
    """A copy of checkpoint ``src`` with its tensors passed through ``edit(name, t)``."""
    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({n: edit(n, t) for n, t in tensors.items()}, f, metadata={"format": "pt"})
    return str(dest)


def test_sinks_and_expert_biases_change_the_answer(tmp_path, tiny_gpt_oss_dir) -> None:
    """Parity would hold by luck if the sinks or biases did nothing: without them
    (sinks at -inf's stand-in, biases zeroed) HF's own tokens change."""
    prompts = prompts_of_mixed_lengths(4)
    ref = hf_greedy(tiny_gpt_oss_dir, prompts, 16)
    no_sinks = _variant(tiny_gpt_oss_dir, tmp_path / "no_sinks",
                        lambda n, t: t.fill_(-1e4) if n.endswith("sinks") else t)
    no_bias = _variant(tiny_gpt_oss_dir, tmp_path / "no_bias",
                       lambda n, t: t.zero_() if "experts" in n and n.endswith("bias") else t)
    assert hf_greedy(no_sinks, prompts, 16) != ref
    assert hf_greedy(no_bias, prompts, 16) != ref
    llm = LLM(model=no_sinks, num_gpu_blocks=64)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == hf_greedy(no_sinks, prompts, 16)
    finally:
        llm.shutdown()


def test_experts_equal_hugging_face_and_clamp(tiny_gpt_oss_dir) -> None:
    """One layer's router and experts against ``GptOssMLP`` on inputs large enough for
    the clamp at ``swiglu_limit`` to bite."""
    from transformers import GptOssForCausalLM

    hf = GptOssForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.float32)
    cfg = ModelConfig.from_pretrained(tiny_gpt_oss_dir)
    moe = GptOssMoE(cfg.hidden_size, cfg.moe, ParallelContext(), torch.float32,
                    torch.device("cpu"))
    for f in Path(tiny_gpt_oss_dir).glob("*.safetensors"):
        for name, t in load_file(f).items():
            if name.startswith("model.layers.0.mlp."):
                assert moe.load(name[len("model.layers.0.mlp."):], t)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 8
    with torch.inference_mode():
        want, _ = hf.model.layers[0].mlp(x[None])
        gate_up = x @ hf.model.layers[0].mlp.experts.gate_up_proj[0]
        assert gate_up[:, 0::2].max() > cfg.moe.swiglu_limit  # the clamp is exercised
        got = moe(x)
        torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
        moe.quantize("model.layers.0.mlp")  # int8 experts: the loop, biases as they are
        assert moe.int8 is not None and moe.int8_native is None
        err = (moe(x) - want[0]).abs().max() / want[0].abs().max()
        assert err < 0.02


def test_int8_weights_serve_it(tiny_gpt_oss_dir) -> None:
    """``quantization="int8"`` on CPU quantises the experts (through the expert loop,
    biases kept) and the projections; greedy tokens stay mostly HF's."""
    prompts = prompts_of_mixed_lengths(4)
    ref = hf_greedy(tiny_gpt_oss_dir, prompts, 8)
    llm = LLM(model=tiny_gpt_oss_dir, num_gpu_blocks=64, quantization="int8")
    try:
        moe = llm.engine.executor.worker.model.layers[0].mlp
        assert moe.int8 is not None
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
        same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
        assert same >= 0.75 * sum(map(len, ref))
    finally:
        llm.shutdown()


def test_backends_without_sinks_are_skipped_or_refused(monkeypatch) -> None:
    """flash-attn (FA2) has no sinks: the automatic choice moves on to the next backend,
    an explicit choice is a ValueError naming the backend."""
    from pagedserve.kernels import backend as backend_mod
    from pagedserve.kernels.torch_ref import TorchBackend

    class NoSinks(TorchBackend):
        name = "flash"

        def supports_sinks(self) -> bool:
            return False

    monkeypatch.setattr(backend_mod, "_instantiate",
                        lambda name, dev: NoSinks(dev) if name == "flash" else TorchBackend(dev))
    monkeypatch.setattr(backend_mod, "_unavailable_reason", lambda name, dev: None)
    monkeypatch.setattr(backend_mod, "available_backends", lambda dev: ["flash", "torch"])
    dev = torch.device("cuda")
    assert backend_mod.get_backend(None, dev).name == "flash"
    assert backend_mod.get_backend(None, dev, needs_sinks=True).name == "torch"
    auto = backend_mod.backend_with_sinks(NoSinks("cpu"), None)
    assert auto.supports_sinks()
    with pytest.raises(ValueError, match="'flash' has no attention sinks"):
        backend_mod.backend_with_sinks(NoSinks("cpu"), "flash")
    with pytest.raises(ValueError, match="sinks"):
        NoSinks("cpu").check_sinks(torch.zeros(4), 4)


@pytest.mark.parametrize(("field", "value"), [("swiglu_limit", -1), ("swiglu_alpha", "x"),
                                              ("num_local_experts", 0)])
def test_bad_config_names_its_field(tiny_gpt_oss_dir, field, value) -> None:
    cfg = json.loads((Path(tiny_gpt_oss_dir) / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(cfg)


def test_an_mxfp4_file_equals_hugging_face_dequantising_it(tmp_path, tiny_gpt_oss_dir) -> None:
    """The releases' format: experts as MXFP4 blocks and scales (written here as OpenAI's
    files are), dequantised as they load; greedy tokens equal transformers' own
    dequantised load of the same file, and the rounding changed HF's answer from the
    dense file's (so the experts did go through the codes)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from pagedserve.worker.testing_mxfp4 import write_mxfp4_checkpoint

    path = str(write_mxfp4_checkpoint(tiny_gpt_oss_dir, tmp_path / "mxfp4"))
    prompts = prompts_of_mixed_lengths(4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    ref = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
            ref.append(y[0, len(ids):].tolist())
    assert ref != hf_greedy(tiny_gpt_oss_dir, prompts, 16)
    assert ModelConfig.from_pretrained(path).prequant.method == "mxfp4"
    llm = LLM(model=path, num_gpu_blocks=64, quantization="mxfp4")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == ref
    finally:
        llm.shutdown()


@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_greedy_equals_hugging_face_with_graphs(tiny_gpt_oss_dir, dtype) -> None:
    """On CUDA: Triton attention with sinks (flash-attn skipped), the fused Triton experts
    with biases and the clamp, decode in CUDA graphs; HF's tokens in fp32, bf16 runs."""
    prompts = prompts_of_mixed_lengths()
    llm = LLM(model=tiny_gpt_oss_dir, device="cuda", dtype=dtype, num_gpu_blocks=256)
    try:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        worker = llm.engine.executor.worker
        assert worker.backend.supports_sinks() and worker.model.layers[0].mlp.fused
        graphs = worker.runner.graphs
        assert graphs is not None and graphs.graphs and not graphs.disabled
        if dtype == "float32":
            assert outs == hf_greedy(tiny_gpt_oss_dir, prompts, 16, device="cuda")
        else:
            assert all(len(o) == 16 for o in outs)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
