"""The ``kernels/`` folder imported by its bare name hands over to an installed ``kernels``.

With the checkout's root on ``sys.path`` (pytest, ``python -m`` from the checkout,
Ray workers, which inherit the driver's working directory) ``import kernels`` finds
this folder first; transformers 5.x imports Hugging Face's ``kernels`` whenever that
distribution is installed and broke on every model load until the hand-over.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(code: str, extra_path: list[str]) -> dict:
    """Run ``code`` in a fresh interpreter started in the checkout, ``extra_path``
    after the root; it prints one JSON object."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(extra_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bare_import_gets_the_other_kernels_package_and_ours_still_works(tmp_path: Path
                                                                         ) -> None:
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("from kernels.layer import NAME\n")
    (other / "layer.py").write_text("NAME = 'the distribution'\n")
    got = _imports((
        "import json, sys; import kernels; from kernels import NAME; "
        "import pagedserve.kernels as ours; "
        "print(json.dumps({'name': NAME, 'file': kernels.__file__, "
        "'same': sys.modules['kernels'] is kernels, 'ours': ours.__file__, "
        "'backend': callable(ours.get_backend)}))"), [str(tmp_path / "site")])
    assert got["name"] == "the distribution"
    assert got["file"] == str(other / "__init__.py") and got["same"]
    assert Path(got["ours"]).resolve() == ROOT / "kernels" / "__init__.py"
    assert got["backend"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_transformers_hub_kernels_imports_from_the_checkout() -> None:
    """What failed: transformers' ``from kernels import CUDAProperties`` with the
    ``kernels`` distribution installed (it is a transformers dependency since 5.x)."""
    got = _imports((
        "import json, importlib.metadata as m\n"
        "try:\n    v = m.version('kernels')\nexcept m.PackageNotFoundError:\n    v = None\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.integrations import hub_kernels\n"
        "import sys\n"
        "k = sys.modules.get('kernels')\n"
        "print(json.dumps({'kernels': v, 'file': getattr(k, '__file__', None)}))"), [])
    if got["kernels"] is not None:  # transformers imported the distribution, not this folder
        assert got["file"] is not None
        assert not Path(got["file"]).resolve().is_relative_to(ROOT)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_bench_scripts_can_import_transformers() -> None:
    """``python bench/<script>.py`` puts bench/ first on the path, where ``kernels.py`` (the
    kernel benchmark) stood in for the distribution: every benchmark that loads a
    Hugging Face model failed at ``from kernels import CUDAProperties``."""
    bench = str(ROOT / "bench")
    code = (f"import json, sys; sys.path.insert(0, {bench!r})\n"
            "from transformers.integrations import hub_kernels\n"
            "k = sys.modules.get('kernels')\n"
            "print(json.dumps({'file': getattr(k, '__file__', None)}))")
    got = _imports(code, [])
    if got["file"] is not None:
        assert Path(got["file"]).resolve() != ROOT / "bench" / "kernels.py"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--help"],
                         cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert run.returncode == 0 and "--sweep" in run.stdout  # still runs as a script
