"""``pagedserve generate``: prompts from the command line through the offline engine.

The engine's flags are the ones ``serve`` takes (``cli._engine_flags``); a bad setting
is refused before the model loads, an adapter (``--lora``) before the first prompt.
Prompts go through the chat template where the model has one (``--raw``: not).
"""

from __future__ import annotations

import argparse
import os
import sys


def generate(args: argparse.Namespace) -> int:
    """Run ``args.prompt`` and print each sample's text; 2 (and the reason on stderr)
    for a setting or adapter the engine refuses."""
    from pagedserve.cluster.config import EngineConfig
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.lora_request import LoRARequest
    from pagedserve.scheduler.sampling_params import SamplingParams

    engine_kwargs = dict(
        model=args.model, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, device=args.device,
        pipeline_layer_partition=args.pipeline_layer_partition,
        max_concurrent_batches=args.max_concurrent_batches,
        dtype=args.dtype, num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_threads=args.num_threads, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, speculative_config=args.speculative_config,
        enable_lora=args.lora is not None, max_lora_rank=args.max_lora_rank,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        kv_offloading_size=args.kv_offloading_size,
        quantization=args.quantization, batch_invariant=args.batch_invariant,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_placement_strategy=args.expert_placement_strategy,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        allowed_local_media_path=args.allowed_local_media_path,
        mm_processor_kwargs=args.mm_processor_kwargs,
        logits_processors=args.logits_processors, hf_overrides=args.hf_overrides)
    lora = None
    try:
        if args.lora is not None:
            lora = LoRARequest(os.path.basename(os.path.normpath(args.lora)) or "lora", 1,
                               os.path.abspath(args.lora))
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens,
                                temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed)
        EngineConfig(**engine_kwargs)  # a bad setting fails here, before the model loads
    except ValueError as e:
        print(f"pagedserve generate: {e}", file=sys.stderr)
        return 2
    llm = LLM(**engine_kwargs)
    try:
        if lora is not None:
            try:
                llm.engine.add_lora(lora)
            except ValueError as e:
                print(f"pagedserve generate: {e}", file=sys.stderr)
                return 2
        chat = not args.raw and getattr(llm.get_tokenizer(), "chat_template", None)
        if chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                            lora_request=lora)
        else:
            outs = llm.generate(list(args.prompt), params, lora_request=lora)
        for out in outs:
            for sample in out.outputs:
                print(sample.text, flush=True)
    finally:
        llm.shutdown()
    return 0
