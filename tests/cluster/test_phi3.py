"""Phi-3 / Phi-4 (``model_type: phi3``): files store ``qkv_proj`` and ``gate_up_proj``
fused; adapters trained on them (PEFT targets the fused names) are served as adapters
on the parts. Greedy tokens equal HF + PEFT's; base rows beside adapter rows equal HF."""

from __future__ import annotations

from pagedserve.cluster import LLM, LoRARequest, SamplingParams
from tests.cluster.lora_fixtures import hf_peft_greedy, write_adapter
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_phi3_lora_on_fused_projections_equals_hf_peft(tiny_phi3_dir, tmp_path) -> None:
    adapter = write_adapter(tiny_phi3_dir, tmp_path / "phi_fused", 7, FUSED)
    prompts = prompts_of_mixed_lengths(4)
    ref = hf_peft_greedy(tiny_phi3_dir, adapter, prompts)
    base = hf_peft_greedy(tiny_phi3_dir, None, prompts)
    assert ref != base
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=tiny_phi3_dir, num_gpu_blocks=128, enable_lora=True, max_lora_rank=8)
    try:
        lora = LoRARequest("phi_fused", 1, adapter)
        outs = llm.generate(prompts + prompts, params,
                            lora_request=[lora] * len(prompts) + [None] * len(prompts))
        assert [o.outputs[0].token_ids for o in outs] == ref + base
    finally:
        llm.shutdown()
