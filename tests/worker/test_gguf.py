"""The default SmolLM2 GGUF: converted weights equal transformers' GGUF load, cache reuse.

Slow-ish (transformers dequantises the file too), so the conversion and the
reference model are session fixtures shared by every test here.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.worker.loaders import default_gguf_path, load_tokenizer, resolve_model
from tests.worker.helpers import BlockAllocator, all_logits, make_worker, plan, request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm(pagedserve_cache):
    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_gguf_model():
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32, local_files_only=True)
    return model.eval()


def test_converted_weights_equal_transformers_gguf(smollm, hf_gguf_model):
    resolved = smollm
    ours = load_file(f"{resolved.path}/model.safetensors")
    ref = hf_gguf_model.state_dict()
    ref = {k: v for k, v in ref.items() if "rotary_emb" not in k}
    if hf_gguf_model.config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


def test_second_resolve_reuses_cache(smollm, pagedserve_cache, monkeypatch):
    """A second resolve reads the cache and converts nothing. Checked by the converter
    not running, not by a time ratio to the first resolve: that one is a conversion only
    if no other test in the session resolved the model before."""
    import pagedserve.worker.loaders.gguf as gguf_loader

    resolved = smollm

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion was converted again")

    monkeypatch.setattr(gguf_loader, "_convert_into", no_conversion)
    t0 = time.perf_counter()
    again = resolve_model(str(default_gguf_path()))
    took = time.perf_counter() - t0
    assert again.path == resolved.path
    assert str(pagedserve_cache) in resolved.path
    assert took < 5.0, took  # reading a few small files, not tens of seconds of conversion
    assert resolved.model_id == "SmolLM2-135M-Instruct"


def test_logits_and_greedy_answer(smollm, hf_gguf_model):
    """Our runner's greedy answer is the one DESIGN.md records for HF transformers."""
    resolved = smollm
    tok = load_tokenizer(resolved)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    prompt = list(prompt["input_ids"]) if isinstance(prompt, dict) else list(prompt)
    worker = make_worker(resolved.path, num_blocks=24, block_size=16)
    info = worker.get_model_info()
    assert info["num_layers"] == 30 and info["num_kv_heads"] == 3 and info["vocab_size"] == 49152
    eos = set(info["eos_token_ids"])
    alloc = BlockAllocator(24, 16)
    out: list[int] = []
    reqs = [request(alloc, "q", prompt, 0)]
    for step in range(16):
        res = worker.execute_model(plan(step, reqs))
        t = res.sampled["q"].token_id
        if t in eos:
            break
        out.append(t)
        reqs = [request(alloc, "q", [t], len(prompt) + len(out) - 1)]
    assert tok.decode(out).strip() == "The capital of France is Paris."
    with torch.no_grad():
        ref = hf_gguf_model(torch.tensor([prompt + out])).logits[0]
    # The whole conversation again as one fresh prefill on other blocks: every row's logits.
    got = all_logits(worker, plan(99, [request(alloc, "z", prompt + out, 0)]))
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
