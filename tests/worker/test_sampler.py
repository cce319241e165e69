"""Sampler: greedy, top-k/top-p masks, seeded reproducibility alone vs batched, logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampler import Sampler, SampleRequest
from pagedserve.worker.sampling_ops import inverse_cdf, sample_rows

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def _req(sid: str, row: int, **kw) -> SampleRequest:
    return SampleRequest(sid, sid, row, SamplingParams(**kw))


def test_greedy_is_argmax():
    x = _logits(4)
    out = Sampler().sample(x, [_req(f"s{i}", i, temperature=0.0) for i in range(4)])
    assert [out[f"s{i}"].token_id for i in range(4)] == x.argmax(-1).tolist()
    assert all(out[f"s{i}"].logprob is None for i in range(4))


def test_top_k_one_is_greedy_even_when_sampling():
    x = _logits(3, seed=1)
    s = Sampler()
    for step in range(5):
        out = s.sample(x, [_req(f"s{i}", i, temperature=1.5, top_k=1, seed=step)
                           for i in range(3)])
        assert [out[f"s{i}"].token_id for i in range(3)] == x.argmax(-1).tolist()


def _support(z: torch.Tensor, top_k: list[int], top_p: list[float], draws: int = 400
             ) -> list[set[int]]:
    """Tokens each row can produce: every row drawn once per point of a dense uniform grid."""
    n = z.shape[0]
    u = torch.linspace(0, 1 - 1e-7, draws).repeat_interleave(n)
    toks = sample_rows(z.repeat(draws, 1), top_k * draws, top_p * draws, u, [False] * n * draws)
    return [set(toks[i::n].tolist()) for i in range(n)]


def _nucleus(probs: torch.Tensor, p: float) -> set[int]:
    vals, order = probs.sort(descending=True, stable=True)
    n_keep = int(((vals.cumsum(0) - vals) < p).sum())
    return set(order[: max(n_keep, 1)].tolist())


def test_top_k_and_top_p_masks():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05],
                                [0.1, 0.2, 0.3, 0.4], [0.5, 0.3, 0.15, 0.05]]))
    got = _support(z, top_k=[-1, 2, 3, -1], top_p=[0.8, 1.0, 0.5, 0.81])
    assert got[0] == {0, 1}  # 0.5+0.3 reaches 0.8
    assert got[1] == {0, 1}  # top-2
    assert got[2] == {2, 3}  # top-3, then nucleus 0.4+0.3 of the renormalised three
    assert got[3] == {0, 1, 2}


@pytest.mark.parametrize("v", [3000, 60])
def test_truncation_support_matches_full_sort(v):
    """Window path, wide-nucleus fallback and wide top-k all keep exactly the reference set."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(4, v, generator=g) * 4
    z[0] = torch.rand(v, generator=g) * 0.01  # flat: nucleus wider than the window
    ks, ps = [-1, -1, 40, 1500], [0.9, 0.6, 0.7, 0.95]
    got = _support(z, ks, ps, draws=3000)
    for i in range(4):
        zi = z[i].clone()
        if 0 < ks[i] < v:
            zi[zi < zi.topk(ks[i]).values[-1]] = float("-inf")
        ref = _nucleus(torch.softmax(zi, -1), ps[i])
        assert got[i] <= ref, i
        if len(ref) <= 60:  # small supports are fully hit by a dense grid of uniforms
            assert got[i] == ref, i
    if v > 1024:
        assert len(got[0]) > 1024  # the fallback path was used and is wide


def test_inverse_cdf_never_draws_masked_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.5, 0.9999999, 1.0 - 2**-24):
        got = inverse_cdf(probs, torch.full((3,), u)).tolist()
        assert got[0] in (1, 3) and got[1] == 4 and got[2] == 0


def test_sampled_tokens_stay_inside_the_nucleus():
    x = _logits(1, seed=2).repeat(64, 1)
    allowed = set(x[0].topk(5).indices.tolist())
    out = Sampler().sample(x, [_req(f"s{i}", i, temperature=2.0, top_k=5, top_p=0.99)
                               for i in range(64)])
    assert {t.token_id for t in out.values()} <= allowed


