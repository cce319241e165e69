"""Speculative decoding: n-gram lookup (vLLM's ``method="ngram"``, HF's prompt lookup)
or a smaller draft model (``method="draft_model"``, HF's assisted generation).

The proposer guesses a sequence's next tokens by finding the most recent
earlier occurrence of its last ``n`` tokens (``prompt_lookup_max`` down to
``prompt_lookup_min``) and proposing the tokens that followed it. The guesses
cost no model: the scheduler computes them as one step of ``1 + k`` positions,
and the sampler keeps the longest prefix it would have drawn anyway, plus one
token of its own. Outputs that quote their input (summaries, code edits,
extraction, RAG answers) advance several tokens per step; a batch-1 decode
step on a CPU or GPU reads every weight once whatever its width, so the extra
positions cost little there. Pure Python: the scheduler imports no torch.

With a draft model the guesses come from the worker instead: after each step the
rank that samples runs the draft over the step's accepted tokens and proposes the
next ``k`` (``worker.draft_model``); the scheduler keeps each request's
proposal until its next step and gives such rows ``k`` lookahead slots, where the
draft writes its own KV for the tokens it guesses past the step.

Suffix decoding (``method="suffix"``, ``suffix_decoding``) weighs every match in the
request's own tokens and in earlier responses by how often each continuation
followed, and guesses as far as those frequencies hold up.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.scheduler.request import TOKEN_WIDTH, Request
from pagedserve.scheduler.suffix_decoding import SuffixProposer

SPEC_METHODS = ("ngram", "draft_model", "suffix", "eagle", "eagle3", "deepseek_mtp", "mtp",
                "qwen3_next_mtp")
# Methods whose guesses come from a model beside the sampler (``model`` names it).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# The target's own multi-token-prediction layers draft (DeepSeek-V3, Qwen3-Next /
# Qwen3.5): no ``model``.
OWN_HEAD_METHODS = ("deepseek_mtp", "mtp", "qwen3_next_mtp")
DRAFT_QUANTIZATIONS = ("int8", "int4")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``method="ngram"``, or ``"draft_model"`` with
    ``model`` (a local directory or cached hub id sharing the target's tokenizer;
    given ``model``, the method defaults to it). ``quantization`` ("int8" / "int4")
    quantises the draft's weights online, a cheaper drafter on CPU. ``"eagle"`` and
    ``"eagle3"`` take ``model`` too: an EAGLE / EAGLE-3 head that drafts from the
    target's own hidden states (``worker.models.eagle``). ``"deepseek_mtp"`` (or
    ``"mtp"``) drafts with a DeepSeek-V3 target's own multi-token-prediction layer
    (``worker.models.mtp``), ``"qwen3_next_mtp"`` (or ``"mtp"``) with a Qwen3-Next /
    Qwen3.5 target's (``worker.models.qwen3_next_mtp``), one guess a step unless
    ``num_speculative_tokens`` says.

    Defaults from ``bench/spec_decode.py`` on SmolLM2: single-token matches
    (``prompt_lookup_min=1``) guess twice as often for little more accepted,
    which costs a batched step on open-ended prompts ~15%; 2..4 does not.

    ``disable_by_batch_size``: steps with at least this many running sequences
    propose nothing (a wide batch is compute bound, where rejected guesses cost
    real work); None never disables.

    ``method="suffix"`` reads vLLM's ``suffix_decoding_*`` fields: the depth of its
    suffix trees (match plus guesses), how many responses it caches (0: only the
    request's own tokens), how far a match of ``m`` tokens may guess
    (``max_spec_factor * m``) and the least estimated probability a guess needs.
    ``num_speculative_tokens`` defaults to 4, and for suffix decoding to the tree
    depth (vLLM's default): its guesses stop where the counts do. The cache holds
    1,000 responses by default, not vLLM's 10,000: its Python nodes cost ~210 bytes
    per cached token (SmolLM2's tokens of the project README), ~60 MB at 300 tokens
    each.
    """

    method: str = "ngram"
    num_speculative_tokens: int = None  # type: ignore[assignment]  # set per method
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    model: str | None = None
    quantization: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        self._check_suffix_fields()
        if self.num_speculative_tokens is None:
            default = self.suffix_decoding_max_tree_depth if self.method == "suffix" else \
                1 if self.method in OWN_HEAD_METHODS else 4  # (one MTP layer: one guess)
            object.__setattr__(self, "num_speculative_tokens", min(default, 64))
        if self.method in MODEL_METHODS:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model must name the draft model "
                                 f"(a local directory or cached hub id), got {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model is for methods {MODEL_METHODS}, "
                             f"not {self.method!r}" + (" (it drafts with the target's own "
                                                      "layers)" if self.method in
                                                      OWN_HEAD_METHODS else ""))
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError("speculative_config.quantization is for method 'draft_model', "
                             f"not {self.method!r}")
        q = self.quantization
        if q is not None and q not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization must be one of "
                             f"{DRAFT_QUANTIZATIONS} or None, got {q!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, 64], "
                                 f"got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError("speculative_config.disable_by_batch_size must be None or a "
                             f"positive integer, got {b!r}")

    def _check_suffix_fields(self) -> None:
        for name, lo, hi in (("suffix_decoding_max_tree_depth", 1, 1024),
                             ("suffix_decoding_max_cached_requests", 0, 2**31 - 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"speculative_config.{name} must be an integer in "
                                 f"[{lo}, {hi}], got {v!r}")
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be a "
                             f"positive number, got {factor!r}")
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {p!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | SpeculativeConfig | None
                  ) -> SpeculativeConfig | None:
        """Parse vLLM's dict form; unknown keys are an error naming them."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} "
                             f"(known: {sorted(known)})")
        d = dict(d)
        if d.get("model") is not None and "method" not in d:
            d["method"] = "draft_model"  # vLLM's reading of a bare ``model``
        return cls(**d)

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model beside the sampler drafts (a draft model, an EAGLE head, or
        the target's own MTP layer)."""
        return self.method in MODEL_METHODS or self.method in OWN_HEAD_METHODS

    @property
    def num_lookahead(self) -> int:
        """Slots past a row's step that the draft writes: its guesses after the
        token it samples (the target never reads them; the next step recomputes
        or overwrites every one)."""
        return self.num_speculative_tokens if self.uses_draft_model else 0


