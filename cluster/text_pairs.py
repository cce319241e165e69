"""Inputs shared by the offline ``LLM`` and the HTTP pooling routes: OpenAI's limit on
inputs per request and vLLM's score pairing. It imports neither Ray nor pydantic, so the
offline engine runs where only torch is installed (the GPU check's machine, say)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def pair_texts(first: str | Sequence[str], second: str | Sequence[str],
               names: tuple[str, str] = ("text_1", "text_2")) -> tuple[list[str], list[str]]:
    """vLLM's score pairing: one first text against each second one, or two lists of
    the same length pairwise; a ``ValueError`` that starts with the field's name."""
    seconds = [second] if isinstance(second, str) else list(second)
    firsts = [first] * len(seconds) if isinstance(first, str) else list(first)
    for name, texts in ((names[1], seconds), (names[0], firsts)):
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValueError(f"{name} must be a non-empty text or list of non-empty texts")
    if len(firsts) != len(seconds):
        raise ValueError(f"{names[0]} has {len(firsts)} texts and {names[1]} "
                         f"{len(seconds)}: give one, or as many as {names[1]}")
    if len(seconds) > MAX_INPUTS:
        raise ValueError(f"{names[1]} may hold at most {MAX_INPUTS} texts")
    return firsts, seconds


def truncated_ids(ids: list[int], keep: int | None, encoder: bool = False) -> list[int]:
    """``ids`` cut to ``keep`` tokens (None: all): a decoder keeps the last ones (the
    end, where its pooled state is), an encoder the first ones and its closing
    separator (its ``[CLS]`` first, as a right-truncating BERT tokenizer keeps it)."""
    if keep is None or len(ids) <= keep:
        return ids
    if not encoder:
        return ids[-keep:]
    return ids[:keep - 1] + ids[-1:] if keep > 1 else ids[:1]


def pair_token_ids(tokenizer: Any, first: str, second: str, truncate: int | None = None,
                   pair_encoding: bool = True, encoder: bool = False) -> list[int]:
    """A cross-encoder's prompt for one pair, as vLLM builds it: the tokenizer's own pair
    encoding (``text``, ``text_pair``: BERT-style ``[CLS] a [SEP] b [SEP]``, a BOS before
    each text for a Llama tokenizer), as sentence-transformers' ``CrossEncoder`` does;
    or, without ``pair_encoding`` (an LLM made a reranker, whose query and document
    templates carry the format), the two texts joined and tokenised as one.
    ``truncate`` cuts to that many tokens as embeddings do (``truncated_ids``)."""
    enc = tokenizer(first, text_pair=second) if pair_encoding else tokenizer(first + second)
    ids = [int(t) for t in enc["input_ids"]]
    return truncated_ids(ids, truncate, encoder)
