"""Convert a GGUF file into a normal HF directory (config, safetensors, tokenizer), cached.

Dequantising a GGUF takes tens of seconds, so the converted copy is kept under
``$PAGEDSERVE_CACHE_DIR`` (default ``~/.cache/pagedserve``), keyed by the
file's path, size and mtime, the cache format and the transformers release.
It is written into a temporary directory and renamed into place, and
concurrent converters serialise on a lock file, so several processes starting
at once are safe and only one does the work.
``gguf_cache`` lists the entries and removes the stale ones.

llama.cpp's converter permutes the Q and K projections of ``llama``
architecture files (to its interleaved RoPE layout); we undo it with exactly
the reshape transformers' GGUF loader uses, so the weights equal what
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` produces.

Llama 3.1+ files carry their RoPE scaling only as a ``rope_freqs`` tensor
(llama.cpp divides each dimension's frequency by it); transformers drops it,
which silently turns the model's llama3 scaling off. We keep it as the
``freq_factors`` rope type in the converted config. Likewise the
``<arch>.rope.scaling.*`` keys (linear, or YaRN as in Qwen2.5's long-context
GGUFs), which transformers' mapping also drops. Mixture-of-experts files
(Mixtral, Qwen2/3-MoE) have their stacked experts split and their expert
config keys kept by ``loaders.gguf_moe``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.worker.loaders.gguf_moe import (
    MOE_ARCHS,
    expert_count,
    moe_config_fields,
    moe_tensors,
)

# 2: llama.cpp's rope_freqs kept as rope "freq_factors"; 3: rope.scaling.* keys read
CACHE_FORMAT_VERSION = 3
SOURCE_FILE = "pagedserve_source.json"

_ROPE_FREQS = "rope_freqs.weight"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp adds that have no HF counterpart (transformers skips them too).
_SKIPPED = (_ROPE_FREQS,)


def cache_root() -> Path:
    """Where converted checkpoints live: ``$PAGEDSERVE_CACHE_DIR`` or ``~/.cache/pagedserve``."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagedserve"