class NgramProposer:
    """Finds draft tokens in a request's own tokens (prompt and output so far)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, req: Request, max_tokens: int) -> tuple[int, ...]:
        """Up to ``min(k, max_tokens)`` tokens after the latest earlier match of the
        longest suffix n-gram; ``()`` when no suffix of at least the minimum
        length occurred before."""
        k = min(self.config.num_speculative_tokens, max_tokens)
        if k <= 0:
            return ()
        hay = req.token_buffer()
        width = TOKEN_WIDTH
        n_tok = len(hay) // width
        for n in range(min(self.config.prompt_lookup_max, n_tok - 1),
                       self.config.prompt_lookup_min - 1, -1):
            needle = hay[(n_tok - n) * width:]
            # Search all but the suffix itself; a byte match must also be token aligned.
            end = (n_tok - 1) * width
            while True:
                at = hay.rfind(needle, 0, end)
                if at < 0:
                    break
                if at % width == 0:
                    start = (at // width + n) * width
                    return tuple(array("i", hay[start:start + k * width]))
                end = at + len(needle) - 1
        return ()


class Drafter:
    """The scheduler's side of speculative decoding: which rows get guesses, how
    many fit, and the acceptance counters (vLLM's ``spec_decode`` metrics)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: NgramProposer | SuffixProposer | None = None
        if config.method == "ngram":
            self.proposer = NgramProposer(config)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests, config.num_speculative_tokens,
                config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        # Per guess position (vLLM's ``num_accepted_tokens_per_pos``), and how many
        # drafts reached each position (suffix decoding's lengths vary).
        k = config.num_speculative_tokens
        self.accepted_per_pos, self.drafted_per_pos = [0] * k, [0] * k

    def active(self, num_running: int) -> bool:
        """Whether this step proposes at all (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def propose(self, req: Request, budget: int) -> tuple[int, ...]:
        """Guesses for a running sequence in decode, within ``budget`` extra tokens,
        its ``max_tokens`` and the model's length: every guess, if accepted, plus
        the sampler's own token must still fit."""
        if req.num_tokens - req.num_computed_tokens != 1 or req.pending_children \
                or req.beam is not None:
            # (A row that ends an n > 1 prompt samples for every sibling and forks them;
            # a beam's row reports candidates, its next token is its group's choice.)
            return ()
        room = self.max_model_len - req.num_tokens - 1
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        k = min(room, budget)
        if self.proposer is not None:
            return self.proposer.propose(req, k)
        held = req.draft_proposal  # (the token count it follows, the guesses)
        if held is None or held[0] != len(req.all_token_ids) or k <= 0:
            return ()
        return held[1][:k]

    def snapshot(self) -> dict[str, Any]:
        """The counters (per guess position too), and with suffix decoding the size of
        its response cache."""
        out: dict[str, Any] = dict(self.stats)
        out["num_accepted_tokens_per_pos"] = list(self.accepted_per_pos)
        out["num_draft_tokens_per_pos"] = list(self.drafted_per_pos)
        if isinstance(self.proposer, SuffixProposer):
            out["suffix_cached_requests"] = self.proposer.cache.num_requests
            out["suffix_cached_tokens"] = self.proposer.cache.num_tokens
        return out

    def release(self, req: Request) -> None:
        """A sequence ended: suffix decoding caches its response for later requests."""
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.release(req)

    def lookahead(self, req: Request, num_new: int) -> int:
        """Slots after the step that a draft model may write for this row: its
        guesses follow the token the row samples for itself, so rows that sample
        for siblings, beams, pooling rows and prompt chunks before the last get none."""
        if (not self.config.uses_draft_model or req.pending_children or req.beam is not None
                or req.pooling_params is not None
                or req.num_computed_tokens + num_new < req.num_tokens):
            return 0
        return self.config.num_lookahead

    def count(self, req: Request, drafts: tuple[int, ...], tokens: list[int]) -> int:
        """Check the runner's answer for a drafted row (accepted guesses, then its own
        token) and count it; returns the number of accepted guesses."""
        accepted = len(tokens) - 1
        if accepted < 0 or accepted > len(drafts) or tuple(tokens[:accepted]) != drafts[:accepted]:
            raise RuntimeError(f"runner answered {tokens} to the drafts {drafts} of "
                               f"{req.request_id}")
        self.stats["num_drafts"] += 1
        self.stats["num_draft_tokens"] += len(drafts)
        self.stats["num_accepted_tokens"] += accepted
        for i in range(len(drafts)):
            self.drafted_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        return accepted
