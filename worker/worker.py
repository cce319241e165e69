"""One tensor-parallel rank: device, process group, model, KV shard and runner.

The engine drives every rank with the same calls in the same order
(``load_model`` -> ``determine_num_blocks`` -> ``init_kv_cache`` ->
``execute_model``...). Collective calls (process-group init, the all-reduces
of every forward, the logits gather) happen inside these methods, so all ranks
must receive each call, which the executor guarantees by broadcasting.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from pagedserve.kernels import get_backend
from pagedserve.kernels.backend import backend_with_sinks
from pagedserve.kernels.kv_quant import is_fp8
from pagedserve.scheduler.kv_groups import KVGroupLayout
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker import batch_invariant
from pagedserve.worker import sleep as sleep_mode
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.draft_model import DraftModel, draft_block_bytes
from pagedserve.worker.drafting import HEAD_TYPES, drafter_runner, load_drafter
from pagedserve.worker.kv_budget import num_device_blocks, profile_plan
from pagedserve.worker.kv_cache import KVCache, bytes_per_block
from pagedserve.worker.kv_layers import kv_layout_of, stage_kv_ids
from pagedserve.worker.layers.lora import LoRAManager
from pagedserve.worker.layers.packed import can_pack, pack_model, slow_half_precision
from pagedserve.worker.layers.quant import online_method, quantize_model, weight_bytes
from pagedserve.worker.loaders import ResolvedModel, iter_safetensors, load_tokenizer, resolve_model
from pagedserve.worker.loaders.hf import checkpoint_names
from pagedserve.worker.loaders.prequant import dequantized_weights
from pagedserve.worker.model_info import model_info
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models import MODEL_REGISTRY
from pagedserve.worker.models.multimodal import with_vision
from pagedserve.worker.parallel import ParallelContext, destroy_parallel, init_parallel
from pagedserve.worker.pipeline import IntermediateTensors, PipelineStage
from pagedserve.worker.sampler import Sampler
from pagedserve.worker.sleep import SleepState
from pagedserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

_thread_state = threading.local()


def _apply_threads_here(n: int) -> None:
    """Give the calling thread an OpenMP team of ``n`` (once per thread).

    OpenMP thread counts are per calling thread: a forward run from a thread
    pool (the async engine) otherwise gets the process default, which Ray sets
    to the actor's CPU count through OMP_NUM_THREADS, so MKL's small GEMMs ran
    on one core even after ``torch.set_num_threads`` in the main thread.
    """
    torch.set_num_threads(n)
    _thread_state.threads = n


class Worker:
    """A rank of the TP group; constructing it is cheap and touches no device."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.torch_kv_cache_dtype
        self.ctx: ParallelContext | None = None
        self.resolved: ResolvedModel | None = None
        self.model_config: ModelConfig | None = None
        self.model: Any = None
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.backend = None
        self.load_time_s = 0.0
        self.packed_weights = False
        self.weight_bytes = 0
        self.num_kv_heads_per_rank = 0
        self.num_threads: int | None = None
        self.lora: LoRAManager | None = None
        self.sleep_state: SleepState | None = None
        self.draft: DraftModel | None = None

    # ----- setup -------------------------------------------------------------------------

    def init_device(self, dist_init_method: str | None = None) -> None:
        """Pick threads and device, seed torch, and join the TP group (collective if TP > 1)."""
        if self.ctx is not None:
            return
        cfg = self.config
        if self.device.type == "cpu":
            threads = cfg.num_threads
            if threads is None and "OMP_NUM_THREADS" not in os.environ:
                threads = max(1, len(os.sched_getaffinity(0)) // cfg.world_size)
            if threads:
                torch.set_num_threads(threads)
                self.num_threads = threads
        elif self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        torch.manual_seed(cfg.seed)
        method = dist_init_method or cfg.dist_init_method
        self.ctx = init_parallel(cfg.rank, cfg.tensor_parallel_size, method, self.device)
        self.ctx.expert_parallel = cfg.enable_expert_parallel
        self.ctx.expert_placement = cfg.expert_placement_strategy
        self.backend = get_backend(cfg.attention_backend, self.device,
                                   kv_cache_dtype=self.kv_dtype, model_dtype=self.dtype)
        if not self.backend.supports_block_size(cfg.block_size):
            raise ValueError(f"attention backend {self.backend.name!r} does not support "
                             f"block_size {cfg.block_size}")

    def load_model(self, dist_init_method: str | None = None) -> None:
        """Resolve the model (GGUF conversion is cached), build it and load this rank's shard."""
        self.init_device(dist_init_method)
        assert self.ctx is not None
        t0 = time.perf_counter()
        self.resolved = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_pretrained(self.resolved.path,
                                                      self.config.hf_overrides)
        self.build_model(self.resolved, self.model_config)
        if self.config.speculative_model and self.ctx.is_first and self.model.stage.is_last:
            self.draft = load_drafter(self.config, self.model, self.model_config,
                                      self.resolved.path, self.ctx, self.dtype, self.device)
        self.load_time_s = time.perf_counter() - t0
        logger.info("rank %d loaded %s in %.1fs", self.ctx.rank, self.resolved.model_id,
                    self.load_time_s)

    def build_model(self, resolved: ResolvedModel, model_config: ModelConfig) -> None:
        """Build the model from ``resolved``'s weights (this rank's shard), then quantise,
        pack and wrap it for LoRA as the config says; replaces any model held (only once
        the new one is complete, so a load that fails leaves the old one serving)."""
        assert self.ctx is not None
        cls = MODEL_REGISTRY[model_config.model_type]
        if model_config.image is not None:  # a multimodal file: its decoder, its encoder
            cls = with_vision(cls)
        stage = PipelineStage.of(model_config.num_layers, self.config.pipeline_parallel_size,
                                 self.config.pp_rank, self.config.pipeline_layer_partition)
        if model_config.attention_sinks:  # GPT-OSS: not flash-attn's kernels
            self.backend = backend_with_sinks(self.backend, self.config.attention_backend,
                                              self.kv_dtype, self.dtype)
        model = cls(model_config, self.ctx, self.backend, self.dtype, self.device, stage)
        if self.config.vision_encoded(model_config.image):
            model.attach_vision(self.dtype, self.device)
        layout = kv_layout_of(model_config, self.config.hybrid_kv_cache)
        # (An encoder has no paged attention layers: nothing to place.)
        for kv_id, attn in zip(stage_kv_ids(model_config, stage), model.attention_layers(),
                               strict=False):
            attn.kv_group = layout.group_of(kv_id)
        weights = iter_safetensors(resolved.path, side_files=model_config.side_files)
        if model_config.prequant is not None:
            weights = dequantized_weights(weights, model_config.prequant,
                                          checkpoint_names(resolved.path), model.owns_tensor)
        tied = {id(model.embed_tokens.weight)} if model.embed_tokens is not None else set()
        head = model.lm_head
        unused = {id(head)} if model_config.headless and head is not None else set()
        online = online_method(self.config.quantization, model_config.prequant)
        # Each layer is quantised as soon as it is loaded: the model is never whole in
        # full precision (a 7B file held dense in fp32 would not fit this box's memory).
        model.load_weights(weights, (lambda name, layer: quantize_model(
            layer, online, tied, unused, prefix=name + ".")) if online else None)
        model.eval()
        self.packed_weights = False
        if online:
            quantize_model(model, online, tied, unused)  # what is left: the LM head
            if self.device.type == "cuda":  # the 16-bit copies go before memory is profiled
                torch.cuda.empty_cache()
        if (slow := slow_half_precision(self.device, self.dtype)) is not None:
            logger.warning(slow)
        if self.config.cpu_packed_weights and can_pack(self.device, self.dtype):
            self.packed_weights = pack_model(model, tied)
        if self.config.batch_invariant:
            batch_invariant.enable(model, self.backend, model_config, self.device, self.dtype,
                                   self.kv_dtype, online,
                                   lora=self.config.max_lora_rank > 0, ctx=self.ctx)
        self.weight_bytes = weight_bytes(model)
        if model_config.prequant is not None and not online and self.device.type == "cpu":
            logger.info("%s checkpoint held dense (%.0f MiB of weights); on CPU "
                        "--quantization int4 or int8 keeps it small (int4 keeps a 4-bit "
                        "file's grid)", model_config.prequant.method,
                        self.weight_bytes / 2**20)
        self.num_kv_heads_per_rank = model.num_kv_heads_per_rank  # known while asleep too
        if self.config.max_lora_rank:
            self.lora = LoRAManager(model, self.config.max_lora_rank, self.dtype, self.device)
        self.model = model
        if self.draft is not None and isinstance(self.draft.model, HEAD_TYPES):
            self.draft.model.attach(model)  # (rebuilt: woken from sleep, new weights)

    @property
    def kv_layout(self) -> KVGroupLayout:
        """Which layers share a block table (one group unless the model mixes windows)."""
        assert self.model_config is not None
        return kv_layout_of(self.model_config, self.config.hybrid_kv_cache)

    def _stage(self) -> PipelineStage:
        assert self.model_config is not None
        return PipelineStage.of(self.model_config.num_layers, self.config.pipeline_parallel_size,
                                self.config.pp_rank, self.config.pipeline_layer_partition)

    def _layer_slots(self) -> list[int]:
        """The cache each local layer reads (``KVCache``'s ``layer_slots``); none for an
        encoder, which caches nothing."""
        if self.model_config is not None and self.model_config.encoder is not None:
            return []
        return self.kv_layout.local_slots(stage_kv_ids(self.model_config, self._stage()))

    def block_bytes(self) -> int:
        """Bytes one block id takes on this rank: the target's KV, and a draft model's."""
        assert self.model_config is not None
        if not self._layer_slots():
            return 0  # (an encoder: its "blocks" only count prompt tokens)
        draft = (draft_block_bytes(self.draft, self.config.block_size, self.dtype)
                 if self.draft is not None else 0)
        return draft + bytes_per_block(max(self._layer_slots()) + 1, self.config.block_size,
                                       self.num_kv_heads_per_rank,
                                       self.model_config.head_dim, self.kv_dtype,
                                       shared_kv=self.model_config.mla is not None)

    def determine_num_blocks(self) -> int:
        """Device KV blocks this rank can hold (``kv_budget.num_device_blocks``); the
        engine takes the minimum over ranks so every rank has the same pool."""
        return num_device_blocks(self)

    def profile_forward(self) -> None:
        """Run the largest step the engine may plan, on a throwaway cache just big enough.

        The CUDA budget subtracts this step's peak; on CPU it only checks the plan runs.
        """
        assert self.model_config is not None
        n_tok = min(self.config.max_num_batched_tokens, self.model_config.max_model_len)
        # Rows that verify draft tokens need logits at every position.
        rows = self.config.max_num_seqs * (1 + self.config.num_speculative_tokens)
        plan, blocks = profile_plan(n_tok, rows, self.config.block_size, self.model_config.headless)
        self.init_kv_cache(blocks, 0, cuda_graphs=False, calibrate=False)
        intermediate = None
        if not self.model.stage.is_first:  # a later stage's input, as large as a real one
            shape = (n_tok, self.model_config.hidden_size)
            intermediate = IntermediateTensors(
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))
        try:
            self.execute_model(plan, intermediate)
        finally:
            self.kv_cache = self.runner = None

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int | None = None,
                      cuda_graphs: bool = True, calibrate: bool = True) -> None:
        """Allocate the KV pool shard and CPU swap shard, and build the model runner
        (capturing its decode graphs when the config enables them and ``cuda_graphs``).

        With ``calculate_kv_scales`` and an fp8 pool, every layer stores K/V over
        scales that the next step (the engine's calibration step, if ``calibrate``) sets.
        """
        assert self.model is not None and self.model_config is not None and self.ctx
        cpu_blocks = self.config.num_cpu_blocks if num_cpu_blocks is None else num_cpu_blocks
        self.kv_cache = KVCache(len(self._layer_slots()), num_gpu_blocks,
                                self.config.block_size, self.num_kv_heads_per_rank,
                                self.model_config.head_dim, self.kv_dtype, self.device,
                                self.backend, cpu_blocks, self._layer_slots(),
                                shared_kv=self.model_config.mla is not None)
        self.build_runner(cuda_graphs, calibrate)

    def build_runner(self, cuda_graphs: bool = True, calibrate: bool = True) -> None:
        """The model runner over the held model and KV cache (new weights need a new one:
        CUDA graphs hold the old weights' addresses). With ``calibrate``, fp8 KV scales
        are set from the next step; a model that has scales keeps them otherwise."""
        assert self.model is not None and self.kv_cache is not None and self.ctx
        assert self.model_config is not None
        scaled = self.config.calculate_kv_scales and is_fp8(self.kv_dtype)
        if scaled:  # before graph capture, so the graphs hold the scale ops
            for attn in self.model.attention_layers():
                if attn.k_scale is None:  # (a model kept through sleep keeps its scales)
                    attn.use_kv_scales(self.device)
        sampler = Sampler(self.model_config.eos_token_ids, grammar_book=self._grammar_book,
                          processors=self._logits_processors())
        self.runner = ModelRunner(self.model, self.kv_cache, self.ctx, self.device, sampler,
                                  enable_cuda_graph=self.config.enable_cuda_graph and cuda_graphs,
                                  max_num_seqs=self.config.max_num_seqs,
                                  state_snapshots=self.config.state_snapshots, lora=self.lora,
                                  guesses=self.config.num_speculative_tokens,
                                  drafter=None if self.draft is None else drafter_runner(
                                      self.draft, self.model, self.kv_cache, self.config,
                                      self.dtype, self.device, self.backend))
        if scaled and calibrate:
            for attn in self.model.attention_layers():
                attn.arm_calibration()

    def _logits_processors(self) -> Any:
        """Custom logits processors, built on the rank that samples only."""
        if not self.config.logits_processors or not (
                self.ctx is not None and self.ctx.is_first and self.model.stage.is_last):
            return None
        from pagedserve.worker.logits_processors import ProcessorConfig, build_processors

        mc = self.model_config
        return build_processors(self.config.logits_processors, ProcessorConfig(
            str(self.config.model), mc.vocab_size, mc.max_model_len, self.config.max_num_seqs),
            self.device)

    def _grammar_book(self) -> Any:
        """Structured-output state, built on the first constrained request (rank 0 only
        samples, so only rank 0 loads the tokenizer)."""
        from pagedserve.worker.structured import GrammarBook

        assert self.resolved is not None and self.model_config is not None
        mc = self.model_config
        return GrammarBook(load_tokenizer(self.resolved), mc.vocab_size, list(mc.eos_token_ids))

    # ----- steps -------------------------------------------------------------------------

    def execute_model(self, plan: SchedulerOutput,
                      intermediate: IntermediateTensors | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run one step plan; rank 0 returns the sampled tokens, other ranks None.

        Under pipeline parallelism a stage after the first continues from
        ``intermediate`` (the previous stage's output), and rank 0 of a stage before
        the last returns its own ``IntermediateTensors`` (on the host) instead.
        """
        if self.runner is None:
            raise RuntimeError("init_kv_cache must be called before execute_model")
        n = self.num_threads
        if n is not None and getattr(_thread_state, "threads", None) != n:
            _apply_threads_here(n)
        if intermediate is not None:
            intermediate = intermediate.to(self.device)
        return self.runner.execute(plan, intermediate)

    def read_kv_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """This rank's K and V of device blocks, for another replica (see ``KVCache``),
        then its draft model's K and V where it holds one."""
        if self.kv_cache is None:
            raise RuntimeError("init_kv_cache must be called before read_kv_blocks")
        drafter = self.runner.drafter if self.runner is not None else None
        extra = drafter.kv_cache.read_blocks(block_ids) if drafter is not None else ()
        return (*self.kv_cache.read_blocks(block_ids), *extra)

    def write_kv_blocks(self, block_ids: list[int], keys: torch.Tensor,
                        values: torch.Tensor, *draft: torch.Tensor) -> None:
        """Write another replica's K and V (this rank's shard) into device blocks, and
        its draft's K and V (``draft``) into this rank's draft pool when both have one
        of the same shape (else the draft recomputes nothing there: fewer guesses kept)."""
        if self.kv_cache is None:
            raise RuntimeError("init_kv_cache must be called before write_kv_blocks")
        self.kv_cache.write_blocks(block_ids, keys, values)
        drafter = self.runner.drafter if self.runner is not None else None
        if drafter is not None and len(draft) == 2:
            try:
                drafter.kv_cache.write_blocks(block_ids, *draft)
            except ValueError as e:
                logger.warning("shipped draft KV not written: %s", e)

    def add_lora(self, lora_id: int, path: str) -> None:
        """Load a LoRA adapter's shard for this rank (``ValueError`` if it cannot serve it)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora / max_lora_rank)")
        self.lora.add(lora_id, path)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora is not None and self.lora.remove(lora_id)

    def sleep(self, level: int = 1) -> None:
        """Free the KV shard (level 2: the weights too); see ``worker.sleep``."""
        sleep_mode.sleep(self, level)

    def wake_up(self) -> None:
        sleep_mode.wake_up(self)

    def update_weights(self, model: str) -> None:
        """Serve another checkpoint of the same architecture (``worker.sleep``)."""
        sleep_mode.update_weights(self, model)

    def check_health(self) -> dict[str, Any]:
        """Raise if this rank cannot serve; otherwise a small status dict."""
        if self.sleep_state is not None:  # asleep on purpose is healthy
            return {"rank": self.ctx.rank if self.ctx else None, "ok": True,
                    "sleeping": self.sleep_state.level}
        if self.model is None or self.runner is None:
            raise RuntimeError("worker not ready: model or KV cache not initialised")
        if self.device.type == "cuda":  # pragma: no cover - CUDA only
            torch.cuda.synchronize(self.device)
        assert self.ctx is not None
        return {"rank": self.ctx.rank, "ok": True}

    def get_model_info(self) -> dict[str, Any]:
        """Facts the engine needs: EOS ids, max length, vocab, KV geometry, sizes."""
        return model_info(self)

    def shutdown(self) -> None:
        """Free the cache and leave the process group."""
        self.runner = self.kv_cache = None
        if self.ctx is not None:
            destroy_parallel(self.ctx)
            self.ctx = None

