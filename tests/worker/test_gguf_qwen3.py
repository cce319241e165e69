"""A Qwen3 GGUF written here (tied head, heads wider than hidden / num_heads) converts to
the weights it was written from, and the worker's logits equal the source model's.

llama.cpp names Qwen3's per-head norms ``attn_q_norm`` / ``attn_k_norm`` and records the
head size only as ``qwen3.attention.key_length``, which transformers' GGUF config mapping
drops; both are what this file checks. The tokenizer fields are copied from the default
model's GGUF, so the converted directory also gets a working tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.worker.loaders import default_gguf_path, load_tokenizer, resolve_model
from tests.worker.helpers import BlockAllocator, all_logits, make_worker, plan, request

pytestmark = pytest.mark.slow

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def _write_qwen3_gguf(model, dest: Path) -> Path:
    """What llama.cpp's converter writes for a tied Qwen3 (F32 tensors, no Q/K permutation)."""
    from gguf import GGUFReader, GGUFWriter

    cfg = model.config
    path = dest / "tiny-qwen3.gguf"
    w = GGUFWriter(str(path), "qwen3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    src = GGUFReader(str(default_gguf_path())).fields
    w.add_tokenizer_model(str(src["tokenizer.ggml.model"].contents()))
    w.add_tokenizer_pre(str(src["tokenizer.ggml.pre"].contents()))
    w.add_token_list(src["tokenizer.ggml.tokens"].contents())
    w.add_token_types(src["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(src["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(str(src["tokenizer.chat_template"].contents()))
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":  # tied: llama.cpp leaves ``output.weight`` out
            w.add_tensor(_gguf_name(name), tensor.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen3_gguf_converts_and_runs(tmp_path, pagedserve_cache):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a misplaced norm shows
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    gguf_path = _write_qwen3_gguf(model, tmp_path)

    resolved = resolve_model(str(gguf_path))
    tok = load_tokenizer(resolved)
    prompt = tok.encode("the capital of France is")
    assert tok.decode(prompt) == "the capital of France is"
    worker = make_worker(resolved.path, num_blocks=16, block_size=4)
    info = worker.get_model_info()
    assert info["num_layers"] == 2 and info["num_kv_heads"] == 2
    assert worker.model_config.head_dim == 32 and worker.model_config.tie_word_embeddings
    got = all_logits(worker, plan(0, [request(BlockAllocator(16, 4), "a", prompt, 0)]))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
