"""SmolLM3 through the engine: its NoPE layers (every fourth rotates by nothing)
change Hugging Face's answer and the engine gives HF's greedy tokens, with and
without sliding windows (which apply only under ``use_sliding_window``), under
chunked prefill; a malformed ``no_rope_layers`` is named at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
WINDOWS = dict(use_sliding_window=True, sliding_window=12,
               layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory, default_model_dir) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("smollm3"), "smollm3",
                                   default_model_dir, num_hidden_layers=4)


@pytest.mark.parametrize("windows", [False, True])
def test_greedy_equals_hugging_face(tmp_path, smollm3_dir, windows: bool) -> None:
    path = smollm3_dir
    if windows:
        path = str(tmp_path / "windowed")
        shutil.copytree(smollm3_dir, path)
        cfg = json.loads((Path(path) / "config.json").read_text())
        (Path(path) / "config.json").write_text(json.dumps({**cfg, **WINDOWS}))
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(path, prompts, 12)
    llm = LLM(model=path, num_gpu_blocks=256, block_size=4, max_num_batched_tokens=8)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
        model = llm.engine.executor.worker.model
        assert model._nope == [False, False, False, True]
        windows_seen = [layer.self_attn.attn.window for layer in model.layers]
        assert windows_seen == ([12, None, 12, None] if windows else [None] * 4)
    finally:
        llm.shutdown()


def test_nope_layers_change_the_answer(tmp_path, smollm3_dir) -> None:
    prompts = prompts_of_mixed_lengths(3)
    path = tmp_path / "all_rope"
    shutil.copytree(smollm3_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": [1, 1, 1, 1]}))
    assert hf_greedy(str(path), prompts, 12) != hf_greedy(smollm3_dir, prompts, 12)
    assert ModelConfig.from_pretrained(path).nope_layers == ()
    layer_types = ModelConfig.from_hf_dict({**cfg, **WINDOWS, "use_sliding_window": False})
    assert layer_types.sliding_layers == ()  # windows only under use_sliding_window


@pytest.mark.parametrize("value", [[1, 1, 0], [1, 2, 1, 0], "0101", [True, 1, 1, 0]])
def test_bad_no_rope_layers_name_the_field(smollm3_dir, value) -> None:
    cfg = json.loads((Path(smollm3_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match="no_rope_layers"):
        ModelConfig.from_hf_dict({**cfg, "no_rope_layers": value})
