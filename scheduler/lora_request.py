"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest``).

Torch-free and picklable: it travels from the API to the engine, and the
scheduler keys admission (at most ``max_loras`` adapters per step) and the
prefix cache (an adapter changes every layer's K/V) on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` (what the OpenAI ``model`` field names), a positive ``lora_int_id``
    unique per adapter within an engine, and ``lora_path``, a local PEFT directory
    (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        return lora_cache_key(self.lora_name, self.lora_path)


def lora_cache_key(name: str, path: str) -> str:
    """The prefix-cache extra key of an adapter: blocks computed under one adapter are
    never reused by another (or by the base model). The ingress's router computes it
    from the name and path alone, before a replica has given the adapter an id."""
    return f"lora:{name}:{path}"
