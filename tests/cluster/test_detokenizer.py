"""The incremental detokeniser's fast path (the Rust ``DecodeStream`` over the
tokenizer behind a transformers fast tokenizer) emits exactly what the wrapper path
does, token by token and in multi-token steps."""

from __future__ import annotations

import random
from pathlib import Path

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
               step: int = 1, **kw) -> tuple[list[str], str | None, str, int]:
    """What each ``add_tokens`` call of ``step`` tokens shows, the stop string, the
    text, and how many tokens of the last call were read."""
    if not fast:
        monkeypatch.setattr(detokenizer, "rust_decode", lambda t: None)
    d = IncrementalDetokenizer(tok, prompt, **kw)
    monkeypatch.undo()
    assert (d._rust_decode is not None) == fast
    assert d._stream is None or fast
    shown, stop = [], None
    for k in range(0, len(ids), step):
        before = len(d.text)
        stop = d.add_tokens(ids[k : k + step])
        shown.append(d.text[before:])
        if stop is not None:
            break
    return shown, stop, d.text, d.num_consumed


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
            for step in (1, 3):  # 3: a step that accepted speculated tokens
                kw = dict(stop=stop, skip_special_tokens=skip_special, step=step)
                fast = _emissions(tok, prompt, ids, True, monkeypatch, **kw)
                slow = _emissions(tok, prompt, ids, False, monkeypatch, **kw)
                assert fast == slow
    _, stop, text, _ = _emissions(tok, prompt, cases[2], True, monkeypatch, stop=("STOP",))
    assert (stop, text) == ("STOP", "Stop here ")


def _byte_token(tok, b: int) -> int:
    """The id of byte-level BPE's token for the lone byte ``b`` (GPT-2's byte alphabet
    spells bytes 0xA1-0xAC and 0xAE-0xFF as the character of that code point)."""
    assert 0xA1 <= b <= 0xFF and b != 0xAD
    i = tok.convert_tokens_to_ids(chr(b))
    assert tok.decode([i, _byte_token(tok, 0xA9)]) == "é" if b == 0xC3 else True
    return i


@pytest.mark.parametrize("context", ["none", "prompt", "out-of-vocabulary",
                                     "unfinished character", "broken character"])
def test_fast_path_over_a_long_text_and_any_context(tok, monkeypatch, context) -> None:
    """Thousands of tokens of real text (the stream's window moves on), after no prompt,
    a prompt, ids the tokenizer does not know (a model's padded vocabulary), or a
    prompt that ends in the first byte of a character, or has a lone byte in it (the
    first is where the stream would differ: that sequence runs in Python)."""
    text = Path(__file__).read_text(encoding="utf-8") + "".join(TEXTS) * 20
    ids = tok.encode(text, add_special_tokens=False)[:3000]
    lead = _byte_token(tok, 0xC3)  # the first byte of "é"
    (x,) = tok.encode("x", add_special_tokens=False)
    prompt = {"prompt": tok.encode("Go on:", add_special_tokens=False),
              "out-of-vocabulary": [len(tok) + 7, x, len(tok) + 100],
              "unfinished character": [x, lead],
              "broken character": [lead, x]}.get(context, [])
    fast = _emissions(tok, prompt, ids, True, monkeypatch, step=2)
    assert fast == _emissions(tok, prompt, ids, False, monkeypatch, step=2)
    assert "".join(fast[0]) == fast[2] and len(fast[2]) > 5000
    assert (IncrementalDetokenizer(tok, prompt)._stream is None) == (
        context == "unfinished character")
    # A byte that completes the prompt's last character (or stands alone) then a word.
    tail = [_byte_token(tok, 0xA9), *tok.encode(" ok", add_special_tokens=False)]
    fast = _emissions(tok, prompt, tail, True, monkeypatch)
    assert fast == _emissions(tok, prompt, tail, False, monkeypatch)
    if context == "unfinished character":  # "é" is the prompt's: not shown
        assert fast[2] == " ok"


class _Flaky:
    """A stream that works for ``ok`` tokens, then raises as the Rust one does when its
    text no longer extends its prefix."""

    def __init__(self, stream, backend, ok: int) -> None:
        self.stream, self.left = stream, ok

    def step(self, backend, tok: int) -> str | None:
        self.left -= 1
        if self.left < 0:
            raise Exception("Invalid prefix encountered")
        return self.stream.step(backend, tok)


def test_a_stream_error_goes_on_in_python_from_the_same_state(tok, monkeypatch) -> None:
    """Where the Rust stream raises mid-sequence (its text stopped extending its
    prefix), that sequence goes on in Python from the stream's offsets: the texts
    equal the Python path's throughout, characters split across the switch included."""
    ids = tok.encode(TEXTS[0] * 4, add_special_tokens=False)
    want = _emissions(tok, [], ids, False, monkeypatch)
    for fail_at in range(len(ids)):
        d = IncrementalDetokenizer(tok, [])
        d._stream = (_Flaky(*d._stream, fail_at), d._stream[1])
        shown = []
        for t in ids:
            before = len(d.text)
            d.add_tokens([t])
            shown.append(d.text[before:])
        assert (shown, d.text) == (want[0], want[2]) and d._stream is None


def test_a_silent_stop_token_is_read_but_not_shown(tok) -> None:
    """A stop token that ended the sequence counts as read and adds no text, on both
    paths (``stop_terminated``)."""
    ids = tok.encode("Hello there", add_special_tokens=False)
    for fast in (True, False):
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
        if not fast:
            d._stream = None
        assert d.add_tokens([*ids, tok.eos_token_id], stop_terminated=True) is None
        assert (d.text, d.num_consumed) == ("Hello there", len(ids) + 1)


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
