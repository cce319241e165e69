"""Granite 3.x and its mixtures of experts through the engine: each of the four
scalars changes Hugging Face's answer (so parity is not luck), and the engine gives
HF's greedy tokens under chunked prefill, with int8 weights close to HF's logprobs, and bad
scalars named at load. (The mixed batch with prefix-cache hits, dense and MoE, is in
``test_hf_parity.py``; TP=2 with the shared expert in
``tests/worker/test_tensor_parallel.py``.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.testing import GRANITE_SCALES
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _with(src: str, dest: Path, **fields: object) -> str:
    """A copy of checkpoint ``src`` with config fields changed."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(fields)
    (dest / "config.json").write_text(json.dumps(cfg))
    return str(dest)


def test_each_scalar_changes_the_answer(tmp_path, tiny_granite_dir) -> None:
    """Three scalars change HF's greedy tokens; ``logits_scaling`` (which keeps the
    argmax) changes the logprobs, which the engine reports as HF computes them."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = prompts_of_mixed_lengths(3)
    ref = hf_greedy(tiny_granite_dir, prompts, 12)
    for key in GRANITE_SCALES:
        if key != "logits_scaling":
            plain = _with(tiny_granite_dir, tmp_path / key, **{key: 1.0})
            assert hf_greedy(plain, prompts, 12) != ref, key
    hf = AutoModelForCausalLM.from_pretrained(tiny_granite_dir, dtype=torch.float32)
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([prompts[1]])).logits[0, -1], -1)
    llm = LLM(model=tiny_granite_dir, num_gpu_blocks=32)
    try:
        (out,) = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=1,
                                                            logprobs=3))
        for tok, lp in out.outputs[0].logprobs[0].items():
            assert abs(lp - want[tok].item()) < 1e-4
        top = max(out.outputs[0].logprobs[0].values())
        assert abs(top - (want * GRANITE_SCALES["logits_scaling"]).log_softmax(-1).max()) > 0.1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture", ["tiny_granite_dir", "tiny_granitemoe_dir"])
def test_chunked_prefill_equals_hugging_face(fixture, request) -> None:
    path = request.getfixturevalue(fixture)
    prompts = prompts_of_mixed_lengths()
    ref = hf_greedy(path, prompts, 12)
    llm = LLM(model=path, num_gpu_blocks=64, block_size=4, max_num_batched_tokens=8)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    finally:
        llm.shutdown()


def test_int8_weights_stay_close(tiny_granitemoe_dir) -> None:
    """``quantization="int8"``: the stacked experts and the shared expert quantised; each
    prompt's next token is HF's best within 0.05 (the random model's logits are flat
    after ``logits_scaling``, so near-ties are common) and its logprob within 0.05 of
    HF's."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = prompts_of_mixed_lengths(4)
    hf = AutoModelForCausalLM.from_pretrained(tiny_granitemoe_dir, dtype=torch.float32)
    llm = LLM(model=tiny_granitemoe_dir, num_gpu_blocks=64, quantization="int8")
    try:
        moe = llm.engine.executor.worker.model.layers[0].mlp
        assert moe.int8 is not None or moe.int8_native is not None
        assert moe.shared_gate_up is not None
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=1))
        for ids, out in zip(prompts, outs, strict=True):
            with torch.inference_mode():
                want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
            (tok,) = out.outputs[0].token_ids  # HF's best, or all but tied with it
            assert want.max() - want[tok] < 0.05
            assert abs(out.outputs[0].logprobs[0][tok] - want[tok].item()) < 0.05
    finally:
        llm.shutdown()


@pytest.mark.parametrize("field", list(GRANITE_SCALES))
@pytest.mark.parametrize("value", [0, -1.0, "2", True])
def test_bad_scalars_name_their_field(tiny_granite_dir, field, value) -> None:
    cfg = json.loads((Path(tiny_granite_dir) / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(cfg)
