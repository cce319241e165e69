"""pagedserve.kernels: paged attention ops on the KV layout ``[blocks, B, Hkv, D]``.

Importing this package needs only torch; triton and flash_attn are imported
when their backend is requested.

This folder is also reachable as a bare ``kernels`` whenever the checkout's root
is on ``sys.path``: pytest's rootdir, ``python -m`` run from the checkout, and
every Ray worker (Ray adds the driver's working directory to its workers' path).
The name belongs to Hugging Face's ``kernels`` distribution, which transformers
(5.x) imports as soon as it is installed, so such an import hands over to that
distribution (:func:`hand_over_bare_name`); without it this folder still
answers, as before.
"""

import sys as _sys


def hand_over_bare_name() -> bool:
    """Load the installed ``kernels`` distribution into ``sys.modules["kernels"]``;
    the ``import`` statement that is running the shadowing file returns what is there.
    The checkout has two files of that name: this folder (its root on ``sys.path``)
    and ``bench/kernels.py`` (``bench/`` on it when a benchmark runs as a script);
    both are skipped. False when no other ``kernels`` is on the path."""
    import importlib.util
    import os
    from importlib.machinery import PathFinder

    # realpath first: this folder may be reached through a link (bench/gpu_check.sh puts
    # it on the path as site/pagedserve/kernels), and the checkout is where it points.
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    ours = {root, os.path.join(root, "bench")}
    path = [p for p in _sys.path if os.path.realpath(p or os.curdir) not in ours]
    spec = PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    _sys.modules["kernels"] = module
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not hand_over_bare_name():
    from pagedserve.kernels.backend import AttentionBackend, available_backends, get_backend
    from pagedserve.kernels.metadata import VarlenMetadata, build_varlen_metadata
    from pagedserve.kernels.reference import dense_causal_attention

__all__ = [
    "AttentionBackend",
    "VarlenMetadata",
    "available_backends",
    "build_varlen_metadata",
    "dense_causal_attention",
    "get_backend",
]