def transformers_version() -> str:
    """The installed transformers release (read from its metadata, not imported)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_dir_for(gguf_path: str | Path) -> Path:
    """Cache directory for this exact file version (path, size, mtime, format version)
    and transformers release: the config and tokenizer files in it are transformers',
    written by one release, and another one need not read them the same way."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    key = (f"{p}|{st.st_size}|{st.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
           f"|transformers={transformers_version()}")
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{p.stem}-{digest}"


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (transformers' ``_reverse_permute_weights``)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor; None for tensors we deliberately skip."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama-family counterpart")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _reader(gguf: str | Path | Any) -> Any:
    """A ``GGUFReader`` of ``gguf`` (a path), or ``gguf`` itself if it is one already.

    Opening one parses every metadata field in Python, the vocabulary's strings one by
    one: about 5 s for a 49k-token file here, so a conversion opens it once."""
    from gguf.gguf_reader import GGUFReader  # the class itself, even during _lent_reader

    return gguf if isinstance(gguf, GGUFReader) else GGUFReader(str(gguf))


def read_gguf_tensors(gguf: str | Path | Any, num_heads: int, num_kv_heads: int
                      ) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to fp32 under its HF name, Q/K un-permuted for ``llama`` files
    (``gguf``: a path or an open ``GGUFReader``)."""
    from gguf import dequantize

    reader = _reader(gguf)
    arch = str(reader.fields["general.architecture"].contents())
    moe = expert_count(reader.fields, arch) > 0
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        m = _BLOCK_RE.match(t.name)
        if moe and m is not None and arch in MOE_ARCHS:
            experts = moe_tensors(arch, m.group(1), m.group(2), m.group(3),
                                  dequantize(t.data, t.tensor_type))
            if experts is not None:
                for name, w in experts.items():
                    out[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
                continue
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = reverse_permute(w, num_heads if ".attn_q." in t.name else num_kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return out


@dataclass(frozen=True)
class GGUFExtras:
    """What transformers' GGUF config mapping drops.

    ``head_dim``: ``<arch>.attention.key_length``; without it a model whose
    heads are not ``hidden / num_heads`` wide (Qwen3-0.6B: 1024 / 16 with
    128-wide heads, Mistral Nemo) would come back with the wrong one.
    ``rope_factors``: the ``rope_freqs`` tensor, one divisor per rotary
    frequency (Llama 3.1's llama3 scaling, as llama.cpp's converter computes it).
    ``rope_scaling``: ``<arch>.rope.scaling.*`` as an HF rope dict (linear, or
    YaRN as llama.cpp's converter writes Qwen2.5's long-context recipe).
    """

    head_dim: int | None = None
    rope_factors: list[float] | None = None
    rope_scaling: dict[str, Any] | None = None


def _rope_scaling(fields: Any, arch: str) -> dict[str, Any] | None:
    """``<arch>.rope.scaling.*`` as HF's rope parameters; a setting we would get wrong
    is a ``ValueError`` naming the GGUF key rather than a silently different model."""
    def get(key: str) -> Any:
        f = fields.get(f"{arch}.rope.{key}")
        return None if f is None else f.contents()

    kind, factor = get("scaling.type"), get("scaling.factor")
    if kind is None:  # older files: only a linear scale
        scale = get("scale_linear")
        return None if scale in (None, 1.0) else {"rope_type": "linear", "factor": float(scale)}
    kind = str(kind)
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if factor is None:
        raise ValueError(f"GGUF key {arch}.rope.scaling.factor is missing for {kind} scaling")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        raise ValueError(f"GGUF key {arch}.rope.scaling.type: {kind!r} scaling is not "
                         "supported (linear and yarn are)")
    for key, neutral in (("scaling.yarn_log_multiplier", (0.0,)),
                         ("scaling.yarn_ext_factor", (1.0, -1.0)),
                         ("scaling.yarn_attn_factor", (1.0,))):
        v = get(key)
        if v is not None and float(v) not in neutral:
            raise ValueError(f"GGUF key {arch}.rope.{key} = {v} is not supported")
    rope: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    orig = get("scaling.original_context_length")
    if orig:
        rope["original_max_position_embeddings"] = int(orig)
    for key, hf in (("scaling.yarn_beta_fast", "beta_fast"),
                    ("scaling.yarn_beta_slow", "beta_slow"),
                    ("scaling.attn_factor", "attention_factor")):
        v = get(key)
        if v is not None:
            rope[hf] = float(v)
    return rope


def gguf_extras(gguf: str | Path | Any) -> GGUFExtras:
    """The head size and RoPE settings transformers' GGUF loading drops (see ``GGUFExtras``;
    ``gguf``: a path or an open ``GGUFReader``)."""
    from gguf import dequantize

    reader = _reader(gguf)
    arch = str(reader.fields["general.architecture"].contents())
    field = reader.fields.get(f"{arch}.attention.key_length")
    head_dim = None if field is None else int(field.contents())
    factors = None
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            factors = [float(f) for f in np.asarray(dequantize(t.data, t.tensor_type)).ravel()]
    return GGUFExtras(head_dim, factors, _rope_scaling(reader.fields, arch))


_LENDING = threading.Lock()


@contextlib.contextmanager
def _lent_reader(path: Path, reader: Any) -> Iterator[None]:
    """Hand ``reader`` to transformers' GGUF loading for ``path`` while this block runs.

    ``AutoConfig`` and ``AutoTokenizer`` each open the file again (``from gguf import
    GGUFReader`` inside ``load_gguf_checkpoint``), another ~5 s apiece for a 49k-token
    vocabulary. The reader is a read-only memory map, so sharing the parsed one is safe;
    any other path still gets a fresh reader. One lender at a time: two conversions in
    one process's threads must not restore each other's stand-in."""
    import gguf

    with _LENDING:
        fresh = gguf.GGUFReader

        def open_reader(p: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs and Path(p).resolve() == path:
                return reader
            return fresh(p, *args, **kwargs)

        gguf.GGUFReader = open_reader
        try:
            yield
        finally:
            gguf.GGUFReader = fresh


def _convert_into(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    folder, fname = str(gguf_path.parent), gguf_path.name
    reader = _reader(gguf_path)
    with _lent_reader(gguf_path, reader):
        config = AutoConfig.from_pretrained(folder, gguf_file=fname, local_files_only=True)
    extras = gguf_extras(reader)
    if extras.head_dim is not None:
        config.head_dim = extras.head_dim
    tensors = read_gguf_tensors(reader, config.num_attention_heads,
                                config.num_key_value_heads)
    # llama.cpp omits ``output.weight`` exactly when the head is tied to the embedding;
    # the config transformers derives may say otherwise (Qwen3's default is untied).
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    _write_moe_fields(reader.fields, out / "config.json")
    rope = None
    if extras.rope_factors is not None:
        rope = {"rope_type": "freq_factors", "freq_factors": extras.rope_factors}
    elif extras.rope_scaling is not None:
        rope = dict(extras.rope_scaling)
    if rope is not None:
        # Written into the saved JSON: transformers' own rope validation has no
        # ``freq_factors`` type, and its GGUF mapping kept no scaling at all.
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
        cfg.pop("rope_scaling", None)
        if theta is not None:
            rope["rope_theta"] = theta
        cfg["rope_parameters"] = rope
        cfg_path.write_text(json.dumps(cfg, indent=2))
    with _lent_reader(gguf_path, reader):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname,
                                                  local_files_only=True)
    tokenizer.save_pretrained(str(out))
    st = gguf_path.stat()
    (out / SOURCE_FILE).write_text(json.dumps({
        "gguf": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "format_version": CACHE_FORMAT_VERSION, "transformers": transformers_version(),
    }))


def _write_moe_fields(fields: Any, cfg_path: Path) -> None:
    """Give a mixture-of-experts file's config the expert fields (``loaders.gguf_moe``)."""
    arch = str(fields["general.architecture"].contents())
    if expert_count(fields, arch):
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps(moe_config_fields(fields, arch, cfg), indent=2))


def convert_gguf_cached(gguf_path: str | Path) -> Path:
    """Return an HF directory equivalent to ``gguf_path``, converting it once per file version.

    A conversion also removes the entries of the file's earlier versions
    (``gguf_cache.drop_superseded``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src = Path(gguf_path).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    final = cache_dir_for(src)
    if (final / SOURCE_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent converter finishes first, then we reuse
        if (final / SOURCE_FILE).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            _convert_into(src, tmp)
            tmp.chmod(0o755)  # mkdtemp creates 0700; the cache is shared like any HF dir
            if final.exists():  # a stale, incomplete copy (no source file): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    from pagedserve.worker.loaders.gguf_cache import drop_superseded

    drop_superseded(src)
    return final
