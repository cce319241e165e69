"""The incremental detokeniser's fast path (the Rust ``decode`` behind a transformers
fast tokenizer) emits exactly what the wrapper path does, token by token."""

from __future__ import annotations

import random

import pytest

from pagedserve.cluster import detokenizer
from pagedserve.cluster.detokenizer import IncrementalDetokenizer, rust_decode
from pagedserve.worker.loaders import load_tokenizer, resolve_model

TEXTS = [
    "naïve café, 🙂 and 世界: the model serves many requests.",
    "def f(x):\n    return x ** 2  # ∑ over ℝ",
    "Stop here STOP and not after.",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


def _emissions(tok, prompt: list[int], ids: list[int], fast: bool, monkeypatch,
               **kw) -> tuple[list[str], str | None, str]:
    if not fast:
        monkeypatch.setattr(detokenizer, "rust_decode", lambda t: None)
    d = IncrementalDetokenizer(tok, prompt, **kw)
    monkeypatch.undo()
    assert (d._rust_decode is not None) == fast
    shown, stop = [], None
    for t in ids:
        before = len(d.text)
        stop = d.add_tokens([t])
        shown.append(d.text[before:])
        if stop is not None:
            break
    return shown, stop, d.text


@pytest.mark.parametrize("skip_special", [True, False])
def test_fast_path_emits_what_the_wrapper_does(tok, monkeypatch, skip_special: bool) -> None:
    """Multi-byte characters split across byte-level tokens, special tokens kept or
    skipped, random ids (undecodable byte runs included), a stop string across steps."""
    assert rust_decode(tok) is not None
    rng = random.Random(0)
    prompt = tok.encode("Answer briefly:", add_special_tokens=False)
    cases = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    cases.append([*cases[0][:5], tok.eos_token_id, *cases[1][:5]])
    cases += [[rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(5)]
    for ids in cases:
        for stop in ((), ("STOP", "\n    ")):
            kw = dict(stop=stop, skip_special_tokens=skip_special)
            fast = _emissions(tok, prompt, ids, True, monkeypatch, **kw)
            slow = _emissions(tok, prompt, ids, False, monkeypatch, **kw)
            assert fast == slow
    _, stop, text = _emissions(tok, prompt, cases[2], True, monkeypatch, stop=("STOP",))
    assert (stop, text) == ("STOP", "Stop here ")


def test_fast_path_only_where_it_is_exact(tok) -> None:
    """A subclass's own decoding, or transformers' space clean-up, keeps the wrapper."""
    cls = type(tok)
    tok.clean_up_tokenization_spaces = True
    try:
        assert rust_decode(tok) is None
    finally:
        tok.clean_up_tokenization_spaces = False

    class OwnDecode(cls):
        def _decode(self, *a, **k):
            return super()._decode(*a, **k).upper()

    tok.__class__ = OwnDecode
    try:
        assert rust_decode(tok) is None
        assert IncrementalDetokenizer(tok, [1]).add_tokens(
            tok.encode("hi there", add_special_tokens=False)) is None
    finally:
        tok.__class__ = cls
    assert rust_decode(object()) is None
