"""Structural tags (vLLM's ``structural_tag``, xgrammar's): the tagged part of the
default model's answer holds to its schema, in the current form and in the older
``structures`` / ``triggers`` one; bad tags are refused by field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from pagedserve.cluster import SamplingParams
from pagedserve.scheduler.sampling_params import StructuredOutputs
from pagedserve.worker.structured import check_structured_outputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"], "additionalProperties": False}
TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<tool>"},
    {"type": "json_schema", "json_schema": SCHEMA},
    {"type": "const_string", "value": "</tool>"}]}}


def ask(llm: Any, tag: dict[str, Any] | str, **kw: Any) -> str:
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Call the tool."}],
        tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_outputs=StructuredOutputs(structural_tag=tag), **kw)
    return llm.generate(prompt, params)[0].outputs[0].text


def test_a_tagged_call_holds_to_its_schema(smol_llm: Any) -> None:
    text = ask(smol_llm, json.dumps(TAG))
    assert text.startswith("<tool>") and text.endswith("</tool>")
    call = json.loads(text[len("<tool>"):-len("</tool>")])
    assert set(call) == {"city"} and 0 < len(call["city"]) <= 12, call


def test_the_older_form_triggers_its_structures(smol_llm: Any) -> None:
    """Text is free until a trigger; then the structure's begin, schema and end. A
    bias towards ``<`` makes the model start one at once, and again after it."""
    legacy = {"structures": [{"begin": "<tool>", "schema": SCHEMA, "end": "</tool>"}],
              "triggers": ["<"]}
    lt = smol_llm.get_tokenizer().encode("<")[0]
    text = ask(smol_llm, legacy, logit_bias={lt: 30.0})
    first = re.match(r"<tool>(\{.*?\})</tool>", text, re.S)
    assert first is not None, text
    assert set(json.loads(first.group(1))) == {"city"}
    assert text[first.end():].startswith("<tool>{")  # the next one holds to it too


@pytest.mark.parametrize("tag,match", [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized"),
    ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]},
     r"structures\[0\] needs begin and end strings and a schema object"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": []},
     "triggers must be a non-empty list"),
])
def test_bad_tags_are_refused_by_field(tag: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_structured_outputs(StructuredOutputs(structural_tag=tag))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(regex="a", structural_tag=json.dumps(TAG))
