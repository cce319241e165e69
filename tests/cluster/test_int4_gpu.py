"""int4 weights on CUDA (``kernels.triton_w4a16``) through the engine: skipped without a
GPU, run by ``bash bench/gpu_check.sh`` in a GPU window. The CPU side of the same
settings (the config checks) runs in every CI run."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedserve.cluster import LLM, SamplingParams
from pagedserve.cluster.config import EngineConfig
from pagedserve.worker.testing import SMOLLM2_135M, write_random_checkpoint
from pagedserve.worker.testing_prequant import write_gptq

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(11 * j + 5 * i) % 30000 + 100 for j in range(n)]
           for i, n in enumerate((5, 17, 40, 130))]


def test_int4_is_the_only_quantization_on_cuda() -> None:
    EngineConfig(device="cuda", quantization="int4")
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only"):
        EngineConfig(device="cuda", quantization="int8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_int4_over_a_gptq_file_serves_its_weights(tmp_path: Path) -> None:
    """A GPTQ int4 file of a SmolLM2-shaped model, served on CUDA in bf16: dense (the file
    dequantised) and int4 (the file's codes, through the W4A16 GEMM, CUDA graphs on) give
    the same first tokens, int4 in under a third of the projection bytes."""
    src = write_random_checkpoint(tmp_path / "src", "llama", None,
                                  **{**SMOLLM2_135M, "num_hidden_layers": 4})
    qpath, _ = write_gptq(Path(src), tmp_path / "gptq", bits=4, group_size=64)
    runs, sizes = {}, {}
    for quant in (None, "int4"):
        llm = LLM(model=str(qpath), device="cuda", quantization=quant, num_gpu_blocks=256)
        try:
            runs[quant] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
            sizes[quant] = llm.engine.model_info["weight_bytes"]
            assert llm.engine.executor.worker.runner.graphs is not None
        finally:
            llm.shutdown()
            gc.collect()
            torch.cuda.empty_cache()
    # bf16 dots in another order may flip a near-tie: three of four first tokens at least.
    assert sum(a[0] == b[0] for a, b in zip(runs["int4"], runs[None], strict=True)) >= 3
    assert all(len(t) == 12 for t in runs["int4"])
    embed = SMOLLM2_135M["vocab_size"] * SMOLLM2_135M["hidden_size"] * 2  # tied, bf16
    assert sizes["int4"] - embed < (sizes[None] - embed) / 3
