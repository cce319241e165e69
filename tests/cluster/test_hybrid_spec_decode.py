"""Speculative decoding on hybrid recurrent models (``worker.mamba_state``): a row that
verifies guesses keeps its state after each one, and the step after a rejection
starts from the state after the last guess kept.

Through the engine, on files transformers' own classes wrote, for each kind of mixer
(Mamba-2: Granite 4.0-H; gated DeltaNet: Qwen3-Next; short convolution: LFM2): an
oracle proposer that knows Hugging Face's greedy continuation guesses it with one
token wrong, at a position that cycles through every guess (and sometimes none), so
every rollback point is taken; the tokens equal HF's, with prompts chunked beside
verifying rows. On Granite also under swap preemption, with a prefix-cache hit
(``mamba_cache_mode="align"``), seeded sampling (the same draws as without guesses),
and a real (unrelated, mostly rejected) draft model. The slot bookkeeping is checked
directly, and what still cannot draft for these models is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.scheduler.request import Request
from pagedserve.worker.mamba_state import MambaStates
from pagedserve.worker.testing import write_random_checkpoint
from tests.cluster.conftest import hf_greedy
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline
from tests.cluster.test_hf_parity import prompts_of_mixed_lengths

K = 3
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": K}


class OracleProposer:
    """Guesses a request's reference continuation with the token at one position
    wrong; the position cycles through ``0 .. K`` (``K``: every guess right)."""

    def __init__(self, prompts: list[list[int]], refs: list[list[int]]) -> None:
        self.refs = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}
        self.calls = 0

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        ref = self.refs[tuple(req.prompt_token_ids)]
        done = len(req.all_token_ids) - req.num_prompt_tokens
        guesses = list(ref[done:done + min(k, K)])
        wrong = self.calls % (K + 1)
        self.calls += 1
        if wrong < len(guesses):
            guesses[wrong] += 1
        return tuple(guesses)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def hybrid_prompts() -> list[list[int]]:
    return [*prompts_of_mixed_lengths(4), [(5 * j) % 4000 + 100 for j in range(70)]]


def _reference(tmp_path_factory, tokenizer_dir: str, kind: str) -> tuple[str, list, list]:
    path = write_random_checkpoint(tmp_path_factory.mktemp(kind), kind, tokenizer_dir)
    prompts = hybrid_prompts()
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def granite(tmp_path_factory, default_model_dir) -> tuple[str, list, list]:
    return _reference(tmp_path_factory, default_model_dir, "granitemoehybrid")


def _oracle_llm(path: str, prompts: list, ref: list, **kw) -> LLM:
    llm = LLM(model=path, block_size=4, speculative_config=SPEC,
              **{"num_gpu_blocks": 160, **kw})
    llm.engine.scheduler.drafter.proposer = OracleProposer(prompts, ref)
    return llm


def assert_every_rollback_taken(llm: LLM) -> None:
    s = llm.engine.get_stats()["spec_decode"]
    assert s["num_drafts"] >= 8 and 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s
    # Some drafts kept 0, 1, 2 and 3 guesses: each count reached and rejected next.
    kept = s["num_accepted_tokens_per_pos"]
    assert kept[0] > kept[1] > kept[2] > 0, s


@pytest.mark.parametrize("kind", ["granitemoehybrid", "qwen3_next", "lfm2", "falcon_h1",
                                  "jamba", "falcon_mamba"])
def test_oracle_guesses_give_hugging_faces_tokens(kind, tmp_path_factory, default_model_dir,
                                                  granite) -> None:
    path, prompts, ref = granite if kind == "granitemoehybrid" else _reference(
        tmp_path_factory, default_model_dir, kind)
    # 16-token steps: the long prompt runs in chunks beside rows verifying guesses.
    llm = _oracle_llm(path, prompts, ref, max_num_batched_tokens=16)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert_every_rollback_taken(llm)
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [
    {"num_gpu_blocks": 28, "preemption_mode": "swap"},
    {"enable_prefix_caching": True, "mamba_cache_mode": "align"},
])
def test_swaps_and_prefix_hits_keep_the_rolled_back_state(granite, kw) -> None:
    path, prompts, ref = granite
    llm = _oracle_llm(path, prompts, ref, **kw)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        if "preemption_mode" in kw:
            assert llm.engine.scheduler.num_preemptions["swap"] > 0
        else:  # the same prompts again: hits resume from the prompts' snapshots
            assert _tokens(llm.generate(prompts, GREEDY)) == ref
            assert sum(o.num_cached_tokens for o in llm.generate(prompts, GREEDY)) > 0
        assert_every_rollback_taken(llm)
    finally:
        llm.shutdown()


def test_seeded_sampling_draws_what_it_draws_without_guesses(granite) -> None:
    path, prompts, _ = granite
    params = [SamplingParams(temperature=1.0, top_k=8, seed=7 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(model=path, num_gpu_blocks=160, block_size=4)
    try:
        want = _tokens(plain.generate(prompts, params))
    finally:
        plain.shutdown()
    llm = _oracle_llm(path, prompts, want)
    try:
        assert _tokens(llm.generate(prompts, params)) == want
        assert_every_rollback_taken(llm)
    finally:
        llm.shutdown()


def test_a_draft_model_drafts_for_a_hybrid(granite, tmp_path, default_model_dir) -> None:
    path, prompts, ref = granite
    draft = write_random_checkpoint(tmp_path / "draft", "llama", default_model_dir, seed=5,
                                    num_hidden_layers=1)
    llm = LLM(model=path, num_gpu_blocks=160, block_size=4,
              speculative_config={"model": draft, "num_speculative_tokens": K})
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        s = llm.engine.get_stats()["spec_decode"]
        assert s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] < s["num_draft_tokens"]
    finally:
        llm.shutdown()


def test_what_cannot_draft_for_a_hybrid_is_refused(granite) -> None:
    path = granite[0]
    with pytest.raises(ValueError, match="'eagle' is not supported for recurrent"):
        LLM(model=path, num_gpu_blocks=32,
            speculative_config={"method": "eagle", "model": path})
    with pytest.raises(ValueError, match="'granitemoehybrid' has no multi-token-prediction"):
        LLM(model=path, num_gpu_blocks=32, speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="hybrid recurrent model cannot draft"):
        LLM(model=path, num_gpu_blocks=32,
            speculative_config={"model": path, "num_speculative_tokens": K})


def _row(rid: str, start: int, n: int, drafts: int = 0, back: int | None = None
         ) -> ScheduledRequest:
    r = ScheduledRequest(rid, list(range(n)), start, [], [rid], {})
    r.draft_token_ids = tuple(range(drafts))
    r.draft_state = back
    return r


def test_rows_verifying_guesses_run_a_position_at_a_time_and_roll_back() -> None:
    states = MambaStates((2, 1), (1, 1, 1), 1, torch.float32, torch.device("cpu"),
                         capacity=4, guesses=K)
    states.step([_row(r, 0, 2) for r in "abcd"])
    # Rows: a decodes, b verifies 3 guesses, c a prompt chunk, d 1 guess.
    step = states.step([_row("a", 2, 1), _row("b", 2, 4, 3), _row("c", 2, 5),
                        _row("d", 2, 2, 1)])
    slot = states.slot_of
    assert step.multi == [(5, 5, slot["c"])]
    got = [(rows.tolist(), slots.tolist()) for rows, slots in step.batches]
    assert got == [([0, 1, 10], [slot["a"], slot["b"], slot["d"]]),
                   ([2, 11], [slot["b"], slot["d"]]), ([3], [slot["b"]]), ([4], [slot["b"]])]
    # Kept after positions 0, 1, 2: rows with a guess past them (b; d after 0 only).
    assert [k.tolist() for k in step.kept] == [[slot["b"], slot["d"]], [slot["b"]],
                                               [slot["b"]]]
    for j in range(4):  # (a mixer's update: the state counts the positions it ran)
        states.ssm[0][slot["b"]].fill_(10 + j)
        states.conv[0][slot["b"]].fill_(20 + j)
        step.keep(0, j)
    states.step([_row("b", 4, 1, back=1)])  # two of the four kept: the state after guess 1
    assert float(states.ssm[0][slot["b"]]) == 11 and float(states.conv[0][slot["b"]][0, 0]) == 21
    with pytest.raises(ValueError, match="verifies 4 draft tokens"):
        states.step([_row("b", 5, 5, 4)])
    with pytest.raises(ValueError, match="no state kept after 3 guesses"):
        states.step([_row("b", 5, 1, back=3)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["granitemoehybrid", "qwen3_next"])
def test_oracle_guesses_on_cuda_give_hugging_faces_tokens(kind, tmp_path) -> None:
    """The per-guess loop on CUDA (Mamba-2's torch update, DeltaNet's Triton kernel, the
    kept states copied on the device) against HF on the same device."""
    path = write_random_checkpoint(tmp_path / kind, kind, None)
    prompts = hybrid_prompts()
    ref = hf_greedy(path, prompts, MAX_TOKENS, device="cuda")
    llm = LLM(model=path, device="cuda", dtype="float32", num_gpu_blocks=256, block_size=16,
              attention_backend="triton", max_num_batched_tokens=32, speculative_config=SPEC)
    try:
        llm.engine.scheduler.drafter.proposer = OracleProposer(prompts, ref)
        assert _tokens(llm.generate(prompts, GREEDY)) == ref
        assert_every_rollback_taken(llm)
    finally:
        llm.shutdown()
