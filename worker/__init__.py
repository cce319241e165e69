"""pagedserve.worker: one tensor-parallel rank (model, loaders, KV shard, runner, sampler).

Import ``pagedserve.worker.ray_worker`` separately for the Ray actor; this
package itself does not import Ray.
"""

from pagedserve.worker.config import ModelConfig
from pagedserve.worker.loaders import ResolvedModel, load_tokenizer, resolve_model
from pagedserve.worker.parallel import get_node_ip_and_free_port
from pagedserve.worker.worker import Worker
from pagedserve.worker.worker_config import WorkerConfig

__all__ = [
    "ModelConfig",
    "ResolvedModel",
    "Worker",
    "WorkerConfig",
    "get_node_ip_and_free_port",
    "load_tokenizer",
    "resolve_model",
]
