"""Structured outputs through the engine: regex, choice, JSON schema, JSON object and
EBNF grammar constraints hold for every sample, including seeded ``n > 1``, preemption and a
restarted sampler; bad constraints are a ``ValueError`` naming the field."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.scheduler.sampling_params import StructuredOutputs
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object",
          "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
          "required": ["answer", "count"], "additionalProperties": False}


def _check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"answer", "count"} and obj["answer"] in ("yes", "no")
    assert isinstance(obj["count"], int)


BRACKETS = """root ::= seq "."
seq ::= "" | item seq
item ::= "(" seq ")" | "[" seq "]"
"""


def _balanced(text: str) -> bool:
    stack: list[str] = []
    for ch in text:
        if ch in "([":
            stack.append(ch)
        elif not stack or {"(": ")", "[": "]"}[stack.pop()] != ch:
            return False
    return not stack


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_constraints_hold_for_every_sample(tiny_llama_dir, spec) -> None:
    """A random model (SmolLM2's tokenizer) would write anything: the masks decide,
    also on positions after speculative guesses."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=96, speculative_config=spec)
    try:
        regex = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12,
                               structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-c]"))
        choice = SamplingParams(temperature=1.0, seed=4, n=4, max_tokens=8,
                                structured_outputs=StructuredOutputs(
                                    choice=("Paris", "London", "New York")))
        schema = SamplingParams(temperature=0.7, seed=5, max_tokens=64,
                                structured_outputs=StructuredOutputs(json=SCHEMA))
        greedy = SamplingParams(temperature=0.0, max_tokens=12,
                                structured_outputs=StructuredOutputs(regex=r"(ab|cd)+!"))
        # A context-free language no regex states: balanced brackets, then a period.
        grammar = SamplingParams(temperature=1.0, seed=6, n=2, max_tokens=24,
                                 structured_outputs=StructuredOutputs(grammar=BRACKETS))
        outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]],
                            [regex, choice, schema, greedy, grammar])
        for sample in outs[0].outputs:
            assert re.fullmatch(r"[0-9]{3}-[a-c]", sample.text), sample.text
            assert sample.finish_reason == "stop"
        assert {s.text for s in outs[1].outputs} <= {"Paris", "London", "New York"}
        sample = outs[2].outputs[0]
        if sample.finish_reason == "length":  # a random model's integer can run that long
            assert re.fullmatch(r'\{"answer": "(yes|no)", "count": -?[0-9]*', sample.text)
        else:
            _check_schema(sample.text)
        text = outs[3].outputs[0].text  # whole, or a prefix of one when cut at max_tokens
        assert re.fullmatch(r"(ab|cd)+!", text) or (
            outs[3].outputs[0].finish_reason == "length" and re.fullmatch(r"(ab|cd)*[ac]?", text))
        for sample in outs[4].outputs:
            if sample.finish_reason == "stop":
                assert _balanced(sample.text[:-1]) and sample.text.endswith("."), sample.text
            else:  # cut at max_tokens: a prefix of a sentence of the language
                assert re.fullmatch(r"[()\[\]]*", sample.text), sample.text
        # A seeded constrained sample is the same alone as in that batch.
        alone = llm.generate([[5, 6, 7]], regex)[0]
        assert [s.text for s in alone.outputs] == [s.text for s in outs[0].outputs]
        # Finished ids reach the worker with the next plan: then every matcher is gone.
        llm.generate([[3, 4]], SamplingParams(max_tokens=2))
        assert llm.engine.executor.worker.runner.sampler._book.num_tracked == 0
        assert_pool_at_baseline(llm)
        if spec is not None:
            assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_ignore_eos_after_a_complete_output_keeps_emitting_eos(tiny_llama_dir) -> None:
    """A finished grammar must not crash the step (xgrammar refuses a terminated matcher)."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=32)
    try:
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=10, ignore_eos=True,
                                structured_outputs=StructuredOutputs(regex="[0-9]{3}"))
        out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
        eos = set(llm.engine.eos_token_ids)
        assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "length"
        assert set(out.token_ids[3:]) <= eos and len(out.token_ids) == 10
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode,spec", [("swap", None), ("recompute", None), ("swap", NGRAM)])
def test_constraints_survive_preemption(tiny_llama_dir, mode: str, spec) -> None:
    """A tiny pool preempts mid-output; the grammar state follows the kept tokens."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=10, block_size=4, preemption_mode=mode,
              max_num_seqs=4, speculative_config=spec)
    try:
        params = SamplingParams(temperature=0.8, seed=11, max_tokens=30,
                                structured_outputs=StructuredOutputs(regex=r"[a-z]{4,20}\."))
        prompts = [[20 + i] * (3 + i) for i in range(4)]
        outs = llm.generate(prompts, params)
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
        for o in outs:
            sample = o.outputs[0]
            assert re.fullmatch(r"[a-z]{4,20}\.", sample.text) or sample.finish_reason == "length"
            assert re.fullmatch(r"[a-z]{0,20}\.?", sample.text), sample.text
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_new_sampler_replays_the_history(tiny_llama_dir) -> None:
    """After a worker restart the plan's output history brings a fresh matcher up to date."""
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        params = SamplingParams(temperature=1.0, seed=21, max_tokens=16,
                                structured_outputs=StructuredOutputs(regex=r"[0-9]{6}"))
        rid = llm.engine.add_request([5, 6, 7], params)
        for _ in range(3):
            llm.engine.step()
        runner = llm.engine.executor.worker.runner
        runner.sampler._book = None  # as if rank 0 had been restarted
        runner.sampler._counts.clear()
        done = {}
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert re.fullmatch(r"[0-9]{6}", done[rid].outputs[0].text), done[rid].outputs[0].text
    finally:
        llm.shutdown()


