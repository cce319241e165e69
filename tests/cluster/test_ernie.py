"""Ernie 4.5 (``ernie4_5``) through the engine: its RoPE turns interleaved pairs, which
the loader reorders into our half-split rotation; the engine gives Hugging Face's
greedy tokens under chunked prefill, while the same file read as a plain Llama (no
reordering) does not; biased MLPs are refused by name. (TP=2, each head reordered
before it is split, is in ``tests/worker/test_tensor_parallel.py``.)"""

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


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory, default_model_dir) -> str:
    return write_random_checkpoint(tmp_path_factory.mktemp("ernie"), "ernie4_5",
                                   default_model_dir, head_dim=16, tie_word_embeddings=True)


def _greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=path, num_gpu_blocks=128, block_size=4, max_num_batched_tokens=8)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


def test_interleaved_rope_equals_hugging_face(tmp_path, ernie_dir) -> None:
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(ernie_dir, prompts, 12)
    assert _greedy(ernie_dir, prompts) == ref
    as_llama = tmp_path / "as_llama"
    shutil.copytree(ernie_dir, as_llama)
    cfg = json.loads((as_llama / "config.json").read_text())
    (as_llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert _greedy(str(as_llama), prompts) != ref  # the pairs' order matters


def test_biased_mlps_are_refused(ernie_dir) -> None:
    cfg = json.loads((Path(ernie_dir) / "config.json").read_text())
    assert ModelConfig.from_hf_dict(cfg).rope_interleaved
    with pytest.raises(ValueError, match="use_bias"):
        ModelConfig.from_hf_dict({**cfg, "use_bias": True})
