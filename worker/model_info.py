"""The facts a loaded rank reports to the engine (``Worker.get_model_info``): what the
scheduler, detokeniser, KV sizing and ``/v1/models`` read, in one plain dict that
crosses Ray as it is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.kernels.kv_quant import kv_dtype_name
from pagedserve.worker.pipeline import layer_partition
from pagedserve.worker.pooling_config import default_pooling_type

if TYPE_CHECKING:
    from pagedserve.worker.worker import Worker


def model_info(worker: Worker) -> dict[str, Any]:
    """EOS ids, max length, vocab, KV geometry, sizes (``load_model`` must have run)."""
    mc = worker.model_config
    if mc is None or worker.resolved is None:
        raise RuntimeError("load_model must be called before get_model_info")
    return {
        "model_id": worker.resolved.model_id,
        "model_path": worker.resolved.path,
        "source": worker.resolved.source,
        "model_type": mc.model_type,
        "embedding_only": mc.embedding_only,
        # A BERT-family encoder (no KV cache, whole prompts) and the pooling a request
        # gets when it names none (``pooling_config``).
        "encoder": mc.encoder is not None,
        "pooling_type": default_pooling_type(worker.resolved.path, mc),
        # The widths ``dimensions`` may cut an embedding to (a list; True: any, False:
        # none; None: the file does not say, and any is taken).
        "matryoshka": list(mc.matryoshka) if isinstance(mc.matryoshka, tuple)
        else mc.matryoshka,
        # A sequence classifier's labels and activations (None: not a classifier).
        "classifier": mc.classifier.info() if mc.classifier is not None else None,
        # A ColBERT / BGE-M3 file's per-token heads and the tasks they serve (None: none).
        "multi_vector": mc.encoder.multi_vector.info()
        if mc.encoder is not None and mc.encoder.multi_vector is not None else None,
        "eos_token_ids": list(mc.eos_token_ids),
        "bos_token_id": mc.bos_token_id,
        "max_model_len": mc.max_model_len,
        "vocab_size": mc.vocab_size,
        "num_layers": mc.num_layers,
        "hidden_size": mc.hidden_size,
        "num_heads": mc.num_heads,
        "num_kv_heads": mc.num_kv_heads,
        "num_kv_heads_per_rank": worker.num_kv_heads_per_rank,
        "head_dim": mc.head_dim,
        "num_experts": mc.moe.num_experts if mc.moe else 0,
        "num_experts_per_tok": mc.moe.top_k if mc.moe else 0,
        # Whole routed experts, a share per rank (False: a slice of every one per rank).
        "expert_parallel": bool(mc.moe) and worker.ctx.expert_parallel
        and worker.config.tensor_parallel_size > 1,
        "block_size": worker.config.block_size,
        "bytes_per_block": worker.block_bytes(),
        "dtype": str(worker.dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_dtype_name(worker.kv_dtype),
        "tensor_parallel_size": worker.config.tensor_parallel_size,
        "pipeline_parallel_size": worker.config.pipeline_parallel_size,
        "pipeline_layer_partition": [b - a for a, b in layer_partition(
            mc.num_layers, worker.config.pipeline_parallel_size,
            worker.config.pipeline_layer_partition)],
        "attention_backend": getattr(worker.backend, "name", None),
        "load_time_s": worker.load_time_s,
        "packed_weights": worker.packed_weights,
        "quantization": worker.config.quantization,
        "checkpoint_quantization": mc.prequant.method if mc.prequant else None,
        # One window on every layer: the scheduler may release blocks behind it.
        "kv_sliding_window": mc.sliding_window
        if len(mc.sliding_layers) == mc.num_layers else None,
        # A hybrid model's groups of layers, each with its own table (None: one table).
        "kv_group_windows": list(worker.kv_layout.windows)
        if worker.kv_layout.is_hybrid else None,
        "long_rope_from": mc.long_rope_from,
        # Mamba layers: each sequence carries a state no KV block holds (no prefix cache).
        "recurrent_state": mc.mamba is not None,
        "weight_bytes": worker.weight_bytes,
        # A multimodal file's image facts when its encoder is loaded (None: text only).
        "image": mc.image.info() if worker.config.vision_encoded(mc.image) else None,
    }

