"""``pagedserve cache list|prune`` over a cache folder laid out as conversions and kernel
builds leave it: which entries this install loads, which are stale, and that pruning
removes only the stale ones and never one a live process holds.

The GGUF conversions here write what the real one writes into the entry (the
source record) but no weights; ``tests/worker/test_gguf_written.py`` runs the real
conversion of a new file version.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from pagedserve.cluster import cache_cmd, cli
from pagedserve.kernels import cpu_native
from pagedserve.worker.loaders import gguf as gguf_loader
from pagedserve.worker.loaders import gguf_cache


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder, and a conversion that writes a real source record."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(root))

    def convert(src: Path, out: Path) -> None:
        st = src.stat()
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        (out / gguf_loader.SOURCE_FILE).write_text(json.dumps({
            "gguf": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "format_version": gguf_loader.CACHE_FORMAT_VERSION,
            "transformers": gguf_loader.transformers_version()}))

    monkeypatch.setattr(gguf_loader, "_convert_into", convert)
    return root


def _states(entries: list[gguf_cache.CacheEntry]) -> dict[str, tuple[str, str]]:
    return {e.path.name: ("busy" if e.busy else "stale" if e.stale else "current", e.reason)
            for e in entries}


def test_a_new_file_version_replaces_its_entry_and_other_releases_wait_for_prune(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF v1")
    first = gguf_loader.convert_gguf_cached(src)
    with monkeypatch.context() as m:  # another install, on another transformers release
        m.setattr(gguf_loader, "transformers_version", lambda: "0.0.1")
        other = gguf_loader.convert_gguf_cached(src)
    assert other != first and first.is_dir(), "another release's entry must not replace ours"
    assert _states(gguf_cache.gguf_entries()) == {
        first.name: ("current", ""),
        other.name: ("stale", "written by transformers 0.0.1 (installed: "
                              f"{gguf_loader.transformers_version()})")}

    src.write_bytes(b"GGUF v2, a new version of the file")  # a model package upgrade
    with caplog.at_level("INFO", logger=gguf_cache.__name__):
        second = gguf_loader.convert_gguf_cached(src)
    # Both earlier entries were converted from the old file: no install can load them again.
    assert not first.exists() and not other.exists()
    assert _states(gguf_cache.gguf_entries()) == {second.name: ("current", "")}
    assert f"removed {first}" in caplog.text

    # Now an upgrade of transformers: the entry of the release before stays for other
    # installs, the log says how to remove it, and prune does.
    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "transformers_version", lambda: "99.0")
        with caplog.at_level("INFO", logger=gguf_cache.__name__):
            newest = gguf_loader.convert_gguf_cached(src)
        assert second.is_dir() and "`pagedserve cache prune` removes them" in caplog.text
        assert cli.main(["cache", "prune"]) == 0
        assert not second.exists() and newest.is_dir()
        assert _states(gguf_cache.gguf_entries()) == {newest.name: ("current", "")}


def test_list_shows_each_state_and_prune_removes_only_the_stale(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    current = gguf_loader.convert_gguf_cached(src)
    gone_src = tmp_path / "deleted.gguf"
    gone_src.write_bytes(b"GGUF")
    gone = gguf_loader.convert_gguf_cached(gone_src)
    gone_src.unlink()
    gguf_dir = current.parent
    (gguf_dir / "half-written").mkdir()  # a crash between mkdir and rename; no record
    (gguf_dir / "half-written" / "config.json").write_text("{}")
    dead_tmp = gguf_dir / f".{current.name}.abcd1234"  # a converter killed mid-write
    dead_tmp.mkdir()
    (dead_tmp / "model.safetensors").write_bytes(b"x" * 10)

    native = cpu_native.cache_dir()
    native.mkdir(parents=True)
    ours = cpu_native.library_path()
    ours.write_bytes(b"\x7fELF ours")
    old_lib = native / "cpu_kernels_0000000000000000.so"
    old_lib.write_bytes(b"\x7fELF old")
    (native / "cpu_kernels_0000000000000000.failed").write_text("error")
    ours.with_suffix(".failed").write_text("error")  # our build failed: kept to stop retries
    (native / ours.with_suffix(".lock").name).write_text("")

    assert cli.main(["cache", "list", "--json"]) == 0
    rows = {Path(r["path"]).name: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {n: r["state"] for n, r in rows.items()} == {
        current.name: "current", gone.name: "stale", "half-written": "stale",
        dead_tmp.name: "stale", ours.name: "current", old_lib.name: "stale",
        "cpu_kernels_0000000000000000.failed": "stale", ours.with_suffix(".failed").name:
        "current"}
    assert rows[gone.name]["reason"] == "source file gone"
    assert rows["half-written"]["reason"] == "unfinished: no source record"
    assert rows[dead_tmp.name]["reason"] == "unfinished conversion"
    assert rows[current.name]["source"] == str(src.resolve())
    assert rows[current.name]["size_bytes"] == sum(
        p.stat().st_size for p in current.iterdir())

    assert cli.main(["cache", "list"]) == 0
    text = capsys.readouterr().out
    assert f"cache: {cache}" in text and "5 stale" in text and "cache prune" in text

    before = sorted(p.name for p in gguf_dir.iterdir()) + sorted(os.listdir(native))
    assert cli.main(["cache", "prune", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out
    assert sorted(p.name for p in gguf_dir.iterdir()) + sorted(os.listdir(native)) == before

    assert cli.main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed ") == 5 and "freed" in out
    assert [e.path.name for e in cache_cmd.all_entries()] == [
        current.name, ours.with_suffix(".failed").name, ours.name]
    assert cli.main(["cache", "prune"]) == 0  # nothing left to do is not an error
    assert "freed 0.0 MB" in capsys.readouterr().out


def test_prune_leaves_what_a_live_process_holds(cache: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A conversion in flight (its lock held) is busy, never stale; an entry whose lock
    is held while prune runs is kept, and prune says so with exit status 1."""
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    current = gguf_loader.convert_gguf_cached(src)
    gguf_dir = current.parent
    in_flight = gguf_dir / ".other.Q4-0123456789abcdef.k2j4h5g6"
    in_flight.mkdir()
    stale = gguf_dir / "stale-entry"
    stale.mkdir()
    lock_paths = [gguf_dir / ".other.Q4-0123456789abcdef.lock", gguf_dir / ".stale-entry.lock"]
    holders = [open(p, "w") for p in lock_paths]  # noqa: SIM115 - held across the calls
    try:
        for f in holders:
            fcntl.flock(f, fcntl.LOCK_EX)
        states = _states(gguf_cache.gguf_entries())
        assert states[in_flight.name] == ("busy", "conversion in progress")
        assert states[stale.name][0] == "stale"
        assert cli.main(["cache", "prune"]) == 1
        assert f"kept {stale}" in capsys.readouterr().out
        assert in_flight.is_dir() and stale.is_dir() and current.is_dir()
    finally:
        for f in holders:
            f.close()
    assert cli.main(["cache", "prune"]) == 0
    assert not stale.exists() and not in_flight.exists() and current.is_dir()


