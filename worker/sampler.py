"""Token sampling on rank 0: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Every step is vectorised over the batch except drawing noise for seeded
requests. Sampling uses the exponential race ``argmax(p / E)`` with
``E ~ Exp(1)``, which is an exact categorical draw; a seeded request draws its
``E`` from its own ``torch.Generator`` and every other operation is row-wise,
so its tokens depend only on its own logits and seed: the same alone or in
any batch. Logprobs are those of the raw model distribution (vLLM's default),
before temperature or truncation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedserve.scheduler.outputs import SampledToken
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRequest:
    """One sequence that draws a token from row ``row`` of the logits."""

    sample_id: str
    request_id: str
    row: int
    params: SamplingParams
    num_output_tokens: int | None = None


class Sampler:
    """Stateful only for seeded generators and output counts, both dropped on finish/abort."""

    def __init__(self, eos_token_ids: Iterable[int] = ()):
        self.eos_token_ids = tuple(eos_token_ids)
        self._generators: dict[str, torch.Generator] = {}
        self._counts: dict[str, int] = {}
        self._children: dict[str, set[str]] = {}

    def forget(self, ids: Iterable[str]) -> None:
        """Drop state of finished or aborted requests (and of their forked sample ids)."""
        for rid in ids:
            for sid in self._children.pop(rid, set()) | {rid}:
                self._generators.pop(sid, None)
                self._counts.pop(sid, None)

    @property
    def num_tracked(self) -> int:
        return len(self._generators) + len(self._counts)

    def _generator(self, sid: str, seed: int, device: torch.device) -> torch.Generator:
        g = self._generators.get(sid)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(seed)
            self._generators[sid] = g
        return g

    def sample(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> dict[str, SampledToken]:
        """Draw one token per entry of ``reqs`` from ``logits[row]``; several may share a row."""
        if not reqs:
            return {}
        n = len(reqs)
        rows = [r.row for r in reqs]
        if rows == list(range(logits.shape[0])):
            raw = logits.float()
        else:
            raw = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
        for r in reqs:
            if r.request_id != r.sample_id:
                self._children.setdefault(r.request_id, set()).add(r.sample_id)
        x = self._apply_min_tokens(raw, reqs)
        greedy = [r.params.greedy for r in reqs]
        if all(greedy):
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample_random(x, reqs, greedy)
        token_list = tokens.tolist()
        for r in reqs:
            self._counts[r.sample_id] = self._counts.get(r.sample_id, 0) + 1
        logprob_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        out = {r.sample_id: SampledToken(token_list[i]) for i, r in enumerate(reqs)}
        if logprob_rows:
            self._add_logprobs(raw, tokens, reqs, logprob_rows, out)
        assert len(out) == n, "duplicate sample ids in one step"
        return out

    def _apply_min_tokens(self, raw: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
        """Forbid EOS and stop tokens for sequences that have not reached ``min_tokens``."""
        x = raw
        for i, r in enumerate(reqs):
            p = r.params
            if p.min_tokens <= 0:
                continue
            done = r.num_output_tokens
            if done is None:
                done = self._counts.get(r.sample_id, 0)
            if done >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if banned:
                if x is raw:
                    x = raw.clone()
                x[i, torch.tensor(banned, device=x.device)] = float("-inf")
        return x

    def _sample_random(self, x: torch.Tensor, reqs: list[SampleRequest], greedy: list[bool]
                       ) -> torch.Tensor:
        tokens = x.argmax(dim=-1)
        idx = [i for i, g in enumerate(greedy) if not g]
        sub = [reqs[i] for i in idx]
        dev = x.device
        idx_t = torch.tensor(idx, device=dev)
        temps = torch.tensor([r.params.temperature for r in sub], device=dev, dtype=x.dtype)
        z = x.index_select(0, idx_t) / temps.unsqueeze(1)
        z = _top_k_top_p(z, [r.params.top_k for r in sub], [r.params.top_p for r in sub])
        probs = torch.softmax(z, dim=-1)
        noise = torch.empty_like(probs)
        seeded = [j for j, r in enumerate(sub) if r.params.seed is not None]
        if len(seeded) < len(sub):
            noise.exponential_()
        for j in seeded:
            r = sub[j]
            g = self._generator(r.sample_id, r.params.seed, dev)  # type: ignore[arg-type]
            noise[j].exponential_(generator=g)
        tokens[idx_t] = (probs / noise).argmax(dim=-1)
        return tokens

    @staticmethod
    def _add_logprobs(raw: torch.Tensor, tokens: torch.Tensor, reqs: list[SampleRequest],
                      rows: list[int], out: dict[str, SampledToken]) -> None:
        rows_t = torch.tensor(rows, device=raw.device)
        lp = torch.log_softmax(raw.index_select(0, rows_t), dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, rows_t).unsqueeze(1)).squeeze(1).tolist()
        k = max(reqs[i].params.logprobs or 0 for i in rows)
        top_v = top_i = None
        if k > 0:
            tv, ti = lp.topk(k, dim=-1)
            top_v, top_i = tv.tolist(), ti.tolist()
        for j, i in enumerate(rows):
            st = out[reqs[i].sample_id]
            st.logprob = chosen[j]
            n_top = reqs[i].params.logprobs or 0
            st.top_logprobs = (
                {} if top_v is None or top_i is None
                else dict(zip(top_i[j][:n_top], top_v[j][:n_top]))
            )


def _top_k_top_p(z: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k and top-p nucleus; row-independent.

    ``z`` is a fresh tensor owned by the caller and may be modified in place.
    """
    v = z.shape[-1]
    ks = [k if 0 < k < v else v for k in top_k]
    if any(k < v for k in ks):
        kmax = max(k for k in ks if k < v)
        vals = z.topk(kmax, dim=-1).values
        k_t = torch.tensor([min(k, kmax) - 1 for k in ks], device=z.device)
        kth = vals.gather(1, k_t.unsqueeze(1))
        keep_all = torch.tensor([k >= v for k in ks], device=z.device).unsqueeze(1)
        z = z.masked_fill((z < kth) & ~keep_all, float("-inf"))
    p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if p_rows:
        rows_t = torch.tensor(p_rows, device=z.device)
        sub = z.index_select(0, rows_t)
        sorted_z, order = sub.sort(dim=-1, descending=True, stable=True)
        probs = sorted_z.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        p_t = torch.tensor([top_p[i] for i in p_rows], device=z.device, dtype=probs.dtype)
        drop_sorted = before >= p_t.unsqueeze(1)  # transformers' TopP rule
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        z[rows_t] = sub.masked_fill(drop, float("-inf"))
    return z
