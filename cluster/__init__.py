"""The serving side: engine, executors, offline ``LLM`` API, Ray Serve app and CLI."""

from pagedserve.cluster.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from pagedserve.cluster.config import EngineConfig
from pagedserve.cluster.llm import LLM
from pagedserve.cluster.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.cluster.video import VideoClip
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "EngineConfig", "LoRARequest",
           "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "RequestOutput",
           "SamplingParams", "ScoringOutput", "ScoringRequestOutput", "VideoClip"]
