"""Verifying draft tokens in the sampler: the same tokens as sampling one position at a
time (greedy, seeded, with penalties, ``min_tokens``, bias, allowed ids), the target
distribution for unseeded draws, and per-position logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampler import Sampler, SampleRequest

V = 32
EOS = 0

PARAMS = [
    dict(temperature=0.0),
    dict(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
    dict(temperature=0.0, repetition_penalty=1.8),
    dict(temperature=0.0, min_tokens=3),
    dict(temperature=0.0, logit_bias={5: 3.0}, allowed_token_ids=[0, 3, 5, 7, 9, 11]),
    dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02, seed=11),
    dict(temperature=1.0, seed=5, frequency_penalty=1.0, min_tokens=2, logprobs=2),
]


def _one_at_a_time(logits: torch.Tensor, params: SamplingParams, history: list[int] | None,
                   n: int) -> list[int]:
    """Plain decoding: ``n`` draws, one position per call, the history growing by what
    was drawn (a fresh sampler: seeded draws use the seed's first uniforms)."""
    s = Sampler(eos_token_ids=[EOS])
    hist = None if history is None else list(history)
    out = []
    for j in range(n):
        n_out = None if hist is None else len(hist)
        tok = s.sample(logits[j:j + 1], [SampleRequest("a", "a", 0, params, n_out, hist,
                                                        [1, 2, 3])])["a"].token_id
        out.append(tok)
        if hist is not None:
            hist.append(tok)
    return out


@pytest.mark.parametrize("kw", PARAMS)
@pytest.mark.parametrize("trial", range(6))
def test_drafted_rows_equal_one_position_at_a_time(kw: dict, trial: int) -> None:
    g = torch.Generator().manual_seed(100 * trial + len(str(kw)))
    k = 4
    logits = torch.randn(k + 1, V, generator=g) * 3
    logits[:, EOS] += 4.0  # EOS is often the argmax: min_tokens must ban it per position
    params = SamplingParams(**kw)
    history = [4, 5, 5] if params.uses_penalties else None
    # Drafts equal to what plain decoding draws, with one wrong guess at position `bad`
    # (bad == k: every guess right). Plain decoding keeps its draws up to and including
    # the first that differs from the guess; later ones never happen.
    plain = _one_at_a_time(logits, params, history, k + 1)
    bad = trial % (k + 1)
    drafts = [t if j != bad else (t + 1) % V for j, t in enumerate(plain[:k])]
    expected = plain[:bad + 1]
    got = Sampler(eos_token_ids=[EOS]).sample_drafted(
        logits, [SampleRequest("a", "a", 0, params, None if history is None else len(history),
                               history, [1, 2, 3], drafts)])["a"]
    assert [t.token_id for t in got] == expected
    if params.logprobs is not None:
        lp = torch.log_softmax(logits.float(), -1)
        for j, t in enumerate(got):
            assert t.logprob == pytest.approx(lp[j, t.token_id].item(), abs=1e-5)
            assert len(t.top_logprobs) == params.logprobs


def test_min_tokens_counts_the_drafts_before_each_position() -> None:
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[0, 7], logits[1, 8], logits[2, 9] = 5.0, 5.0, 5.0
    params = SamplingParams(temperature=0.0, min_tokens=3)
    s = Sampler(eos_token_ids=[EOS])
    # One output token so far: positions 0 and 1 are outputs 2 and 3 (EOS banned),
    # position 2 is output 4 (EOS allowed, and drawn).
    got = s.sample_drafted(logits, [SampleRequest("a", "a", 0, params, 1, None, None, [7, 8])])
    assert [t.token_id for t in got["a"]] == [7, 8, EOS]


def test_unseeded_drafts_keep_the_target_distribution() -> None:
    """Draft d0 survives with p0(d0); the first token follows p0 whatever the draft; after
    an accepted d0 the next token follows p1 (statistical, 40k draws, 4 sigma)."""
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1],
                                     [0.25, 0.25, 0.25, 0.25]]))
    p0, p1 = logits.softmax(-1)[0], logits.softmax(-1)[1]
    n = 40_000
    params = SamplingParams(temperature=1.0)
    reqs = [SampleRequest(f"s{i}", f"s{i}", 0, params, 0, None, None, [1, 1]) for i in range(n)]
    out = Sampler().sample_drafted(logits, reqs)
    first = torch.tensor([out[f"s{i}"][0].token_id for i in range(n)])
    freq0 = torch.bincount(first, minlength=4).float() / n
    tol = 4 * (0.25 / n) ** 0.5
    assert torch.allclose(freq0, p0, atol=tol), freq0
    accepted = [out[f"s{i}"] for i in range(n) if out[f"s{i}"][0].token_id == 1]
    assert len(accepted) / n == pytest.approx(p0[1].item(), abs=tol)
    second = torch.tensor([a[1].token_id for a in accepted])
    freq1 = torch.bincount(second, minlength=4).float() / len(accepted)
    assert torch.allclose(freq1, p1, atol=4 * (0.25 / len(accepted)) ** 0.5), freq1
    assert all(len(out[f"s{i}"]) <= 3 for i in range(n))


