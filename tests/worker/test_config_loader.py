"""ModelConfig / WorkerConfig validation, resolve_model inputs, loader failure modes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedserve.worker.config import ModelConfig
from pagedserve.worker.kv_budget import profile_plan
from pagedserve.worker.layers.rotary import attention_factor, compute_inv_freq
from pagedserve.worker.loaders import resolve_model
from pagedserve.worker.loaders.gguf import reverse_permute
from pagedserve.worker.parallel import ParallelContext, get_node_ip_and_free_port
from pagedserve.worker.worker_config import WorkerConfig
from tests.worker.helpers import TINY, make_worker, save_tiny_model

BASE = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=100)


def test_model_config_reads_both_rope_layouts():
    v5 = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    v4 = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    assert v5 == v4
    assert v5.rope_theta == 5e5 and v5.rope_scaling["rope_type"] == "llama3"
    assert v5.head_dim == 16 and v5.max_model_len == 2048
    q = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "eos_token_id": [5, 6]})
    assert q.qkv_bias and not q.o_bias and q.eos_token_ids == (5, 6)
    m = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 512})
    # A sliding window no longer caps the length: every layer attends through it.
    assert m.max_model_len == 2048 and m.sliding_layers == (0, 1)
    assert m.layer_window(1) == 512


@pytest.mark.parametrize(("model_type", "extra"), [
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=8, max_window_layers=0)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=9)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, max_window_layers=3)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8)),
    ("mistral", dict(sliding_window=8)),
    ("mistral", dict(sliding_window=None)),
    ("mixtral", dict(sliding_window=8)),
])
def test_sliding_layers_match_transformers(model_type: str, extra: dict) -> None:
    """Which layers slide, from a config.json without ``layer_types`` (older files), is
    what transformers' own config and model classes decide for the same fields."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{**BASE, "num_hidden_layers": 5, "model_type": model_type,
                                 **extra})
    cfg = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
    ours = ModelConfig.from_hf_dict(cfg)
    types = getattr(hf, "layer_types", None)
    if types is None:  # Mistral, Mixtral, Qwen3-MoE: one mask for every layer
        window = hf.sliding_window or None
        types = ["sliding_attention" if window else "full_attention"] * 5
    want = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert ours.sliding_layers == want
    assert ours.sliding_window == (hf.sliding_window if want else None)
    # A file that spells the list out reads the same.
    explicit = ModelConfig.from_hf_dict({**cfg, "layer_types": list(types)})
    assert explicit.sliding_layers == want


