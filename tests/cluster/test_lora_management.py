"""Managing LoRA adapters through the real engine: bad adapters and bad uses are
``ValueError``s that leave the engine usable and the pool at baseline; removal
is refused while in use; at most ``max_loaded_loras`` stay loaded (LRU); what
CUDA profiling reserves per adapter is what one takes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pagedserve.cluster import LLM, LoRARequest
from tests.cluster.lora_fixtures import (
    ALL7,
    GREEDY,
    PROMPTS,
    _tokens,
    expected,
    mixed_batch,
    write_adapter,
)
from tests.cluster.test_engine_behaviour import assert_pool_at_baseline


def _edited(src: str, dest: Path, **config: Any) -> str:
    """A copy of adapter ``src`` with its adapter_config.json fields replaced."""
    shutil.copytree(src, dest)
    cfg_path = dest / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config}))
    return str(dest)


def _renamed(src: str, dest: Path, old: str, new: str | None) -> str:
    """A copy of adapter ``src`` with tensor keys containing ``old`` renamed (None: dropped)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    f = dest / "adapter_model.safetensors"
    tensors = load_file(str(f))
    save_file({k if old not in k else k.replace(old, new): t for k, t in tensors.items()
               if new is not None or old not in k}, str(f))
    return str(dest)


def _truncated(src: str, dest: Path) -> str:
    """A copy of adapter ``src`` whose weights file is cut in half (a broken download)."""
    shutil.copytree(src, dest)
    f = dest / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return str(dest)


def test_bad_adapters_and_bad_uses_are_value_errors(tmp_path, tiny_llama_dir, llama_loras,
                                                    llama_refs) -> None:
    good = llama_loras["all7"].lora_path
    bad: list[tuple[str, str]] = [
        (write_adapter(tiny_llama_dir, tmp_path / "r16", 6, ["q_proj"], r=16), "max_lora_rank"),
        (str(tmp_path / "missing"), "adapter_config.json"),
        (_edited(good, tmp_path / "dora", use_dora=True), "use_dora"),
        (_edited(good, tmp_path / "bias", bias="all"), "bias"),
        (_edited(good, tmp_path / "fan", fan_in_fan_out=True), "fan_in_fan_out"),
        (write_adapter(tiny_llama_dir, tmp_path / "mts", 6, ["q_proj"],
                       modules_to_save=["lm_head"]), "modules_to_save"),
        (write_adapter(tiny_llama_dir, tmp_path / "head", 6, ["q_proj", "lm_head"]),
         "lm_head"),
        (write_adapter(tiny_llama_dir, tmp_path / "emb", 6, ["embed_tokens"]), "embed_tokens"),
        (_renamed(good, tmp_path / "layer", "layers.1.", "layers.5."), "layer 5"),
        (_renamed(good, tmp_path / "noB", "layers.0.mlp.up_proj.lora_B", None),
         "without its pair"),
        (_truncated(good, tmp_path / "cut"), "cannot read the adapter weights"),
    ]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks=64)
    try:
        for i, (path, message) in enumerate(bad):
            with pytest.raises(ValueError, match=message):
                llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(f"bad{i}", 10 + i, path))
            assert llm.engine.list_loras() == []
            assert_pool_at_baseline(llm)
        all7 = llama_loras["all7"]
        assert llm.engine.add_lora(all7) and not llm.engine.add_lora(all7)
        with pytest.raises(ValueError, match="lora_int_id 1"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("other", 1,
                                                                   str(tmp_path / "r16")))
        with pytest.raises(ValueError, match="lora_name 'all7'"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("all7", 9, all7.lora_path))
        # One bad adapter late in a batch withdraws the whole batch.
        with pytest.raises(ValueError, match="use_dora"):
            llm.generate(PROMPTS[:2], GREEDY, lora_request=[
                all7, LoRARequest("dora", 20, str(tmp_path / "dora"))])
        assert llm.engine.list_loras() == [all7]
        assert_pool_at_baseline(llm)
        outs = llm.generate(PROMPTS, GREEDY, lora_request=all7)
        assert _tokens(outs) == llama_refs["all7"]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_lora_request_without_enable_lora_is_a_value_error(tiny_llama_dir, llama_loras
                                                           ) -> None:
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=64)
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate(PROMPTS, GREEDY, lora_request=llama_loras["all7"])
        with pytest.raises(ValueError, match="enable_lora"):
            llm.engine.add_lora(llama_loras["all7"])
        assert_pool_at_baseline(llm)
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == 16
    finally:
        llm.shutdown()


