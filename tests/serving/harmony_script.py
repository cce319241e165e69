"""A logits processor that makes a random model write a given answer, token by token
(``extra_args={"script": [ids]}``, HTTP's ``vllm_xargs``): the serving tests of the
harmony parser need exact GPT-OSS-shaped answers, with special tokens in them, which
neither ``logit_bias`` (one bias for every step) nor a grammar (refused under that
parser) can force. Loaded by import path in the engine replicas (Ray puts the
driver's working directory, the repository root, on their ``sys.path``)."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.logits_processors import AdapterLogitsProcessor, RequestLogitsProcessor

SCRIPT_PROCESSOR = "tests.serving.harmony_script:ScriptProcessor"


def _script(params: SamplingParams) -> list[int] | None:
    script: Any = (params.extra_args or {}).get("script")
    if script is not None and (not isinstance(script, list) or not script or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in script)):
        raise ValueError("extra_args.script must be a non-empty list of token ids")
    return script


class ScriptProcessor(AdapterLogitsProcessor):
    """Rows whose request set ``extra_args["script"]`` keep only the script's next
    token (its last one once the script is written out)."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _script(params)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams
                                 ) -> RequestLogitsProcessor | None:
        script = _script(params)
        if script is None:
            return None

        def force(outputs: list[int], row: torch.Tensor) -> torch.Tensor:
            token = script[min(len(outputs), len(script) - 1)]
            row.fill_(float("-inf"))
            row[token] = 0.0
            return row

        return force