@pytest.mark.parametrize(("extra", "field"), [
    (dict(sliding_window=-4), "sliding_window"),
    (dict(sliding_window="4096"), "sliding_window"),
    (dict(sliding_window=8, layer_types=["sliding_attention"]), "layer_types"),
    (dict(sliding_window=None, layer_types=["sliding_attention"] * 2), "sliding_window"),
])
def test_bad_sliding_window_fields_are_named(extra: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", **extra})


def test_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items()}, rope_theta=5e5, rope_scaling=scaling)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = compute_inv_freq(16, 5e5, ModelConfig.from_hf_dict(cfg.to_dict()).rope_scaling)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("extra", [
    dict(factor=4.0, original_max_position_embeddings=32),
    dict(factor=4.0),  # the original length defaults to max_position_embeddings
    dict(factor=40.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2,
         mscale=1.0, mscale_all_dim=0.5),
    dict(factor=2.0, original_max_position_embeddings=64, attention_factor=1.5,
         truncate=False),
    dict(factor=None, original_max_position_embeddings=32),  # DeepSeek style: 256 / 32
])
def test_yarn_matches_transformers(extra):
    """Inverse frequencies and the cos/sin scale equal transformers' YaRN for Qwen2 configs."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_extra = {"original_max_position_embeddings": TINY["max_position_embeddings"], **extra}
    cfg = Qwen2Config(**TINY, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, **hf_extra))
    ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours_cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "rope_theta": 1e4,
                                         "max_position_embeddings": 256,
                                         "rope_scaling": {"type": "yarn", **extra}})
    torch.testing.assert_close(compute_inv_freq(16, 1e4, ours_cfg.rope_scaling), ref,
                               atol=0, rtol=1e-6)
    assert attention_factor(ours_cfg.rope_scaling) == pytest.approx(ref_scale, rel=1e-12)


def test_yarn_and_qwen3_config_fields():
    qwen25 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2",
                                       "max_position_embeddings": 32768, "rope_scaling": {
                                           "type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32768}})
    assert qwen25.max_model_len == 131072  # Qwen2.5's long-context recipe, as vLLM reads it
    bare = ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert bare.rope_scaling["original_max_position_embeddings"] == 2048  # the HF default
    assert bare.max_model_len == 8192
    q3 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3", "head_dim": 32,
                                   "sliding_window": 4096, "use_sliding_window": False})
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32 and q3.sliding_window is None
    assert not ModelConfig.from_hf_dict(BASE).qk_norm


@pytest.mark.parametrize("patch,field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, "factor"),
    ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [1.0] * 3}}, "freq_factors"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
])
def test_model_config_errors_name_the_field(patch, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**BASE, **patch})


@pytest.mark.parametrize("kw,field", [
    (dict(block_size=0), "block_size"), (dict(tensor_parallel_size=2, rank=2), "rank"),
    (dict(dtype="int8"), "dtype"), (dict(num_gpu_blocks=0), "num_gpu_blocks"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_worker_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**kw)


def test_resolve_model_inputs(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama")
    r = resolve_model(str(path))
    assert r.path == str(path.resolve()) and r.model_id == "m" and r.gguf_file is None
    with pytest.raises(FileNotFoundError, match="downloaded"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path / "empty"))


def test_resolve_model_reads_a_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    """``org/name`` resolves to its snapshot in the Hugging Face cache (the ``main`` ref),
    never downloading: an id not cached is the same clear error as before, and the
    OpenAI model name is the id."""
    import huggingface_hub.constants as hub

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = save_tiny_model(repo / "snapshots" / "0123abcd", "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = resolve_model("acme/tiny-llama")
    assert r.path == str(snapshot) and r.model_id == "acme/tiny-llama"
    assert make_worker(r.path, num_blocks=8).model is not None
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        resolve_model("acme/not-cached")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_model("a/b/c")


def test_missing_and_misshapen_weights_fail_loudly(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "m", "llama")
    # Collapse the shards into one file without one weight, and drop the index.
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(f))
        f.unlink()
    (path / "model.safetensors.index.json").unlink()
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights.*down_proj"):
        make_worker(path)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        make_worker(path)


def test_reverse_permute_inverts_llama_cpp_permute():
    """llama.cpp's converter permutes rows as below; we must undo it exactly."""
    def permute(w, n_head):  # convert_hf_to_gguf.LlamaModel.permute
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = torch.randn(48, 8).numpy()
    for heads in (1, 3, 6):
        assert (reverse_permute(permute(w, heads), heads) == w).all()


def test_world_size_one_never_touches_torch_distributed(tmp_path):
    import torch.distributed as dist

    ctx = ParallelContext()
    x = torch.ones(3)
    assert ctx.all_reduce(x) is x and ctx.gather_last_dim(x) is x
    make_worker(save_tiny_model(tmp_path / "m", "llama"))
    assert not dist.is_initialized()
    ip, port = get_node_ip_and_free_port()
    assert ip and 0 < port < 65536


def test_model_info_and_kv_budget(tmp_path):
    path = save_tiny_model(tmp_path / "m", "qwen2", eos_token_id=[2, 3])
    w = make_worker(path, num_blocks=10, block_size=8)
    info = w.get_model_info()
    assert info["eos_token_ids"] == [2, 3] and info["max_model_len"] == TINY[
        "max_position_embeddings"]
    assert info["bytes_per_block"] == 2 * 2 * 8 * 2 * 16 * 4
    assert info["num_kv_heads_per_rank"] == 2 and info["vocab_size"] == 101
    w.config.num_gpu_blocks = None
    w.config.kv_cache_memory_bytes = 10 * info["bytes_per_block"] + 5
    assert w.determine_num_blocks() == 10
    assert w.check_health()["ok"]
    assert json.loads(json.dumps(info)) == info  # plain types only: crosses Ray
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert ModelConfig.from_pretrained(path).eos_token_ids == (2, 3, 7)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


