"""Where a benchmark's figures came from, for the JSON files the README quotes: the
tree they ran on (``+dirty`` when it had uncommitted changes, which a commit hash
alone would hide) and the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def tree_commit() -> str:
    """The checkout's short commit hash, ``+dirty`` if files differ from it. The
    figures' own directory does not count: a bench opens its JSON (emptying a tracked
    one) before it writes this field, which made every rerun read ``+dirty``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=_HERE,
                              check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/",
                  ":(exclude,top)bench/figures")
    return f"{commit}+dirty" if commit and changed else commit


def machine() -> str:
    """The CPU (or architecture) and its core count, as the benches print it."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def write_figures(path: str, args: Any, commit: str, **results: Any) -> None:
    """The figures as JSON: the arguments, the machine, the tree, then ``results``."""
    with open(path, "w") as f:
        json.dump({"args": vars(args), "machine": platform.platform(),
                   "cpus": os.cpu_count(), "commit": commit, **results}, f, indent=1)