def test_default_model_answers_in_the_schema(smol_llm) -> None:
    messages = [{"role": "user", "content": "Is Paris the capital of France? Answer in JSON."}]
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    out = smol_llm.chat(messages, params)[0].outputs[0]
    assert out.finish_reason == "stop"
    _check_schema(out.text)
    obj = smol_llm.chat(messages, SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputs(json_object=True)))
    assert obj[0].outputs[0].finish_reason == "length" or isinstance(
        json.loads(obj[0].outputs[0].text), dict)


def test_greedy_constrained_output_is_the_same_with_guesses(smol_llm) -> None:
    """Extraction quotes the prompt: guesses are accepted inside the grammar, and the
    greedy JSON equals plain decoding's."""
    schema = {"type": "object", "properties": {"quote": {"type": "string"},
                                               "author": {"type": "string"}},
              "required": ["quote", "author"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Return JSON with the sentence in 'quote' and "
                 "who said it in 'author': Albert Einstein said that imagination is more "
                 "important than knowledge."}]
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputs(json=schema))
    plain = smol_llm.chat(messages, params)[0].outputs[0]
    llm = LLM(num_gpu_blocks=64, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 4})
    try:
        spec = llm.chat(messages, params)[0].outputs[0]
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert set(json.loads(spec.text)) == {"quote", "author"}
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_bad_constraints_raise_value_error(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=())
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValueError, match="grammar"):
        StructuredOutputs(grammar="  ")
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=16)
    try:
        for spec in (StructuredOutputs(regex="(unclosed"),
                     StructuredOutputs(json={"type": "no-such-type"}),
                     StructuredOutputs(grammar='root ::= "a" undefined_rule')):
            with pytest.raises(ValueError, match="structured_outputs") as e:
                llm.generate([[5, 6]], SamplingParams(structured_outputs=spec))
            assert ".cc:" not in str(e.value), e.value  # the reason, not xgrammar's source
        with pytest.raises(ValueError, match='structured_outputs: Unsupported type "no-such'):
            llm.generate([[5]], SamplingParams(structured_outputs=StructuredOutputs(
                json={"type": "no-such-type"})))
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fmt", ["qwen3", "deepseek_r1"])
def test_a_constraint_can_follow_a_thought(fmt: str) -> None:
    """``StructuredOutputs.reasoning``: the grammar lets a thought in the format come
    first (any text without ``</think>`` inside, even tag fragments and non-ASCII), then
    blanks, then the constraint; qwen3 may skip the thought, deepseek_r1 must close it."""
    import xgrammar as xgr

    from pagedserve.worker.loaders import load_tokenizer, resolve_model
    from pagedserve.worker.structured import GrammarBook

    tok = load_tokenizer(resolve_model(None))
    book = GrammarBook(tok, 49152, [tok.eos_token_id])
    spec = StructuredOutputs(regex="[0-9]{2}", reasoning=fmt)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(book._compile(spec))
        ok = all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and m.accept_token(tok.eos_token_id)

    thought = "<think>is it < 50? </thin and </think no, é so 42</think>\n\n42"
    assert accepts(thought) and accepts(thought.replace("\n\n", " "))
    assert not accepts("<think>a</think>b") and not accepts("<think>a</think>42</think>")
    assert accepts("42") == (fmt == "qwen3")
    assert accepts("just thinking</think>42") == (fmt == "deepseek_r1")


def test_the_default_model_thinks_then_answers_in_the_constraint(smol_llm) -> None:
    """The thought's tags pushed by logit_bias (qwen3's: an opening tag the model must
    write itself): the answer after them still obeys the regex, and the reasoning
    parser of the same name splits it off. (deepseek_r1's grammar is checked above.)"""
    fmt = "qwen3"
    from pagedserve.cluster.reasoning import split_reasoning

    tok = smol_llm.get_tokenizer()
    bias = dict.fromkeys(tok.encode("</think>", add_special_tokens=False), 30.0)
    bias.update(dict.fromkeys(tok.encode("<", add_special_tokens=False), 10.0))
    params = SamplingParams(temperature=0.0, max_tokens=40, logit_bias=bias,
                            structured_outputs=StructuredOutputs(regex="(Paris|Rome)[.]",
                                                                 reasoning=fmt))
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        params)[0].outputs[0]
    thought, content = split_reasoning(fmt, out.text)
    assert out.finish_reason == "stop" and thought is not None, out.text
    assert re.fullmatch(r"\s*(Paris|Rome)[.]", content), out.text
    assert_pool_at_baseline(smol_llm)