def test_prune_reports_what_the_file_system_refuses(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An entry that cannot be removed (another user's, a read-only mount) is named with
    the error and prune exits 1; the rest still goes."""
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    gguf_dir = gguf_loader.convert_gguf_cached(src).parent
    (gguf_dir / "theirs").mkdir()
    old_lib = cpu_native.cache_dir() / "cpu_kernels_0000000000000000.so"
    old_lib.parent.mkdir(parents=True)
    old_lib.write_bytes(b"\x7fELF old")

    def refuse(a: Path, b: Path) -> None:
        raise PermissionError(13, "Permission denied", str(a))

    monkeypatch.setattr(gguf_cache.os, "rename", refuse)
    assert cli.main(["cache", "prune"]) == 1
    out = capsys.readouterr().out
    assert f"kept {gguf_dir / 'theirs'}: [Errno 13] Permission denied" in out
    assert f"removed {old_lib}" in out and not old_lib.exists()


def test_cleaning_after_a_conversion_never_fails_the_load(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> list[gguf_cache.CacheEntry]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(gguf_cache, "gguf_entries", broken)
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    with caplog.at_level("WARNING", logger=gguf_cache.__name__):
        entry = gguf_loader.convert_gguf_cached(src)
    assert (entry / gguf_loader.SOURCE_FILE).is_file()
    assert "could not clean the GGUF cache" in caplog.text


def test_a_build_folder_is_busy_until_it_is_old(cache: Path) -> None:
    """``TemporaryDirectory`` build folders carry no lock of their own: a young one is a
    build in progress, one older than any build may take was left by a killed build."""
    native = cpu_native.cache_dir()
    young, old = native / "tmpyoung", native / "tmpold"
    young.mkdir(parents=True)
    old.mkdir()
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    states = _states(cache_cmd.native_entries())
    assert states == {"tmpyoung": ("busy", "build in progress"),
                      "tmpold": ("stale", "abandoned build folder")}


def test_cache_needs_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["cache"])
    assert e.value.code == 2 and "list" in capsys.readouterr().err
