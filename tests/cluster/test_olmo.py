"""OLMo 2 and OLMo 3 through the engine: Hugging Face's greedy tokens with prefix-cache
hits and under chunked prefill, OLMo 3's sliding layers with their own RoPE table when
the full layers' is scaled, and both config layouts of that RoPE read alike. (TP=2, the
q / k norms summed across ranks, is in ``tests/worker/test_tensor_parallel.py``.)"""

from __future__ import annotations

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.olmo_config import olmo_rope
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def olmo_dirs(tmp_path_factory, default_model_dir) -> dict[str, str]:
    """An OLMo 2, and an OLMo 3 (3 sliding 12-token layers, then a full one) whose full
    layers use YaRN while the sliding ones keep plain RoPE."""
    root = tmp_path_factory.mktemp("olmo")
    return {
        "olmo2": write_random_checkpoint(root / "olmo2", "olmo2", default_model_dir),
        "olmo3": write_random_checkpoint(
            root / "olmo3", "olmo3", default_model_dir, sliding_window=12,
            num_hidden_layers=4, rope_parameters={
                "full_attention": YARN,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }


@pytest.mark.parametrize("kind", ["olmo2", "olmo3"])
def test_greedy_equals_hugging_face(kind, olmo_dirs) -> None:
    path = olmo_dirs[kind]
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(path, prompts, 12)
    llm = LLM(model=path, num_gpu_blocks=256, block_size=4, max_num_batched_tokens=8)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
        again = llm.generate(prompts, GREEDY)  # every full prompt block a prefix hit
        assert [o.outputs[0].token_ids for o in again] == ref
        assert max(o.num_cached_tokens for o in again) >= 16
        model = llm.engine.executor.worker.model
        assert (model.rotary_local is not None) == (kind == "olmo3")
    finally:
        llm.shutdown()


def test_both_rope_layouts_read_alike() -> None:
    """transformers 5's ``rope_parameters`` by layer type, and the released files'
    ``rope_theta`` + ``rope_scaling`` (for the full layers only)."""
    base = dict(model_type="olmo3", hidden_size=64, num_attention_heads=4,
                num_hidden_layers=4, intermediate_size=64, vocab_size=100,
                sliding_window=8, max_position_embeddings=512)
    new = ModelConfig.from_hf_dict({**base, "rope_parameters": {
        "full_attention": YARN, "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0}}})
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 10000.0, "rope_scaling": {
        k: v for k, v in YARN.items() if k != "rope_theta"}})
    assert new.rope_scaling == old.rope_scaling and new.rope_scaling["rope_type"] == "yarn"
    assert new.rope_theta == old.rope_theta == 10000.0
    assert new.local_rope_theta == old.local_rope_theta == 10000.0
    plain = ModelConfig.from_hf_dict({**base, "rope_theta": 500000.0})
    assert plain.rope_scaling is None and plain.local_rope_theta is None
    assert olmo_rope({"rope_theta": 1.0}, "olmo2") == ({"rope_theta": 1.0}, None)
    with pytest.raises(ValueError, match="sliding_attention"):
        olmo_rope({**base, "rope_parameters": {"full_attention": YARN,
                                               "sliding_attention": YARN}}, "olmo3")