def test_remove_lora_is_refused_while_a_request_uses_it(tiny_llama_dir, llama_loras,
                                                        llama_refs) -> None:
    a = llama_loras["qv_rs"]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64)
    engine = llm.engine
    try:
        engine.add_request(PROMPTS[1], GREEDY, request_id="busy", lora_request=a)
        engine.step()
        with pytest.raises(ValueError, match="in use by 1"):
            engine.remove_lora("qv_rs")
        assert engine.list_loras() == [a]
        assert engine.abort_request("busy")
        assert engine.remove_lora(a.lora_int_id) is True  # by id, as vLLM's
        assert engine.remove_lora("qv_rs") is False and engine.remove_lora(2) is False
        assert engine.list_loras() == []
        assert_pool_at_baseline(llm)
        # A request naming it loads it again.
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=a)) == llama_refs["qv_rs"]
        assert engine.list_loras() == [a]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_a_name_moved_to_another_path_drops_its_old_adapter_when_idle(
        tiny_llama_dir, llama_loras, llama_refs) -> None:
    """What a replica does when the ingress serves a name from a new directory
    (``/v1/load_lora_adapter`` with ``load_inplace``): refused while requests use the
    old adapter, then the old one is unloaded and the new one serves the name."""
    names = sorted(llama_loras)
    old, new = llama_loras[names[0]], llama_loras[names[1]]
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64)
    engine = llm.engine
    try:
        loras = engine.loras
        first = loras.resolve("moving", old.lora_path)
        engine.add_request(PROMPTS[1], GREEDY, request_id="busy", lora_request=first)
        engine.step()
        with pytest.raises(ValueError, match="in use"):
            loras.resolve("moving", new.lora_path)
        assert engine.abort_request("busy")
        moved = loras.resolve("moving", new.lora_path)
        assert moved.lora_int_id != first.lora_int_id and moved.lora_path == new.lora_path
        assert first not in engine.list_loras()
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=moved))
        assert got == llama_refs[names[1]]
        assert [lr.lora_name for lr in engine.list_loras()] == ["moving"]
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()


def test_the_least_recently_used_idle_adapter_is_unloaded_to_make_room(
        tiny_llama_dir, llama_loras, llama_refs) -> None:
    """``max_loaded_loras``: one more adapter unloads the LRU idle one, which its next
    request loads again; busy adapters are never unloaded (the cap waits for them)."""
    names = list(llama_loras)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=64,
              max_loaded_loras=2)
    engine = llm.engine
    try:
        for name in [*names, names[0]]:  # all7, qv_rs, pattern (unloads all7), all7 again
            outs = llm.generate(PROMPTS, GREEDY, lora_request=llama_loras[name])
            assert _tokens(outs) == llama_refs[name], name
            assert len(engine.list_loras()) <= 2
        assert [r.lora_name for r in engine.list_loras()] == ["all7", "pattern"]  # by id
        lora = engine.get_stats()["lora"]
        assert lora["evictions"] == 2 and lora["num_loaded"] == 2  # all7, then qv_rs out
        # All three busy at once: nothing idle to unload, so all three are loaded.
        prompts, per_prompt = mixed_batch([None, *llama_loras.values()])
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=per_prompt)) == \
            expected(llama_refs, [None, *llama_loras.values()])
        assert len(engine.list_loras()) == 3
        assert_pool_at_baseline(llm)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_loaded_loras"):
        LLM(model=tiny_llama_dir, enable_lora=True, max_loras=3, max_loaded_loras=2)


def test_adapter_bytes_is_what_a_full_rank_adapter_takes(tmp_path, tiny_llama_dir,
                                                         monkeypatch) -> None:
    """What CUDA profiling keeps out of the KV pool per loaded adapter: exactly the
    device bytes of an adapter of rank ``max_lora_rank`` on all seven projections
    (in the torch form CUDA uses; the CPU's native kernel keeps pieces instead)."""
    from pagedserve.kernels import cpu_lora

    monkeypatch.setattr(cpu_lora, "available", lambda device, dtype: False)
    llm = LLM(model=tiny_llama_dir, enable_lora=True, max_lora_rank=8, num_gpu_blocks=16)
    try:
        worker = llm.engine.executor.worker
        assert worker.config.max_loaded_loras == 16
        path = write_adapter(tiny_llama_dir, tmp_path / "full", 7, ALL7, r=8)
        llm.engine.add_lora(LoRARequest("full", 1, path))
        manager = worker.lora
        held = sum(a.nbytes + b.nbytes for m in manager._modules()
                   for a, b in m.lora.adapters.values())
        assert held == manager.adapter_bytes() > 0
    finally:
        llm.shutdown()
