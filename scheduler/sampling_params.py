"""Sampling parameters with vLLM-compatible field names.

Validation happens at construction so a bad value is rejected at the API edge
with a ``ValueError`` that names the field, never deep inside a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

MAX_N = 16
MAX_LOGPROBS = 20
# Thought formats (vLLM's reasoning parser names). A grammar can let a thought in the
# first two run before it (``StructuredOutputs.reasoning``); GPT-OSS's harmony
# messages (``openai_gptoss``) it cannot, so constraints are refused under that parser.
REASONING_FORMATS = ("qwen3", "deepseek_r1", "openai_gptoss")
GRAMMAR_THOUGHT_FORMATS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output to one of: a JSON schema (``json``, a dict or its text), any
    JSON object (``json_object``), a regular expression, one of ``choice``'s strings, or
    a context-free ``grammar`` (EBNF as xgrammar reads it, rule ``root`` first: GBNF-style
    ``root ::= "yes" | "no"``).

    ``structural_tag`` (vLLM's; a JSON text or object, xgrammar's structural tag:
    ``{"type": "structural_tag", "format": {...}}``, or the older ``{"structures":
    [{"begin", "schema", "end"}], "triggers": [...]}``) leaves text free until a
    trigger, then holds the tagged part to its schema (tool calls in a model's own tags).

    ``reasoning`` (one of ``GRAMMAR_THOUGHT_FORMATS``) lets a thinking model think first, as
    vLLM does under a reasoning parser: the constraint starts after a thought in that
    format, ``<think> ... </think>`` (optional with ``qwen3``; with ``deepseek_r1`` the
    opening tag is optional and the closing one required) and any newlines or spaces.

    vLLM's names. The sampler masks every token that cannot continue a valid output
    (xgrammar), and once the output is complete only end-of-sequence tokens remain.
    Where other settings (``min_tokens``, ``allowed_token_ids``) leave no token the
    grammar allows, the grammar wins. ``max_tokens`` can still cut an output short.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    reasoning: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            tag = self.structural_tag
            try:
                obj = json.loads(tag) if isinstance(tag, str) else tag
            except ValueError as e:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: "
                                 f"{e}") from None
            if not isinstance(obj, dict):
                raise ValueError("structured_outputs.structural_tag must be a JSON object")
            object.__setattr__(self, "structural_tag", json.dumps(obj, sort_keys=True))
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs.choice must be non-empty strings")
            object.__setattr__(self, "choice", choice)
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (dict or text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.reasoning is not None and self.reasoning not in GRAMMAR_THOUGHT_FORMATS:
            raise ValueError(f"structured_outputs.reasoning must be one of "
                             f"{list(GRAMMAR_THOUGHT_FORMATS)}, got {self.reasoning!r}")
        given = [self.json is not None, bool(self.json_object), self.regex is not None,
                 self.choice is not None, self.grammar is not None,
                 self.structural_tag is not None]
        if sum(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, "
                             "regex, choice, grammar, structural_tag")

    def key(self) -> str:
        """A stable text naming the constraint (compiled grammars are cached by it)."""
        schema = self.json if isinstance(self.json, str) or self.json is None else json.dumps(
            self.json, sort_keys=True)
        return json.dumps([schema, self.json_object, self.regex, self.choice, self.grammar,
                           self.reasoning, self.structural_tag])


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request; ``n`` parallel samples share the prompt's blocks.

    Penalties follow vLLM: ``repetition_penalty`` (HF's) divides positive and
    multiplies negative logits of every token in the prompt or the output;
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's) subtract per
    occurrence and once for tokens in the output. ``logit_bias`` maps token
    ids to a bias in [-100, 100] added to the logits. Logprobs stay those of
    the raw model distribution. ``prompt_logprobs=k`` returns, for every
    prompt token after the first, its logprob given the tokens before it and
    the ``k`` likeliest alternatives (vLLM's shape); such a prompt is computed
    in full, not read from the prefix cache. ``skip_special_tokens=False`` keeps
    special tokens (``<|im_end|>``, ...) in the text. ``min_p`` (vLLM's) drops tokens
    whose probability, after temperature, is below ``min_p`` times the likeliest
    token's, before top-k and top-p. ``allowed_token_ids`` restricts every draw
    to those tokens (they win over ``min_tokens``' ban on EOS and stop ids when
    nothing else would be left). ``truncate_prompt_tokens=k`` keeps the prompt's
    last ``k`` tokens. ``structured_outputs`` constrains the text (see
    :class:`StructuredOutputs`). ``bad_words`` (vLLM's) are never generated: the
    engine writes each word's token ids (as written, and after a space) into
    ``bad_words_token_ids``, and the sampler forbids a sequence's last token
    whenever the output ends with the ones before it. ``extra_args`` (vLLM's) are
    settings for custom logits processors, which read them (``logits_processors``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputs | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.extra_args is not None and (not isinstance(self.extra_args, dict) or not all(
                isinstance(k, str) for k in self.extra_args)):
            raise ValueError(f"extra_args must be a dict with string keys, got "
                             f"{self.extra_args!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, lo=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, lo=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=1)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, "
                                 f"got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
            for ids in self.bad_words_token_ids:
                if not ids:
                    raise ValueError("bad_words_token_ids must not hold an empty sequence")
                for t in ids:
                    _check_int("bad_words_token_ids", t, lo=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        if self.logit_bias:
            bias = {}
            for t, b in self.logit_bias.items():
                _check_int("logit_bias", t, lo=0)
                _check_float("logit_bias", b, -100.0, 100.0)
                bias[t] = float(b)
            self.logit_bias = bias
        else:
            self.logit_bias = None

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the field when a token id is outside the vocabulary
        (only the model knows its size, so this is not part of construction)."""
        for name, tokens in (("stop_token_ids", self.stop_token_ids),
                             ("logit_bias", self.logit_bias or ()),
                             ("allowed_token_ids", self.allowed_token_ids or ()),
                             ("bad_words_token_ids",
                              [t for ids in self.bad_words_token_ids or () for t in ids])):
            bad = [t for t in tokens if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids below the vocabulary size "
                                 f"{vocab_size}, got {bad[0]}")

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalties: the sampler needs the history."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def needs_output_history(self) -> bool:
        """Whether the sampler needs the sequence's output tokens in each step plan:
        penalties count them, a grammar replays them after a restart, and a bad word
        of several tokens is matched against their tail."""
        return (self.uses_penalties or self.structured_outputs is not None
                or any(len(ids) > 1 for ids in self.bad_words_token_ids or ()))

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax, as in vLLM."""
        return self.temperature < 1e-5

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of parallel sample ``index``: n=1 and, when seeded, ``seed + index``.

        This is vLLM's rule, so sample ``i`` of a seeded ``n``-request equals a
        lone request with seed ``seed + i``.
        """
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _check_float(name: str, value: object, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not lo <= float(value) <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
