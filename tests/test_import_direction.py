"""The dependency direction of DESIGN.md, checked on the source's import statements.

``cluster -> worker -> kernels``, ``cluster -> scheduler``, ``worker -> scheduler``
(plain data types only); ``scheduler`` imports no torch and no Ray.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "scheduler": {"torch", "ray", "triton", "numpy", "pagedserve.kernels",
                  "pagedserve.worker", "pagedserve.cluster"},
    "kernels": {"ray", "pagedserve.scheduler", "pagedserve.worker", "pagedserve.cluster"},
    "worker": {"pagedserve.cluster"},
    "cluster": set(),
}
# (``kv_groups``: which layers share a block table, a plain dataclass both sides read.)
WORKER_MAY_USE_FROM_SCHEDULER = {"pagedserve.scheduler.outputs",
                                 "pagedserve.scheduler.plan_wire",
                                 "pagedserve.scheduler.sampling_params",
                                 "pagedserve.scheduler.kv_groups"}


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_respects_the_dependency_direction(folder: str) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for mod in imported_modules(path):
            for f in FORBIDDEN[folder]:
                if mod == f or mod.startswith(f + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
            if (folder == "worker" and mod.startswith("pagedserve.scheduler")
                    and mod not in WORKER_MAY_USE_FROM_SCHEDULER):
                bad.append(f"{path.relative_to(ROOT)} imports {mod} (only plan types)")
    assert not bad, "\n".join(bad)


def test_importing_the_scheduler_loads_neither_torch_nor_ray() -> None:
    code = (
        "import sys, pagedserve.scheduler.scheduler, pagedserve.scheduler.memory;"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