@pytest.mark.parametrize("bad", [0, 1, 2, 3])
def test_grammar_rows_with_drafts_equal_one_position_at_a_time(bad: int) -> None:
    """Each position is masked in the state the guesses before it lead to; the matcher
    ends having accepted exactly the kept tokens (checked by the next plain step)."""
    pytest.importorskip("xgrammar")
    from pagedserve.scheduler.sampling_params import StructuredOutputs
    from pagedserve.worker.loaders import load_tokenizer, resolve_model
    from pagedserve.worker.structured import GrammarBook

    tok = load_tokenizer(resolve_model(None))
    vocab = len(tok)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]

    def sampler() -> Sampler:
        return Sampler(eos_token_ids=[EOS], grammar_book=lambda: GrammarBook(tok, vocab, [EOS]))

    params = SamplingParams(temperature=0.0,
                            structured_outputs=StructuredOutputs(regex="[0-9]{2}-[0-9]{2}"))
    g = torch.Generator().manual_seed(bad)
    k = 3
    logits = torch.randn(k + 2, vocab, generator=g)
    logits[:, digits] += 5.0  # digits lead wherever the grammar allows them

    plain, s1 = [], sampler()
    for j in range(k + 2):
        hist = list(plain)
        plain.append(s1.sample(logits[j:j + 1], [SampleRequest("a", "a", 0, params, len(hist),
                                                              hist)])["a"].token_id)
    drafts = [t if j != bad else digits[(digits.index(t) + 1) % 10] if t in digits else t + 1
              for j, t in enumerate(plain[:k])]
    s2 = sampler()
    got = s2.sample_drafted(logits, [SampleRequest("a", "a", 0, params, 0, [], None, drafts)])
    kept = [t.token_id for t in got["a"]]
    assert kept == plain[:bad + 1] if bad < k else kept == plain[:k + 1]
    # The next step continues from exactly the kept tokens.
    nxt = s2.sample(logits[len(kept):len(kept) + 1],
                    [SampleRequest("a", "a", 0, params, len(kept), kept)])["a"].token_id
    assert nxt == plain[len(kept)]


def _draft_from(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``n`` draws from each row of ``q``: ``[n, rows]`` (position j from q[j])."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(row, n, replacement=True, generator=g)
                        for row in q], 1)


def test_drafts_drawn_from_q_keep_the_target_distribution_and_most_guesses() -> None:
    """Speculative sampling's rule with a draft distribution q: the first token follows
    p0, the second (after a kept first guess) p1; a guess survives with
    sum(min(p, q)), well above the p0(argmax q) a greedy guess gets (statistical,
    40k draws, 4 sigma)."""
    torch.manual_seed(1)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1],
                                     [0.25, 0.25, 0.25, 0.25]]))
    p = logits.softmax(-1)
    q = torch.tensor([[0.3, 0.4, 0.2, 0.1], [0.2, 0.4, 0.3, 0.1]])
    n = 40_000
    drafts = _draft_from(q, n, 3).tolist()
    params = SamplingParams(temperature=1.0)
    reqs = [SampleRequest(f"s{i}", f"s{i}", 0, params, 0, None, None, drafts[i],
                          draft_probs=q) for i in range(n)]
    out = Sampler().sample_drafted(logits, reqs)
    tol = 4 * (0.25 / n) ** 0.5
    first = torch.tensor([out[f"s{i}"][0].token_id for i in range(n)])
    assert torch.allclose(torch.bincount(first, minlength=4).float() / n, p[0], atol=tol)
    kept0 = [i for i in range(n) if len(out[f"s{i}"]) > 1]  # the first guess survived
    assert all(out[f"s{i}"][0].token_id == drafts[i][0] for i in kept0)
    assert len(kept0) / n == pytest.approx(torch.minimum(p[0], q[0]).sum().item(), abs=tol)
    assert len(kept0) / n > p[0, q[0].argmax()].item() + 0.3  # greedy: 0.3 kept
    second = torch.tensor([out[f"s{i}"][1].token_id for i in kept0])
    freq1 = torch.bincount(second, minlength=4).float() / len(kept0)
    assert torch.allclose(freq1, p[1], atol=4 * (0.25 / len(kept0)) ** 0.5), freq1
    assert all(len(out[f"s{i}"]) <= 3 for i in range(n))


def test_draft_probs_rows_under_truncation_and_beside_matched_rows() -> None:
    """A top-k target never emits a token outside its top k, even where q put mass
    there; a seeded row beside it keeps draw-and-match (its tokens those without
    drafts); logprobs come with kept and drawn tokens alike; counts advance."""
    torch.manual_seed(2)
    v = 8
    logits = torch.randn(3, v)
    q = torch.full((2, v), 1.0 / v)
    top2 = set(logits[0].topk(2).indices.tolist())
    params = SamplingParams(temperature=1.0, top_k=2, logprobs=1)
    seeded = SamplingParams(temperature=1.0, seed=4)
    plain = Sampler().sample(logits[:1], [SampleRequest("b", "b", 0, seeded, 0)])["b"]
    for trial in range(200):
        d = _draft_from(q, 1, trial)[0].tolist()
        s = Sampler()
        out = s.sample_drafted(torch.cat([logits, logits]), [
            SampleRequest("a", "a", 0, params, 0, None, None, d, draft_probs=q),
            SampleRequest("b", "b", 3, seeded, 0, None, None, d, draft_probs=q)])
        assert out["a"][0].token_id in top2
        assert all(t.logprob is not None and t.top_logprobs for t in out["a"])
        assert out["b"][0].token_id == plain.token_id
        assert s._counts == {"a": len(out["a"]), "b": len(out["b"])}
