"""Mixture-of-experts models through the engine: Hugging Face parity under chunked
prefill and forced preemption, LoRA beside routed experts, and clear refusals.

(The plain mixed-batch parity with prefix-cache hits for Mixtral, Qwen2-MoE and
Qwen3-MoE is in ``test_hf_parity.py``; TP=2 = TP=1 in ``tests/worker``.) The
``gpu`` test runs in ``bench/gpu_check.sh``'s window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.lora_fixtures import hf_peft_greedy, write_adapter
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_engine_gpu import cuda_only
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_and_preemption_equal_hugging_face(mode, tiny_qwen3_moe_dir) -> None:
    """Prompt chunks of 8 tokens and a pool of 24 four-token blocks: every step routes a
    different mix of prefill and decode rows, and preempted sequences come back to the
    same tokens."""
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(tiny_qwen3_moe_dir, prompts, 20)
    llm = LLM(model=tiny_qwen3_moe_dir, block_size=4, num_gpu_blocks=24, preemption_mode=mode,
              num_cpu_blocks=64 if mode == "swap" else 0, max_num_batched_tokens=8)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_routing_depends_on_the_token(tiny_mixtral_dir) -> None:
    """The fixture exercises routing: over the test prompts' steps, every expert of the
    first layer is chosen for some token (the rows the layer really sees)."""
    llm = LLM(model=tiny_mixtral_dir, num_gpu_blocks=64)
    try:
        info = llm.engine.executor.worker.get_model_info()
        assert (info["num_experts"], info["num_experts_per_tok"]) == (4, 2)
        moe = llm.engine.executor.worker.model.layers[0].mlp
        inputs: list[torch.Tensor] = []
        hook = moe.register_forward_hook(lambda _m, args, _out: inputs.append(args[0]))
        try:
            llm.generate(prompts_of_mixed_lengths(), GREEDY)
        finally:
            hook.remove()
        x = torch.cat(inputs)
        _, experts = torch.softmax(x @ moe.router.t(), dim=-1).topk(moe.top_k, dim=-1)
        assert set(experts.flatten().tolist()) == set(range(moe.num_experts))
    finally:
        llm.shutdown()


def test_lora_on_attention_equals_hugging_face_peft(tmp_path, tiny_qwen3_moe_dir) -> None:
    path = write_adapter(tiny_qwen3_moe_dir, tmp_path / "a", 3, ["q_proj", "v_proj", "o_proj"])
    prompts = prompts_of_mixed_lengths(4)
    ref = hf_peft_greedy(tiny_qwen3_moe_dir, path, prompts, 20)
    assert ref != hf_greedy(tiny_qwen3_moe_dir, prompts, 20)
    llm = LLM(model=tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64)
    try:
        outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, path))
        assert [o.outputs[0].token_ids for o in outs] == ref
    finally:
        llm.shutdown()


def test_adapters_on_experts_are_refused(tmp_path, tiny_qwen3_moe_dir) -> None:
    """PEFT turns ``gate_proj``/``up_proj`` targets on a MoE model into parameter-level
    LoRA on the stacked experts; that, and an adapter naming a routed layer's
    ``mlp.gate_proj``, fail to load with a message that says why. The engine keeps
    serving and leaks nothing."""
    peft_experts = write_adapter(tiny_qwen3_moe_dir, tmp_path / "experts", 3,
                                 ["q_proj", "gate_proj", "up_proj"])
    attn = write_adapter(tiny_qwen3_moe_dir, tmp_path / "attn", 3, ["q_proj"])
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    cfg = json.loads((Path(attn) / "adapter_config.json").read_text())
    (renamed / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(Path(attn) / "adapter_model.safetensors"))
    save_file({k.replace(".layers.0.self_attn.q_proj.", ".layers.0.mlp.gate_proj."): v
               for k, v in tensors.items()}, str(renamed / "adapter_model.safetensors"))
    llm = LLM(model=tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=16, num_gpu_blocks=64)
    try:
        for lora_id, path, match in ((2, peft_experts, "target_parameters"),
                                     (3, str(renamed), "mixture of experts")):
            with pytest.raises(ValueError, match=match):
                llm.generate([[5, 6, 7]], GREEDY,
                             lora_request=LoRARequest(f"bad{lora_id}", lora_id, path))
        out = llm.generate([[5, 6, 7]], GREEDY)[0]
        assert len(out.outputs[0].token_ids) == 20
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("field,value,match", [
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("num_experts_per_tok", 0, "num_experts_per_tok"),
    ("moe_intermediate_size", None, "moe_intermediate_size"),
    ("mlp_only_layers", "1", "mlp_only_layers"),
])
def test_bad_moe_config_names_its_field(tiny_qwen3_moe_dir, field, value, match) -> None:
    cfg = json.loads((Path(tiny_qwen3_moe_dir) / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)


def test_expert_width_must_divide_by_tensor_parallel_size(tiny_qwen3_moe_dir) -> None:
    from pagedserve.worker.layers.moe import SparseMoE
    from pagedserve.worker.parallel import ParallelContext

    moe = ModelConfig.from_pretrained(tiny_qwen3_moe_dir).moe
    with pytest.raises(ValueError, match="expert intermediate size 32 is not divisible by TP "
                                         "size 3"):
        SparseMoE(64, moe, ParallelContext(rank=0, world_size=3), torch.float32,
                  torch.device("cpu"))


@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_moe_greedy_equals_hugging_face_with_graphs(tmp_path, dtype) -> None:
    """The fused Triton experts on CUDA, decode in CUDA graphs: HF's tokens in fp32, and
    bf16 runs."""
    path = write_random_checkpoint(tmp_path / "m", "qwen3_moe", None, num_experts=8,
                                   num_experts_per_tok=3, mlp_only_layers=[1])
    prompts = prompts_of_mixed_lengths()
    llm = LLM(model=path, device="cuda", dtype=dtype, num_gpu_blocks=256)
    try:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        graphs = llm.engine.executor.worker.runner.graphs
        assert llm.engine.executor.worker.model.layers[0].mlp.fused
        assert graphs is not None and graphs.graphs and not graphs.disabled
        if dtype == "float32":
            assert outs == hf_greedy(path, prompts, 20, device="cuda")
        else:
            assert all(len(o) == 20 for o in outs)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
