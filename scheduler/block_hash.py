"""Chained cryptographic hashes of full KV blocks, the key of the prefix cache.

``H(parent, tokens, extra_keys)`` with blake2b over a canonical byte encoding:
Python's ``hash`` is salted per process, so it could neither be shared between
the router and the engine replicas nor be trusted against collisions.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from functools import lru_cache

from pagedserve.scheduler.multimodal import ImageInput, block_image_keys

BlockHash = bytes

_ROOT = b"pagedserve-root-v1"


def make_extra_keys(model_id: str, cache_salt: str | None = None,
                    lora_key: str | None = None) -> tuple[str, ...]:
    """Keys mixed into every block hash: the model, an optional tenant salt and LoRA.

    A ``cache_salt`` isolates tenants: the same prompt under two salts never
    shares a block, so one tenant cannot probe another's prompts by timing.
    A LoRA adapter changes every layer's K/V, so its blocks are its own.
    """
    keys = (model_id,) if cache_salt is None else (model_id, f"salt:{cache_salt}")
    return keys if lora_key is None else (*keys, lora_key)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash one full block given its parent's hash, its tokens and the extra keys."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(_encode_extra_keys(tuple(extra_keys)))
    return h.digest()


@lru_cache(maxsize=1024)
def _encode_extra_keys(extra_keys: tuple[str, ...]) -> bytes:
    return json.dumps(list(extra_keys), separators=(",", ":")).encode()


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    start: int = 0,
    parent: BlockHash | None = None,
    images: Sequence[ImageInput] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start``.

    The partial last block is never hashed: its content is not final yet.
    The router calls this too, so affinity keys equal the replicas' cache keys.
    A block that overlaps one of ``images`` also hashes that image's key: its
    placeholder tokens are the same whatever the picture.
    """
    out: list[BlockHash] = []
    keys = tuple(extra_keys)
    for b in range(start, len(token_ids) // block_size):
        own = keys + block_image_keys(images, block_size, b) if images else keys
        parent = hash_block_tokens(parent, token_ids[b * block_size : (b + 1) * block_size], own)
        out.append(parent)
    return out
