"""Varlen batch metadata shared by every attention backend.

flash-attn's varlen API describes a ragged batch with cumulative offsets
(``cu_seq_lens_q/k``) and maxima; the other backends take the same object so
the model runner builds it once per step, on the host, and hands it to any
backend. The host-side length lists are kept too: the torch backend needs them
to plan padded groups, and reading them back from a device tensor would force
a synchronisation on every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class VarlenMetadata:
    """Ragged batch description: S sequences with query and key lengths.

    ``cu_seq_lens_q[s]:cu_seq_lens_q[s+1]`` are sequence ``s``'s rows of the
    packed query tensor; its keys are positions ``[0, seq_lens_k[s])`` of its
    block table. ``query_lens`` / ``key_lens`` are optional host copies (built
    by :func:`build_varlen_metadata`); when absent they are read from the
    tensors.
    """

    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int
    query_lens: tuple[int, ...] | None = field(default=None, compare=False)
    key_lens: tuple[int, ...] | None = field(default=None, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_k.shape[0])

    def host_query_lens(self) -> list[int]:
        """Query lengths as Python ints (no device sync when built here)."""
        if self.query_lens is not None:
            return list(self.query_lens)
        return torch.diff(self.cu_seq_lens_q.cpu()).tolist()

    def host_key_lens(self) -> list[int]:
        """Key lengths as Python ints (no device sync when built here)."""
        if self.key_lens is not None:
            return list(self.key_lens)
        return self.seq_lens_k.cpu().tolist()

    def to(self, device: torch.device | str) -> VarlenMetadata:
        """Same metadata with its tensors on ``device``."""
        return VarlenMetadata(
            self.cu_seq_lens_q.to(device),
            self.cu_seq_lens_k.to(device),
            self.seq_lens_k.to(device),
            self.max_length_q,
            self.max_length_k,
            self.query_lens,
            self.key_lens,
        )


def build_varlen_metadata(
    query_lens: list[int], key_lens: list[int], device: torch.device | str | None = None
) -> VarlenMetadata:
    """Build the cumulative offsets flash-attn's varlen API expects.

    ``key_lens[s]`` counts every key sequence ``s`` attends to, cached context
    plus this step's new tokens (which are stored in the cache before the
    attention call). Example: query lengths [10, 3, 1] and key lengths
    [0, 1, 7] give ``cu_seq_lens_q=[0, 10, 13, 14]``, ``cu_seq_lens_k=[0, 0, 1, 8]``,
    ``max_length_q=10``, ``max_length_k=7``.
    """
    if len(query_lens) != len(key_lens):
        raise ValueError(
            f"query_lens has {len(query_lens)} sequences but key_lens has {len(key_lens)}"
        )
    q_lens = [int(x) for x in query_lens]
    k_lens = [int(x) for x in key_lens]
    if any(x < 0 for x in q_lens) or any(x < 0 for x in k_lens):
        raise ValueError("sequence lengths must be >= 0")
    cu_q = [0]
    cu_k = [0]
    for lq, lk in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    dev = torch.device("cpu") if device is None else torch.device(device)
    return VarlenMetadata(
        cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
        cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32, device=dev),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32, device=dev),
        max_length_q=max(q_lens, default=0),
        max_length_k=max(k_lens, default=0),
        query_lens=tuple(q_lens),
        key_lens=tuple(k_lens),
    )
