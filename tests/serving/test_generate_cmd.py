"""``pagedserve generate`` as a user runs it (a real process, the offline engine), and
its refusals before any model loads (in process)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.serving.test_cli import CLI, _env

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_generate_prints_the_completion(tiny_model: Path) -> None:
    """With n-gram speculative decoding on: greedy text equals a plain engine's."""
    from pagedserve.cluster import LLM, SamplingParams

    out = subprocess.run([*CLI, "generate", "--model", str(tiny_model), "--raw",
                          "--max-tokens", "8", "--num-gpu-blocks", "32",
                          "--speculative-config", '{"method": "ngram"}', "Hello world"],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    llm = LLM(model=str(tiny_model), num_gpu_blocks=32)
    try:
        (ref,) = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        llm.shutdown()
    assert out.stdout.rstrip("\n") == ref.outputs[0].text


def test_generate_with_a_lora_adapter(tiny_model: Path, tmp_path: Path) -> None:
    """``--lora PATH`` gives the offline engine's text with that adapter; a directory that
    is no adapter is a clear error (exit 2, no traceback)."""
    from pagedserve.cluster import LLM, LoRARequest, SamplingParams
    from pagedserve.worker.testing import write_random_lora

    adapter = write_random_lora(tiny_model, tmp_path / "adapter", ["q_proj", "v_proj"], r=4)
    args = [*CLI, "generate", "--model", str(tiny_model), "--raw", "--max-tokens", "8",
            "--num-gpu-blocks", "32"]
    out = subprocess.run([*args, "--lora", adapter, "Hello world"], capture_output=True,
                         text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    llm = LLM(model=str(tiny_model), num_gpu_blocks=32, enable_lora=True, max_lora_rank=4)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        (ref,) = llm.generate("Hello world", params,
                              lora_request=LoRARequest("adapter", 1, adapter))
        (base,) = llm.generate("Hello world", params)
    finally:
        llm.shutdown()
    assert out.stdout.rstrip("\n") == ref.outputs[0].text != base.outputs[0].text
    bad = subprocess.run([*args, "--lora", str(tmp_path), "Hello world"], capture_output=True,
                         text=True, timeout=300, env=_env())
    assert bad.returncode == 2 and "adapter_config.json" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--temperature", "-3", "temperature"),
    ("--min-p", "2", "min_p"),
    ("--dtype", "int8", "dtype"),
    ("--kv-cache-dtype", "int4", "kv_cache_dtype"),
    ("--gpu-memory-utilization", "1.5", "gpu_memory_utilization"),
    ("--kv-offloading-size", "-1", "kv_offloading_size"),
    ("--speculative-config", '{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ("--speculative-config", "ngram", "--speculative-config: not JSON"),
    ("--speculative-config", '{"method": "suffix", "suffix_decoding_max_tree_depth": 0}',
     "suffix_decoding_max_tree_depth"),
    ("--batch-invariant", "--device=cuda", "batch_invariant"),
    ("--long-prefill-token-threshold", "-5", "long_prefill_token_threshold"),
])
def test_generate_rejects_bad_settings(flag: str, value: str, field: str,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """In process (a subprocess spends ~4 s importing torch and Ray for each case): exit
    code 2 and the field named, before any model loads. The serve cases below run the
    real process."""
    from pagedserve.cluster import cli

    def no_model(**kw: object) -> None:
        raise AssertionError(f"a model was loaded despite {flag} {value}")

    monkeypatch.setattr("pagedserve.cluster.llm.LLM", no_model)
    try:
        code = cli.main(["generate", flag, value, "hi"])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2 and field in capsys.readouterr().err