@pytest.mark.parametrize(("tokens", "seqs", "block_size"), [(100, 8, 16), (5, 8, 4), (64, 1, 16)])
def test_profile_plan_spreads_the_step_over_max_num_seqs(tokens, seqs, block_size):
    plan, blocks = profile_plan(tokens, seqs, block_size)
    lens = [r.num_tokens for r in plan.scheduled]
    assert sum(lens) == tokens and len(lens) == min(seqs, tokens)
    assert max(lens) - min(lens) <= 1
    tables = [b for r in plan.scheduled for b in r.block_table]
    assert sorted(tables) == list(range(blocks))  # each block used once, none missing
    for r in plan.scheduled:
        assert len(r.block_table) == -(-r.num_tokens // block_size)
        assert r.sample_ids == [r.request_id] and r.num_computed_tokens == 0


def test_profile_forward_runs_the_largest_step_and_drops_its_cache(tmp_path):
    """The step the CUDA budget measures runs here too; afterwards no cache is held."""
    w = make_worker(save_tiny_model(tmp_path / "m", "llama"), num_blocks=4, block_size=8,
                    max_num_batched_tokens=300, max_num_seqs=7)
    w.profile_forward()
    assert w.kv_cache is None and w.runner is None
    w.init_kv_cache(4, 0)
    assert w.check_health()["ok"]


def test_concurrent_conversions_do_the_work_once(tmp_path, monkeypatch):
    """Racing converters serialise on the lock; the loser reuses the winner's copy."""
    import threading
    import time

    from pagedserve.worker.loaders import gguf as gguf_mod

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "fake.gguf"
    src.write_bytes(b"GGUF")
    calls = []

    def fake_convert(path, out):
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        (out / gguf_mod.SOURCE_FILE).write_text("{}")

    monkeypatch.setattr(gguf_mod, "_convert_into", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_mod.convert_gguf_cached(src)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    final = results[0]
    assert (final / "config.json").is_file()
    assert [p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")] == [final.name]
    # Another transformers release gets a cache entry of its own (the config and
    # tokenizer files are transformers'), and so does a new file version (mtime changes).
    with monkeypatch.context() as m:
        m.setattr(gguf_mod, "transformers_version", lambda: "0.0.1")
        assert gguf_mod.cache_dir_for(src) != final
    assert gguf_mod.cache_dir_for(src) == final
    os.utime(src, ns=(1, 1))
    assert gguf_mod.cache_dir_for(src) != final


def test_failed_conversion_leaves_no_partial_cache(tmp_path, monkeypatch):
    from pagedserve.worker.loaders import gguf as gguf_mod

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "broken.gguf"
    src.write_bytes(b"not a gguf")
    with pytest.raises(Exception):  # noqa: B017 - whatever the gguf reader raises
        gguf_mod.convert_gguf_cached(src)
    leftovers = [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []



def test_a_plain_tokenizer_loads_without_auto_tokenizer_and_equals_its(tmp_path):
    """A ``tokenizer_config.json`` naming the plain backend over a ``tokenizer.json`` is
    loaded as that class directly (AutoTokenizer's import and lookup cost each replica
    process ~1.4 s more, ``bench/cold_start.py``): the same class, vocabulary, special tokens, ids and chat prompt as
    AutoTokenizer's. Any other class, or no ``tokenizer.json``, still goes through it."""
    import shutil
    from pathlib import Path

    from transformers import AutoTokenizer

    from pagedserve.worker import loaders

    src = Path(resolve_model(None).path)
    assert loaders._plain_tokenizer(src)
    ours = loaders.load_tokenizer(resolve_model(None))
    ref = AutoTokenizer.from_pretrained(src, local_files_only=True)
    assert type(ours) is type(ref) and ours.get_vocab() == ref.get_vocab()
    assert ours.all_special_tokens == ref.all_special_tokens
    for text in ("Hello world", " héllo wörld 😀\n\n  x", "<|im_start|>user\nhi<|im_end|>"):
        assert ours(text).input_ids == ref(text).input_ids
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    other = tmp_path / "other"
    other.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, other / f)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    assert not loaders._plain_tokenizer(other)
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert loaders._plain_tokenizer(other)
    (other / "tokenizer.json").unlink()
    assert not loaders._plain_tokenizer(other)
    assert not loaders._plain_tokenizer(tmp_path / "missing")
