"""GGUF files written here the way llama.cpp's converter writes them convert back to
models whose logits equal the Hugging Face models they were written from.

What transformers' GGUF loading gets wrong or drops, and these check: Qwen3's per-head
norms (``attn_q_norm`` / ``attn_k_norm``) and its head size, recorded only as
``qwen3.attention.key_length``; a tied head; Llama 3.1's RoPE scaling, which a
``llama`` file carries only as the ``rope_freqs`` tensor (with Q/K permuted to
llama.cpp's interleaved layout); linear or YaRN scaling in ``rope.scaling.*``; and a
mixture of experts' stacked expert tensors and expert widths (Mixtral as a ``llama``
file with ``expert_count``, Qwen2-MoE with its shared expert, Qwen3-MoE). The tokenizer
fields are copied from the default model's GGUF, so the converted directories also get
a working tokenizer.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.worker.loaders import default_gguf_path, load_tokenizer, resolve_model
from pagedserve.worker.loaders.gguf_cache import gguf_entries
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


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for ``llama`` files (the loader undoes it)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter computes for llama3 rope scaling."""
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _moe_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's tensors for one of transformers' in-memory MoE parameters: the experts
    stacked per matrix kind, the shared expert's gate as a vector."""
    layer = name.split(".")[2]
    data = tensor.float().numpy().astype(np.float32)
    if name.endswith("mlp.experts.gate_up_proj"):
        i = data.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :i])),
                (f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, i:]))]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", data)]
    if name.endswith("mlp.shared_expert_gate.weight"):
        return [(f"blk.{layer}.ffn_gate_inp_shexp.weight", data.reshape(-1))]
    if ".shared_expert." in name:
        kind = name.split(".")[-2].removesuffix("_proj")
        return [(f"blk.{layer}.ffn_{kind}_shexp.weight", data)]
    assert name.endswith("mlp.gate.weight"), name
    return [(f"blk.{layer}.ffn_gate_inp.weight", data)]


@functools.cache
def _smollm2_tokenizer() -> dict[str, object]:
    """The default file's tokenizer fields, read once (each read parses 49k strings)."""
    from gguf import GGUFReader

    src = GGUFReader(str(default_gguf_path())).fields
    names = ("model", "pre", "tokens", "token_type", "merges")
    out = {n: src[f"tokenizer.ggml.{n}"].contents() for n in names}
    out["chat_template"] = src["tokenizer.chat_template"].contents()
    return out


def _write_gguf(model, dest: Path, arch: str) -> Path:
    """What llama.cpp's converter writes (F32 tensors): a tied head has no ``output.weight``;
    ``llama`` files have Q/K permuted and, with llama3 scaling, a ``rope_freqs`` tensor."""
    from gguf import GGUFWriter, RopeScalingType

    cfg = model.config
    path = dest / f"tiny-{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tok = _smollm2_tokenizer()
    w.add_tokenizer_model(str(tok["model"]))
    w.add_tokenizer_pre(str(tok["pre"]))
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["token_type"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(str(tok["chat_template"]))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # as llama.cpp's converter writes a mixture of experts
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if ".mlp.gate." in name or ".mlp.experts." in name or ".mlp.shared_expert" in name:
            for gguf_name, data in _moe_tensors(name, tensor):
                w.add_tensor(gguf_name, data)
            continue
        if name == "lm_head.weight":
            if not tied:
                w.add_tensor("output.weight", tensor.float().numpy().astype(np.float32))
            continue
        data = tensor.float().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, cfg.num_key_value_heads)
        w.add_tensor(_gguf_name(name), data)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    elif rope.get("rope_type") in ("linear", "yarn"):  # as convert_hf_to_gguf.py writes them
        w.add_rope_scaling_type(RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
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
    gguf_path = _write_gguf(model, tmp_path, "qwen3")

    import gguf

    opened: list[str] = []
    real = gguf.GGUFReader.__init__

    def counting(self, path, *args, **kwargs) -> None:
        opened.append(str(path))
        real(self, path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFReader, "__init__", counting)
        resolved = resolve_model(str(gguf_path))
    # Parsing the fields costs seconds for a 49k vocabulary: the conversion does it once.
    assert opened == [str(gguf_path)], opened
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


def test_llama3_rope_scaling_survives_a_llama_gguf(tmp_path, pagedserve_cache):
    """Llama 3.1-style scaling over a 16-token original context, so most rotary
    frequencies are divided: dropping ``rope_freqs`` (as transformers does) fails this."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(8)
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=16)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_parameters=rope,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    gguf_path = _write_gguf(model, tmp_path, "llama")
    resolved = resolve_model(str(gguf_path))
    # The real conversion's source record is what ``pagedserve cache`` reads: this
    # entry is the current one (tests/cluster/test_cache_cmd.py covers the stale kinds).
    entry, = (e for e in gguf_entries() if e.path == Path(resolved.path))
    assert not entry.stale and entry.source == str(gguf_path.resolve()), entry
    worker = make_worker(resolved.path, num_blocks=24, block_size=4)
    assert worker.model_config.rope_scaling["rope_type"] == "freq_factors"
    prompt = list(range(300, 340))
    got = all_logits(worker, plan(0, [request(BlockAllocator(24, 4), "a", prompt, 0)]))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch,rope", [
    ("qwen2", dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                   original_max_position_embeddings=16)),
    ("llama", dict(rope_type="linear", rope_theta=10000.0, factor=3.0)),
])
def test_rope_scaling_keys_survive_a_gguf(tmp_path, pagedserve_cache, arch, rope):
    """YaRN over a 16-token original context (Qwen2.5's recipe, as llama.cpp writes it)
    and linear scaling: transformers' GGUF config drops both, and so did we."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(9)
    cfg = AutoConfig.for_model(arch, vocab_size=49152, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64,
                               rms_norm_eps=1e-6, rope_parameters=rope,
                               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    resolved = resolve_model(str(_write_gguf(model, tmp_path, arch)))
    worker = make_worker(resolved.path, num_blocks=24, block_size=4)
    assert worker.model_config.rope_scaling["rope_type"] == rope["rope_type"]
    prompt = list(range(300, 350))  # well past the 16-token original context
    got = all_logits(worker, plan(0, [request(BlockAllocator(24, 4), "a", prompt, 0)]))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fields,match", [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, "scaling.type"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
      "rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier"),
    ({"rope.scaling.type": "yarn"}, "scaling.factor"),
])
def test_rope_scaling_we_cannot_run_is_refused_naming_the_key(fields, match) -> None:
    from pagedserve.worker.loaders.gguf import _rope_scaling

    class Field:
        def __init__(self, v) -> None:
            self.v = v

        def contents(self):
            return self.v

    with pytest.raises(ValueError, match=match):
        _rope_scaling({f"qwen2.{k}": Field(v) for k, v in fields.items()}, "qwen2")
    assert _rope_scaling({"qwen2.rope.scaling.type": Field("none")}, "qwen2") is None
    assert _rope_scaling({"qwen2.rope.scale_linear": Field(2.0)}, "qwen2") == {
        "rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("kind,arch", [("mixtral", "llama"), ("qwen2_moe", "qwen2moe"),
                                       ("qwen3_moe", "qwen3moe")])
