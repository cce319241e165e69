"""``pagedserve cache list|prune``: what ``$PAGEDSERVE_CACHE_DIR`` holds, and cleaning it.

The cache has two parts. ``gguf/`` holds converted GGUF checkpoints (hundreds
of MB each; ``worker.loaders.gguf_cache`` knows their states) and ``native/``
the compiled CPU kernel libraries (about 1 MB each, one per kernel source
version and CPU). A pagedserve or transformers upgrade leaves the earlier
artefacts behind, since another install sharing the folder may still use
them; ``prune`` removes everything this install would not load, the way
``pip cache purge`` or ``huggingface-cli delete-cache`` are asked for
explicitly rather than run behind a user's back.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

from pagedserve.kernels import cpu_native
from pagedserve.worker.loaders.gguf import cache_root
from pagedserve.worker.loaders.gguf_cache import (
    CacheEntry,
    gguf_entries,
    lock_if_free,
    remove_entry,
    tree_size,
)

# A build folder older than this belongs to a build that died (a build times out at 300 s).
_ABANDONED_BUILD_S = 3600.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``cache`` command and its ``list`` / ``prune`` subcommands."""
    c = sub.add_parser("cache", help="list or prune converted models and compiled kernels "
                       "under $PAGEDSERVE_CACHE_DIR (default ~/.cache/pagedserve)")
    actions = c.add_subparsers(dest="cache_command", required=True)
    ls = actions.add_parser("list", help="every cached artefact, with its size and state")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    pr = actions.add_parser("prune", help="remove what this install would not load")
    pr.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")


def native_entries() -> list[CacheEntry]:
    """The compiled kernel libraries, failed-build notes and leftover build folders."""
    root = cpu_native.cache_dir()
    if not root.is_dir():
        return []
    try:
        current = cpu_native.library_path()
    except OSError:  # kernel sources not installed: no library is this install's
        current = root / "none.so"
    entries = []
    for path in sorted(root.iterdir()):
        if path.suffix == ".lock":
            continue
        if path.is_dir():
            age = time.time() - path.stat().st_mtime
            stale = age > _ABANDONED_BUILD_S
            entries.append(CacheEntry("native", path, tree_size(path), None, stale=stale,
                                      busy=not stale, reason="abandoned build folder"
                                      if stale else "build in progress"))
        elif path.suffix == ".so":
            ours = path == current
            entries.append(CacheEntry("native", path, tree_size(path), None, stale=not ours,
                                      reason="" if ours else
                                      "built from other kernel sources or for another CPU"))
        elif path.suffix == ".failed":
            ours = path.stem == current.stem
            entries.append(CacheEntry("native", path, tree_size(path), None, stale=not ours,
                                      reason="this build failed: delete the note to retry"
                                      if ours else "failed build of other sources"))
    return entries


def all_entries() -> list[CacheEntry]:
    """Both parts of the cache."""
    return gguf_entries() + native_entries()


def _remove(entry: CacheEntry) -> str:
    """Delete one stale entry; returns why it stays (a live process holds it, or the
    file system refused), empty when it is gone."""
    try:
        if entry.kind == "gguf":
            return "" if remove_entry(entry) else "a running process holds its lock"
        with lock_if_free(entry.path.with_suffix(".lock")) as free:
            if not free:
                return "a running process holds its lock"
            if entry.path.is_dir():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink(missing_ok=True)
    except OSError as e:
        return str(e)
    return ""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _state(entry: CacheEntry) -> str:
    return "busy" if entry.busy else "stale" if entry.stale else "current"


def list_cache(as_json: bool) -> int:
    """Print every entry: state, size, kind, path, then why or where from."""
    entries = all_entries()
    if as_json:
        for entry in entries:
            print(json.dumps({"state": _state(entry), **entry.to_json()}))
        return 0
    print(f"cache: {cache_root()}")
    for e in entries:
        detail = e.reason or (f"from {e.source}" if e.source else "")
        print(f"{_state(e):<8}{_mb(e.size_bytes):>12}  {e.kind:<7}{e.path.name}"
              + (f"  {detail}" if detail else ""))
    stale = [e for e in entries if e.stale]
    print(f"{len(entries)} entries, {_mb(sum(e.size_bytes for e in entries))}; "
          f"{len(stale)} stale, {_mb(sum(e.size_bytes for e in stale))}"
          + (" (`pagedserve cache prune` removes them)" if stale else ""))
    return 0


def prune_cache(dry_run: bool) -> int:
    """Remove every stale entry; 1 if one of them stays (in use, or not ours to delete)."""
    freed, kept = 0, []
    for e in all_entries():
        if not e.stale:
            continue
        if dry_run:
            print(f"would remove {e.path} ({_mb(e.size_bytes)}; {e.reason})")
            freed += e.size_bytes
        elif not (why := _remove(e)):
            print(f"removed {e.path} ({_mb(e.size_bytes)}; {e.reason})")
            freed += e.size_bytes
        else:
            kept.append(f"kept {e.path}: {why}")
    for line in kept:
        print(line)
    verb = "would free" if dry_run else "freed"
    print(f"{verb} {_mb(freed)} under {cache_root()}")
    return 1 if kept else 0


def run(args: argparse.Namespace) -> int:
    """Entry point for ``pagedserve cache ...``."""
    if args.cache_command == "list":
        return list_cache(args.json)
    return prune_cache(args.dry_run)


__all__ = ["add_parser", "all_entries", "native_entries", "run"]
