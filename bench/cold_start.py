"""A replica's cold start: loading the tokenizer, and the offline engine, in a new process.

Every Serve replica is a new process: the ingress loads the tokenizer, each engine rank
the tokenizer and the model. ``load_tokenizer`` loads a plain ``tokenizers``-backend
tokenizer as its class directly; ``AutoTokenizer`` gives the same object after importing
its model registry and looking the model up. This runs each in fresh interpreters,
interleaved (``--reps`` times, best and median), and the whole ``LLM(...)`` start of the
default model, and prints ours / AutoTokenizer's as a ratio.

    python bench/cold_start.py --json bench/figures/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PRELUDE = "import time; t0 = time.monotonic()\n"
_TAIL = "\nprint(time.monotonic() - t0)\n"
_CASES = {
    "load_tokenizer": (
        "from pagedserve.worker.loaders import load_tokenizer, resolve_model\n"
        "load_tokenizer(resolve_model(None))"),
    "AutoTokenizer": (
        "from pagedserve.worker.loaders import resolve_model\n"
        "from transformers import AutoTokenizer\n"
        "AutoTokenizer.from_pretrained(resolve_model(None).path, local_files_only=True)"),
    "LLM()": (
        "from pagedserve.cluster import LLM\n"
        "LLM(num_gpu_blocks=64, max_model_len=512, num_threads=2).shutdown()"),
}


def _time(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + code + _TAIL], check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the timings here too")
    args = ap.parse_args()
    _time(_CASES["load_tokenizer"])  # warm the page cache: every case reads the same files
    times: dict[str, list[float]] = {name: [] for name in _CASES}
    for _ in range(args.reps):
        for name, code in _CASES.items():
            times[name].append(_time(code))
    summary = {name: {"best_s": min(t), "median_s": statistics.median(t), "runs_s": t}
               for name, t in times.items()}
    for name, s in summary.items():
        print(f"{name:15s} best {s['best_s']:.2f} s  median {s['median_s']:.2f} s")
    ours, auto = summary["load_tokenizer"], summary["AutoTokenizer"]
    ratio = ours["median_s"] / auto["median_s"]
    print(f"load_tokenizer / AutoTokenizer: {ratio:.2f}x (median), "
          f"{ours['best_s'] / auto['best_s']:.2f}x (best)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reps": args.reps, "cases": summary, "ratio_median": ratio}, f,
                      indent=2)


if __name__ == "__main__":
    main()
