"""LoRA adapters on recurrent hybrids (``cluster.recurrent_engine.LORA_MODEL_TYPES``):
the attention and MLP projections take adapters as Llama's do, under the files' own
module names (Jamba's ``feed_forward``, LFM2's ``w1`` / ``w2`` / ``w3``, Qwen3.5's
``language_model``, Nemotron-H's blocks' ``mixer``), scaled by the multipliers
folded into those projections (Falcon-H1's), Qwen3-Next's ``q_proj`` deltas split
into its query and its gate projection as its weight is; the mixers take none.

Against Hugging Face + PEFT on adapters PEFT itself wrote: each prompt with the
adapter and without it, interleaved in one batch, gives PEFT's greedy tokens (and
the adapter changes them). The attention-free Mamba models refuse ``enable_lora``
by name; an adapter on a conv mixer is refused naming its weight."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster import LLM, LoRARequest
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.recurrent_engine import recurrent_engine_config
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.lora_fixtures import ALL7, GREEDY, PROMPTS, hf_peft_greedy, write_adapter


@pytest.mark.parametrize("kind,targets", [
    ("jamba", ALL7),
    ("granitemoehybrid", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("lfm2", ["q_proj", "k_proj", "v_proj", "w1", "w2", "w3"]),
    ("falcon_h1", ALL7),  # (every muP multiplier away from 1: the deltas scale alike)
    ("qwen3_5", ALL7),  # (a multimodal file's decoder; q_proj's B rows hold the gate's)
    # (Nemotron-H: every projection a block's ``mixer``; the MLP blocks' ungated)
    ("nemotron_h", ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
])
def test_adapter_rows_beside_base_rows_equal_peft(kind, targets, tmp_path,
                                                  default_model_dir) -> None:
    path = write_random_checkpoint(tmp_path / kind, kind, default_model_dir)
    adapter = write_adapter(path, tmp_path / "adapter", 1, targets)
    ref, base = hf_peft_greedy(path, adapter, PROMPTS), hf_peft_greedy(path, None, PROMPTS)
    assert ref != base
    lora = LoRARequest("a", 1, adapter)
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4, enable_lora=True,
              max_lora_rank=8)
    try:
        outs = llm.generate([p for p in PROMPTS for _ in range(2)], GREEDY,
                            lora_request=[lora, None] * len(PROMPTS))
        got = [o.outputs[0].token_ids for o in outs]
        assert got[0::2] == ref and got[1::2] == base
        if kind == "lfm2":  # (``out_proj`` names the conv mixers' projection too)
            bad = write_adapter(path, tmp_path / "bad", 2, ["out_proj"])
            with pytest.raises(ValueError, match=r"conv\.out_proj"):
                llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", 2, bad))
            assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == base[0]
    finally:
        llm.shutdown()


def test_other_recurrent_families_refuse_lora(tmp_path) -> None:
    for model_type in ("mamba", "falcon_mamba", "mamba2"):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(
            json.dumps({"model_type": model_type}))
        config = EngineConfig(model=str(tmp_path / model_type), enable_lora=True)
        with pytest.raises(ValueError, match=f"enable_lora is not supported for "
                                             f"'{model_type}'"):
            recurrent_engine_config(config, str(tmp_path / model_type))