def test_mixture_of_experts_gguf_converts_and_runs(tmp_path, pagedserve_cache, kind, arch):
    """Stacked experts split back per expert, the expert widths and llama.cpp's fixed
    renormalisation in the config: logits equal the HF model the file was written from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.worker.testing import MOE_DEFAULTS

    torch.manual_seed(10)
    moe = dict(MOE_DEFAULTS[kind])
    if kind == "qwen3_moe":
        moe["norm_topk_prob"] = True  # what llama.cpp's qwen3moe graph does
    cfg = AutoConfig.for_model(kind, vocab_size=49152, hidden_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256,
                               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                               eos_token_id=2, **moe)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    resolved = resolve_model(str(_write_gguf(model, tmp_path, arch)))
    worker = make_worker(resolved.path, num_blocks=24, block_size=4)
    mc = worker.model_config
    assert mc.model_type == kind and mc.moe is not None and mc.moe.num_experts == 4
    prompt = list(range(300, 330))
    got = all_logits(worker, plan(0, [request(BlockAllocator(24, 4), "a", prompt, 0)]))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_moe_keys_we_cannot_run_are_refused_naming_the_key() -> None:
    from pagedserve.worker.loaders.gguf_moe import moe_config_fields

    class Field:
        def __init__(self, v) -> None:
            self.v = v

        def contents(self):
            return self.v

    def fields(arch: str, **kv):
        return {f"{arch}.{k}": Field(v) for k, v in kv.items()}

    with pytest.raises(ValueError, match=r"qwen3moe\.expert_feed_forward_length"):
        moe_config_fields(fields("qwen3moe", expert_count=8, expert_used_count=2),
                          "qwen3moe", {})
    with pytest.raises(ValueError, match="expert_shared_feed_forward_length"):
        moe_config_fields(fields("qwen2moe", expert_count=8, expert_used_count=2,
                                 expert_feed_forward_length=32), "qwen2moe", {})
    with pytest.raises(ValueError, match=r"llama\.expert_weights_norm"):
        moe_config_fields(fields("llama", expert_count=8, expert_used_count=2,
                                 expert_weights_norm=False), "llama", {})
    with pytest.raises(ValueError, match="'deepseek2' with 8 experts"):
        moe_config_fields(fields("deepseek2", expert_count=8), "deepseek2", {})
    dense = {"model_type": "llama"}
    assert moe_config_fields(fields("llama"), "llama", dense) is dense
    qwen = moe_config_fields(fields("qwen2moe", expert_count=8, expert_used_count=2,
                                    expert_feed_forward_length=32,
                                    expert_shared_feed_forward_length=64,
                                    expert_weights_norm=True), "qwen2moe", {})
    assert qwen["norm_topk_prob"] is True and qwen["shared_expert_intermediate_size"] == 64
