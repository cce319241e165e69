"""deploy/ stays consistent with the code: configs validate, dashboards query real metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pagedserve.cluster.metrics import RequestTimer, ServerMetrics, render_prometheus

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_serve_config_validates_and_builds() -> None:
    from ray.serve.schema import ServeDeploySchema

    from pagedserve.cluster.serve_app import ServeArgs, app_builder

    cfg = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    ServeDeploySchema(**cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "pagedserve.cluster.serve_app:app_builder"
    ServeArgs(**app["args"])  # every key is a real setting
    assert app_builder(app["args"]) is not None


@pytest.mark.parametrize("name", ["ray-cluster.local.yaml", "ray-cluster.aws.yaml"])
def test_ray_cluster_configs_validate(name: str) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((DEPLOY / name).read_text())
    validate_config(prepare_config(cfg))
    cmds = " ".join(cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])
    for port in map(int, re.findall(r"(?:--port=|:)(\d{4,5})\b", cmds)):
        assert not 10002 <= port <= 19999, port  # Ray's worker port range
    # pagedserve is on no package index: each node installs the checkout copied to it.
    mounts = [m.replace("~", "$HOME") for m in cfg["file_mounts"]]
    for role in ("head", "worker"):
        cmds = cfg.get("setup_commands", []) + cfg.get(f"{role}_setup_commands", [])
        installs = [c for c in cmds if re.search(r"pip install .*pagedserve", c)]
        assert installs and all(any(f'"{m}' in c for m in mounts) for c in installs), \
            (role, installs)


def _emitted_metric_names() -> set[str]:
    m = ServerMetrics()
    t = RequestTimer()
    m.on_tokens(t, 1)
    m.on_tokens(t, 1)
    m.on_end(t, "stop")
    stats = {"num_running": 0, "num_waiting": 0, "num_swapped": 0, "prompt_tokens": 1,
             "generation_tokens": 2, "prefix_cache_queries": 1, "prefix_cache_hits": 0,
             "steps": 2, "num_preemptions": {"swap": 0}, "kv_exported_blocks": 0,
             "kv_imported_blocks": 3, "shared_prefix_steps": 1, "shared_prefix_rows": 4,
             "shared_prefix_keys_saved": 960, "expert_parallel_routed_pairs": 48,
             "expert_parallel_busiest_pairs": 16, "expert_parallel_balance": 0.75,
             "remote_prefill": {"remote_prefills": 1, "failures": 0},
             "kv_offload": {"enabled": True, "cpu_hit_tokens": 32, "offloaded_blocks": 4,
                            "loaded_blocks": 2},
             "spec_decode": {"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 2,
                             "num_accepted_tokens_per_pos": [1, 1, 0, 0],
                             "num_draft_tokens_per_pos": [1, 1, 1, 1]},
             "lora": {"loaded": ["a"], "num_loaded": 1, "evictions": 0, "running": {"a": 1},
                      "waiting": {}, "swapped": {}},
             "memory": {"num_gpu_blocks": 4, "num_used_blocks": 0, "num_free_blocks": 4,
                        "num_shared_blocks": 0, "num_cached_free_blocks": 0,
                        "num_cpu_blocks": 8, "num_cpu_cached_blocks": 4,
                        "weight_bytes": 2**20},
             "server": m.snapshot()}
    from pagedserve.cluster.metrics import HttpMetrics

    http = HttpMetrics()
    http.record("/v1/completions", 200)
    text = render_prometheus([{"replica": "r", "stats": stats}], http).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_dashboard_queries_only_metrics_the_server_emits() -> None:
    dash = json.loads((DEPLOY / "grafana" / "pagedserve-dashboard.json").read_text())
    emitted = _emitted_metric_names()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = {name for e in exprs for name in re.findall(r"\bpagedserve_[a-z0-9_]+", e)}
    assert used and used <= emitted, used - emitted


def test_prometheus_config_scrapes_the_metrics_endpoint() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["pagedserve"]["metrics_path"] == "/metrics"
    assert jobs["pagedserve"]["static_configs"][0]["targets"]


def test_grafana_provisioning_dry_run() -> None:
    out = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "provision.py"),
                          "--dry-run", "--prometheus-url", "http://prom:9090"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["datasource"]["url"] == "http://prom:9090"
    assert payload["dashboard"]["overwrite"] is True
    assert payload["dashboard"]["dashboard"]["uid"] == "pagedserve"