def test_unseeded_frequencies_follow_probabilities():
    p = torch.tensor([0.6, 0.3, 0.1])
    n = 6000
    x = p.log().repeat(n, 1)
    torch.manual_seed(0)
    out = Sampler().sample(x, [_req(f"s{i}", i) for i in range(n)])
    counts = torch.bincount(torch.tensor([t.token_id for t in out.values()]), minlength=3)
    assert torch.allclose(counts / n, p, atol=0.03)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_min_p_frequencies_follow_the_renormalised_survivors(temperature):
    """vLLM's min_p: after temperature, tokens under min_p x the top probability are
    dropped and the rest keep their relative odds."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 8000
    x = p.log().repeat(n, 1)
    scaled = torch.softmax(p.log() / temperature, dim=-1)
    kept = scaled >= 0.2 * scaled.max()
    want = torch.where(kept, scaled, 0.0)
    want /= want.sum()
    torch.manual_seed(0)
    out = Sampler().sample(x, [_req(f"s{i}", i, temperature=temperature, min_p=0.2)
                               for i in range(n)])
    counts = torch.bincount(torch.tensor([t.token_id for t in out.values()]), minlength=5)
    assert (counts[~kept] == 0).all()
    assert torch.allclose(counts / n, want, atol=0.03)
    # min_p applies before top-p, which then sees the survivors renormalised (as vLLM):
    # 0.5 / 0.9 = 0.56 >= 0.55 leaves token 0 alone; over the raw distribution (0.5 < 0.55)
    # token 1 would be in the nucleus too.
    out = Sampler().sample(x[:400], [_req(f"s{i}", i, min_p=0.25, top_p=0.55)
                                     for i in range(400)])
    assert {t.token_id for t in out.values()} == {0}


def test_allowed_token_ids_restrict_draws_and_keep_relative_odds() -> None:
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 6000
    x = p.log().repeat(n, 1)
    torch.manual_seed(1)
    out = Sampler().sample(x, [_req(f"s{i}", i, allowed_token_ids=[1, 3]) for i in range(n)])
    counts = torch.bincount(torch.tensor([t.token_id for t in out.values()]), minlength=4)
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / n - 0.75) < 0.03  # 0.3 / (0.3 + 0.1)
    greedy = Sampler().sample(x[:1], [_req("g", 0, temperature=0.0, allowed_token_ids=[2, 3])])
    assert greedy["g"].token_id == 2
    # min_tokens bans EOS (id 2 here); with only EOS allowed the allowed set wins.
    s = Sampler(eos_token_ids=[2])
    only_eos = s.sample(x[:1], [_req("e", 0, temperature=0.0, min_tokens=3,
                                     allowed_token_ids=[2])])
    assert only_eos["e"].token_id == 2
    mixed = s.sample(x[:1], [_req("m", 0, temperature=0.0, min_tokens=3,
                                  allowed_token_ids=[2, 3])])
    assert mixed["m"].token_id == 3  # EOS is banned, 3 remains


NEIGHBOURS = [dict(temperature=0.9), dict(temperature=0.7, top_k=20, seed=5),
              dict(temperature=1.1, top_p=0.8), dict(temperature=0.5, top_k=300, top_p=0.95),
              dict(temperature=0.0), dict(temperature=1.0, top_k=5000, seed=9),
              dict(temperature=0.8, min_p=0.05)]


def _run_seeded(mine: dict, batch_extra: int, steps: int = 12) -> list[int]:
    """Tokens of seeded request 'me' over ``steps`` steps, with ``batch_extra`` neighbours."""
    s = Sampler()
    toks = []
    for step in range(steps):
        own = torch.randn(1, 2000, generator=torch.Generator().manual_seed(100 + step)) * 3
        others = torch.randn(batch_extra, 2000, generator=torch.Generator().manual_seed(step))
        x = torch.cat([others * 3, own])
        reqs = [_req(f"o{i}", i, **NEIGHBOURS[i % len(NEIGHBOURS)]) for i in range(batch_extra)]
        reqs.append(_req("me", batch_extra, **mine))
        reqs.reverse()  # our row is not first either
        toks.append(s.sample(x, reqs)["me"].token_id)
    return toks


@pytest.mark.parametrize("mine", [dict(temperature=0.8, top_p=0.9, seed=1234),
                                  dict(temperature=1.2, top_k=40, seed=7),
                                  dict(temperature=1.0, seed=3),
                                  dict(temperature=1.0, min_p=0.02, top_p=0.95, seed=11)],
                         ids=["top_p", "top_k", "plain", "min_p"])
def test_seeded_request_is_batch_invariant(mine):
    alone = _run_seeded(mine, 0)
    assert _run_seeded(mine, 7) == alone
    assert _run_seeded(mine, 31) == alone
    assert len(set(alone)) > 1  # actually sampling, not collapsing to argmax


def test_seed_changes_tokens_and_forget_restarts_generator():
    x = _logits(1, seed=5)
    s = Sampler()

    def draw(sid: str, seed: int) -> list[int]:
        return [s.sample(x, [_req(sid, 0, temperature=1.0, seed=seed)])[sid].token_id
                for _ in range(10)]

    first = draw("r", 7)
    assert draw("other", 8) != first
    s.forget(["r", "other"])
    assert s.num_tracked == 0
    assert draw("r", 7) == first


def test_forked_samples_match_separate_seeded_requests():
    """n=2 children sharing one logits row draw what lone requests with seed+i draw."""
    x = _logits(1, seed=9)
    parent = SamplingParams(n=2, temperature=1.0, seed=40)
    fork = Sampler()
    got = {f"r#{i}": [] for i in range(2)}
    for _ in range(8):
        reqs = [SampleRequest(f"r#{i}", "r", 0, parent.for_child(i)) for i in range(2)]
        for sid, t in fork.sample(x, reqs).items():
            got[sid].append(t.token_id)
    for i in range(2):
        lone = Sampler()
        ref = [lone.sample(x, [_req("x", 0, temperature=1.0, seed=40 + i)])["x"].token_id
               for _ in range(8)]
        assert got[f"r#{i}"] == ref
    fork.forget(["r"])  # dropping the request drops its forked children
    assert fork.num_tracked == 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_of_raw_distribution(temperature):
    x = _logits(2, seed=3)
    out = Sampler().sample(x, [_req("a", 0, temperature=temperature, logprobs=3),
                               _req("b", 1, temperature=temperature, logprobs=0)])
    lp = torch.log_softmax(x, -1)
    a, b = out["a"], out["b"]
    assert a.logprob == pytest.approx(lp[0, a.token_id].item(), abs=1e-6)
    assert b.logprob == pytest.approx(lp[1, b.token_id].item(), abs=1e-6)
    top = lp[0].topk(3)
    assert list(a.top_logprobs) == top.indices.tolist()
    assert list(a.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=1e-6)
    assert b.top_logprobs == {}


def test_min_tokens_blocks_eos_and_stop_tokens():
    x = torch.zeros(1, V)
    x[0, 2] = 10.0  # EOS is by far the likeliest
    x[0, 7] = 9.0  # a stop token next
    s = Sampler(eos_token_ids=[2])
    p = dict(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert s.sample(x, [_req("r", 0, **p)])["r"].token_id not in (2, 7)
    assert s.sample(x, [_req("r", 0, **p)])["r"].token_id not in (2, 7)
    assert s.sample(x, [_req("r", 0, **p)])["r"].token_id == 2  # min_tokens reached
    # An explicit output count from the plan wins over the sampler's own count.
    req = SampleRequest("q", "q", 0, SamplingParams(**p), num_output_tokens=5)
    assert s.sample(x, [req])["q"].token_id == 2


def test_bad_words_ban_a_last_token_only_after_the_rest_of_the_word():
    x = torch.zeros(3, V)
    x[:, 5] = 10.0  # 5 is always the likeliest, then 6, then 7
    x[:, 6] = 9.0
    x[:, 7] = 8.0
    s = Sampler()
    # Word [5] alone is always banned; word [3, 6] only right after a 3; [1, 2, 7]
    # only after 1, 2.
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[5], [3, 6], [1, 2, 7]])
    reqs = [SampleRequest("a", "a", 0, p, output_token_ids=[]),
            SampleRequest("b", "b", 1, p, output_token_ids=[9, 3]),
            SampleRequest("c", "c", 2, p, output_token_ids=[3, 1, 2])]
    out = s.sample(x, reqs)
    assert [out[k].token_id for k in "abc"] == [6, 7, 6]
    c2 = SampleRequest("c2", "c2", 0, p, output_token_ids=[3, 6, 2])  # not [1, 2]
    assert s.sample(x[:1], [c2])["c2"].token_id == 6
    # A drafted row: each position sees the guesses before it as output.
    d = SampleRequest("d", "d", 0, p, output_token_ids=[4], draft_token_ids=[3])
    got = s.sample_drafted(torch.stack([x[0], x[0]]), [d])["d"]
    assert [t.token_id for t in got] == [6]  # the guess 3 is rejected: 6 wins at pos 0
    first = x[0].clone()
    first[3] = 20.0  # position 0 takes the guess 3; at position 1 it is output
    d = SampleRequest("e", "e", 0, p, output_token_ids=[4], draft_token_ids=[3])
    got = s.sample_drafted(torch.stack([first, x[0]]), [d])["e"]
    assert [t.token_id for t in got] == [3, 7]  # after the guess 3, 6 is banned too


def test_bad_words_settings_are_checked() -> None:
    for kw in ({"bad_words": "Paris"}, {"bad_words": [""]}, {"bad_words": [" "]},
               {"bad_words_token_ids": [[]]}, {"bad_words_token_ids": [[-1]]}):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[3, V]]).check_token_ids(V)
    assert SamplingParams(bad_words_token_ids=[[3, 4]]).needs_output_history
    assert not SamplingParams(bad_words_token_ids=[[3]]).needs_output_history


def test_seeded_uniforms_depend_only_on_seed_and_position_and_are_uniform():
    from pagedserve.worker.sampler import seeded_uniform

    u = [seeded_uniform(7, p) for p in range(20000)]
    assert u == [seeded_uniform(7, p) for p in range(20000)]
    assert all(0.0 <= x < 1.0 for x in u) and len(set(u)) > 19900
    counts = torch.histc(torch.tensor(u), bins=10, min=0.0, max=1.0)
    assert ((counts - 2000).abs() < 200).all(), counts  # ~4.5 sigma
    lag = torch.tensor(u)
    corr = torch.corrcoef(torch.stack([lag[:-1], lag[1:]]))[0, 1]
    assert abs(float(corr)) < 0.03  # neighbouring positions are unrelated
    assert [seeded_uniform(8, p) for p in range(50)] != u[:50]
    assert seeded_uniform(2**63 - 1, 0) < 1.0 and seeded_uniform(2**63 + 5, 3) < 1.0


def test_a_seeded_draw_is_the_same_at_its_position_whatever_came_before():
    """A fresh sampler told the output count draws what a sampler that drew the
    earlier positions itself draws (a resumed or restarted sequence)."""
    x = _logits(1, seed=12)
    params = SamplingParams(temperature=1.0, seed=5)
    s = Sampler()
    seq = [s.sample(x, [SampleRequest("a", "a", 0, params, k)])["a"].token_id
           for k in range(12)]
    late = [Sampler().sample(x, [SampleRequest("b", "b", 0, params, k)])["b"].token_id
            for k in range(12)]
    assert seq == late and len(set(seq)) > 1
