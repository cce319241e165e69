"""The converted-GGUF cache's entries: which one this install loads, which are stale, pruning.

Every GGUF file version, cache format and transformers release gets an entry of
its own (``gguf.cache_dir_for``), and a dequantised entry is large (542 MB for
the default SmolLM2-135M Q4_1 file, whose weights are stored in fp32). Without
cleaning, each upgrade of the model package, of transformers or of the cache
format left one more behind.

Two kinds of cleaning, because a cache directory can be shared by several
installs (virtual environments with other transformers releases, an older
pagedserve):

- automatic, after a conversion: entries converted from an earlier version of
  the same file (same path, other size or mtime) go. The cache key holds the
  file's size and mtime, so no install can load them again.
- explicit, ``pagedserve cache prune``: every entry this install would not
  load (another transformers release or cache format, a source file that is
  gone, an unfinished conversion no one is working on).

An entry is removed by renaming it out of its name first, under its
conversion lock, so a process looking it up sees the whole entry or none.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagedserve.worker.loaders import gguf as gguf_loader

logger = logging.getLogger(__name__)

_PRUNING = ".pruning-"
# Why an entry of an earlier version of its file is stale: the one kind removed unasked.
EARLIER_VERSION = "converted from an earlier version of the file"


@dataclass(frozen=True)
class CacheEntry:
    """One cached artefact, as ``pagedserve cache list`` shows it.

    ``stale`` entries are the ones ``prune`` removes; ``busy`` ones are being
    written by a live process and are left alone; ``reason`` says why an
    entry is stale or busy (empty for the one in use).
    """

    kind: str
    path: Path
    size_bytes: int
    source: str | None
    stale: bool
    reason: str = ""
    busy: bool = False

    def to_json(self) -> dict[str, object]:
        """A plain dict for ``pagedserve cache list --json``."""
        return {"kind": self.kind, "path": str(self.path), "size_bytes": self.size_bytes,
                "source": self.source, "stale": self.stale, "busy": self.busy,
                "reason": self.reason}


def gguf_cache_dir() -> Path:
    """The folder holding every converted GGUF file."""
    return gguf_loader.cache_root() / "gguf"


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (a file's own size for a file)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(folder) / name).stat().st_size
    return total


def _lock_path(entry_name: str) -> Path:
    return gguf_cache_dir() / f".{entry_name}.lock"


@contextlib.contextmanager
def lock_if_free(lock: Path) -> Iterator[bool]:
    """Hold the ``flock`` on ``lock`` if no live process does; yields whether we got it
    (True without locking when the file does not exist: then no one is using it)."""
    if not lock.exists():
        yield True
        return
    try:
        f = open(lock, "a")  # noqa: SIM115 - closed below, after the caller's block
    except OSError:  # another user's lock we may not open: theirs to manage
        yield False
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_record(entry: Path) -> dict | None:
    try:
        record = json.loads((entry / gguf_loader.SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("gguf"), str) else None


def _why_not_current(entry: Path, record: dict | None) -> str:
    """Why this install would not load ``entry``; empty when it would."""
    if not (entry / gguf_loader.SOURCE_FILE).is_file():
        return "unfinished: no source record"
    if record is None:
        return "unreadable source record"
    src = Path(record["gguf"])
    if not src.is_file():
        return "source file gone"
    with contextlib.suppress(OSError):
        if gguf_loader.cache_dir_for(src) == entry:
            return ""
    st = src.stat()
    if (record.get("size"), record.get("mtime_ns")) != (st.st_size, st.st_mtime_ns):
        return EARLIER_VERSION
    if record.get("format_version") != gguf_loader.CACHE_FORMAT_VERSION:
        return (f"cache format v{record.get('format_version')} "
                f"(this install writes v{gguf_loader.CACHE_FORMAT_VERSION})")
    written_by = record.get("transformers")
    if written_by is None:
        return "converted before entries recorded their transformers release"
    installed = gguf_loader.transformers_version()
    if written_by != installed:
        return f"written by transformers {written_by} (installed: {installed})"
    return "another cache key"


def _target_name(temp: Path) -> str:
    """The entry a dot-named folder is being written as (``.NAME.XXXX``, mkdtemp's
    suffix has no dot) or removed from (``.NAME.pruning-XXXX``)."""
    name = temp.name[1:]
    return name.split(_PRUNING)[0] if _PRUNING in name else name.rsplit(".", 1)[0]


def _temp_entry(path: Path) -> CacheEntry:
    """A dot-named folder: a conversion (or a removal) in flight, or one that died."""
    with lock_if_free(_lock_path(_target_name(path))) as free:  # a probe, released at once
        busy = not free
    what = "removal" if _PRUNING in path.name else "conversion"
    return CacheEntry("gguf", path, tree_size(path), None, stale=not busy, busy=busy,
                      reason=f"{what} in progress" if busy else f"unfinished {what}")


def gguf_entries() -> list[CacheEntry]:
    """Every entry of the converted-GGUF cache, sorted by path (lock files aside)."""
    root = gguf_cache_dir()
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith("."):
            entries.append(_temp_entry(path))
            continue
        record = _read_record(path)
        reason = _why_not_current(path, record)
        entries.append(CacheEntry("gguf", path, tree_size(path),
                                  record["gguf"] if record else None,
                                  stale=bool(reason), reason=reason))
    return entries


def remove_entry(entry: CacheEntry) -> bool:
    """Delete one GGUF cache entry; False when a live process holds it (then it stays).
    An ``OSError`` (the file system refusing) propagates."""
    path = entry.path
    if path.name.startswith("."):
        with lock_if_free(_lock_path(_target_name(path))) as free:
            if free:
                shutil.rmtree(path)
            return free
    with lock_if_free(_lock_path(path.name)) as free:
        if not free:
            return False
        doomed = path.with_name(f".{path.name}{_PRUNING}{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return True
        shutil.rmtree(doomed)  # left half-deleted, it lists as an unfinished removal
    return True


def drop_superseded(gguf_path: Path) -> None:
    """After converting ``gguf_path``: remove the entries of its earlier file versions,
    which no install can load again, and log what other stale entries of it remain.
    Cleaning never fails the load that triggered it: an error is logged and left."""
    try:
        _drop_superseded(str(Path(gguf_path).resolve()))
    except Exception as e:  # housekeeping: the converted model is fine either way
        logger.warning("could not clean the GGUF cache after converting %s: %r", gguf_path, e)


def _drop_superseded(src: str) -> None:
    others = []
    for entry in gguf_entries():
        if entry.source != src or not entry.stale:
            continue
        if entry.reason == EARLIER_VERSION:
            with contextlib.suppress(OSError):
                if remove_entry(entry):
                    logger.info("removed %s (%s)", entry.path, entry.reason)
                    continue
        others.append(entry)
    if others:
        size = sum(e.size_bytes for e in others)
        logger.info("%d other conversions of %s (%.0f MB) stay in the cache for other "
                    "installs (%s); `pagedserve cache prune` removes them", len(others), src,
                    size / 1e6, "; ".join(e.reason for e in others))
