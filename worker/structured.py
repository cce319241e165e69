"""Structured outputs on rank 0: xgrammar token masks for JSON schemas, JSON objects,
regular expressions, fixed choices, EBNF grammars and structural tags.

Each constrained sample has a grammar matcher that has accepted exactly its output
tokens. Before a draw the matcher's bitmask sends every token that cannot continue
a valid output to -inf; after it, the drawn token is accepted. Once the output is
complete only the model's end-of-sequence tokens stay allowed, so generation stops
there. JSON is written with xgrammar's fixed spacing (``any_whitespace=False``):
free whitespace lets a small model pad a value until ``max_tokens``. Compiled grammars are cached by constraint, the tokenizer's vocabulary table
is built once per worker (~0.2 s for a 49k vocabulary).

A matcher that is behind its sample's history (a restarted worker, or a sample
first seen mid-generation) replays the missing tokens, so the scheduler's plan is
the only source of truth: it sends the output history for constrained requests.
xgrammar is imported only when a constrained request arrives.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagedserve.scheduler.sampling_params import StructuredOutputs


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise ValueError(f"structured_outputs needs the xgrammar package ({e})") from None
    return xgrammar


_END = "</think>"


def thought_ebnf(fmt: str) -> str:
    """EBNF of a thought in ``fmt`` (``StructuredOutputs.reasoning``) and the blank
    after it: any text that does not contain ``</think>`` before the closing tag. The
    body rules are the matching automaton of ``</think>`` (rule ``s<k>``: its first
    ``k`` characters just read), so a body never closes the thought early."""
    names = ["body"] + [f"s{k}" for k in range(1, len(_END))]
    rules = []
    for k, name in enumerate(names):
        alts = ['""', '"<" s1']
        if k + 1 < len(_END):
            alts.append(f'"{_END[k]}" {names[k + 1]}')
        excluded = "<" if k == 0 else "<" + _END[k]
        alts.append(f"[^{excluded}] body")
        rules.append(f"{name} ::= " + " | ".join(dict.fromkeys(alts)))
    opening = '"<think>"' if fmt == "qwen3" else '"<think>"?'
    thought = f'{opening} body "</think>" [ \\n]*'
    root = f"root ::= ({thought})?" if fmt == "qwen3" else f"root ::= {thought}"
    return "\n".join([root, *rules])


def _grammar(xgr: Any, spec: StructuredOutputs) -> Any:
    """The uncompiled grammar of ``spec`` (raises on a bad schema or regex), after a
    thought when ``spec.reasoning`` says so."""
    inner = _constraint(xgr, spec)
    if spec.reasoning is None:
        return inner
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(thought_ebnf(spec.reasoning)), inner)


def _constraint(xgr: Any, spec: StructuredOutputs) -> Any:
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        text = schema if isinstance(schema, str) else json.dumps(schema)
        # One fixed spacing: free whitespace lets small models pad a value forever.
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if spec.regex is not None:
        return xgr.Grammar.from_regex(spec.regex)
    if spec.grammar is not None:
        return xgr.Grammar.from_ebnf(spec.grammar)
    if spec.structural_tag is not None:
        return _structural_tag(xgr, spec.structural_tag)
    alternatives = " | ".join(json.dumps(c) for c in spec.choice or ())
    return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")


def _structural_tag(xgr: Any, text: str) -> Any:
    """xgrammar's structural tag, or the older ``structures`` / ``triggers`` form that
    vLLM still takes (each structure's ``schema`` a JSON schema object)."""
    tag = json.loads(text)
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(text)
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    items = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or not isinstance(s.get("schema"), dict):
            raise ValueError(f"structural_tag.structures[{i}] needs begin and end strings "
                             "and a schema object")
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]))
    return xgr.Grammar.from_structural_tag(items, triggers)


def check_structured_outputs(spec: StructuredOutputs) -> None:
    """Raise ``ValueError`` naming ``structured_outputs`` when the schema or regex does
    not compile (no tokenizer needed: the front and the engine call this)."""
    xgr = _xgrammar()
    try:
        _grammar(xgr, spec)
    except Exception as e:
        raise ValueError(f"structured_outputs: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """xgrammar's message without the clock time and C++ source line it starts with
    (``[12:00:00] /project/cpp/json_schema_converter.cc:5082: Unsupported type ...``):
    a client reads why its schema was refused, not where in xgrammar."""
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip())
    return text or type(e).__name__


class GrammarBook:
    """Compiled grammars and per-sample matchers for one worker's tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=eos_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[str, Any] = {}
        self._matchers: dict[str, tuple[Any, int]] = {}  # sample id -> (matcher, accepted)
        self.vocab_size = vocab_size
        self._eos = torch.tensor(eos_token_ids or [], dtype=torch.long)

    def _compile(self, spec: StructuredOutputs) -> Any:
        key = spec.key()
        grammar = self._compiled.get(key)
        if grammar is None:
            grammar = self._compiler.compile_grammar(_grammar(self._xgr, spec))
            self._compiled[key] = grammar
        return grammar

    def sync(self, sample_id: str, spec: StructuredOutputs, history: list[int] | None) -> Any:
        """The sample's matcher, caught up with ``history`` (its output tokens so far)."""
        matcher, accepted = self._matchers.get(sample_id, (None, 0))
        if matcher is None:
            matcher = self._xgr.GrammarMatcher(self._compile(spec))
        for tok in (history or [])[accepted:]:
            if not matcher.is_terminated():
                matcher.accept_token(tok)
            accepted += 1
        self._matchers[sample_id] = (matcher, accepted)
        return matcher

    def mask_rows(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Send the tokens each matcher forbids to -inf in its row of ``logits`` (in place)."""
        live = [(row, m) for row, m in zip(rows, matchers) if not m.is_terminated()]
        done = [row for row, m in zip(rows, matchers) if m.is_terminated()]
        if live:
            bitmask = self._xgr.allocate_token_bitmask(len(live), self.vocab_size)
            for i, (_, m) in enumerate(live):
                m.fill_next_token_bitmask(bitmask, i)
            idx = [row for row, _ in live]
            sub = logits[idx].float()
            self._xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device))
            logits[idx] = sub.to(logits.dtype)
        if done and self._eos.numel():
            # A complete output that goes on (ignore_eos): only end-of-sequence tokens.
            eos = self._eos.to(logits.device)
            done_t = torch.tensor(done, device=logits.device)
            keep = logits[done_t][:, eos]
            logits[done_t] = float("-inf")
            logits[done_t[:, None], eos[None, :]] = keep

    @staticmethod
    def advance(matcher: Any, tokens: list[int]) -> int:
        """Accept ``tokens`` while the grammar allows them (speculative guesses);
        returns how many were taken, for ``matcher.rollback``."""
        n = 0
        for tok in tokens:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
        return n

    def accept(self, sample_id: str, token: int) -> None:
        matcher, accepted = self._matchers[sample_id]
        if not matcher.is_terminated():
            matcher.accept_token(token)
        self._matchers[sample_id] = (matcher, accepted + 1)

    def forget(self, sample_id: str) -> None:
        self._matchers.pop(sample_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._matchers)
