"""Penalties and ``logit_bias`` in the sampler, against a token-by-token reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampler import Sampler, SampleRequest
from pagedserve.worker.sampling_ops import penalize_row

V = 40


def _reference(row: list[float], out: list[int], prompt: list[int], presence: float,
               frequency: float, repetition: float) -> list[float]:
    """The definitions, one token at a time (vLLM's order: repetition, then the others)."""
    res = list(row)
    for t in range(len(res)):
        if t in out or t in prompt:
            res[t] = res[t] / repetition if res[t] > 0 else res[t] * repetition
        n = out.count(t)
        res[t] -= frequency * n + (presence if n else 0.0)
    return res


@pytest.mark.parametrize(("presence", "frequency", "repetition"),
                         [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (-0.4, 0.3, 0.8),
                          (1.5, -2.0, 2.0)])
def test_penalize_row_matches_the_definitions(presence, frequency, repetition) -> None:
    g = torch.Generator().manual_seed(1)
    row = torch.randn(V, generator=g) * 3
    out = [3, 7, 7, 7, 12, 3]
    prompt = [1, 12, 30, 30]
    want = _reference(row.tolist(), out, prompt, presence, frequency, repetition)
    penalize_row(row, out, prompt, presence, frequency, repetition)
    assert row.tolist() == pytest.approx(want, abs=1e-6)


def test_no_history_leaves_the_row_alone() -> None:
    row = torch.randn(V)
    before = row.clone()
    penalize_row(row, [], [], 1.0, 1.0, 1.5)
    assert torch.equal(row, before)


def _req(sid: str, row: int, out: list[int] | None = None, prompt: list[int] | None = None,
         **kw) -> SampleRequest:
    return SampleRequest(sid, sid, row, SamplingParams(**kw), None if out is None else len(out),
                         out, prompt)


def test_greedy_follows_the_penalised_logits_and_logprobs_stay_raw() -> None:
    x = torch.zeros(1, V)
    x[0, 5], x[0, 9] = 4.0, 3.9
    s = Sampler()
    plain = s.sample(x, [_req("a", 0, out=[5], temperature=0.0, logprobs=0)])["a"]
    assert plain.token_id == 5
    tok = s.sample(x, [_req("b", 0, out=[5], temperature=0.0, frequency_penalty=0.2,
                            logprobs=0)])["b"]
    assert tok.token_id == 9
    assert tok.logprob == pytest.approx(torch.log_softmax(x[0], -1)[9].item())
    rep = s.sample(x, [_req("c", 0, out=[], prompt=[5], temperature=0.0,
                            repetition_penalty=1.1)])["c"]
    assert rep.token_id == 9  # the prompt counts for the repetition penalty


def test_logit_bias_forces_or_bans_and_cannot_undo_min_tokens() -> None:
    x = torch.zeros(1, V)
    x[0, 2] = 10.0  # EOS
    s = Sampler(eos_token_ids=[2])
    assert s.sample(x, [_req("a", 0, temperature=0.0, logit_bias={17: 100})])["a"].token_id == 17
    banned = s.sample(x, [_req("b", 0, temperature=0.0, logit_bias={2: -100})])["b"]
    assert banned.token_id != 2
    held = s.sample(x, [_req("c", 0, out=[], temperature=0.0, min_tokens=1,
                             logit_bias={2: 100})])["c"]
    assert held.token_id != 2  # -inf stays -inf
    assert torch.equal(x[0, 2], torch.tensor(10.0))  # the caller's logits are untouched


def test_seeded_draws_with_penalties_are_batch_invariant() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, V, generator=g)
    kw = dict(temperature=1.0, seed=11, presence_penalty=0.8, repetition_penalty=1.2)
    mine = _req("m", 1, out=[4, 4, 8], prompt=[1, 2], **kw)
    alone = Sampler().sample(x[1:2], [_req("m", 0, out=[4, 4, 8], prompt=[1, 2], **kw)])
    batch = Sampler().sample(x, [_req("o0", 0, temperature=1.0), mine,
                                 _req("o2", 2, temperature=0.5, frequency_penalty=1.0,
                                      out=[1])])
    assert batch["m"].token_id == alone["m"].token_id


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.1), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", 101.0), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 150.0}),
    ("presence_penalty", "high"),
])
def test_bad_penalty_settings_name_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
