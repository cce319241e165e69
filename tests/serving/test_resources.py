"""How ``build_app`` sizes CPU replicas: torch threads and the Ray CPUs that back them.

Ray caps an actor's OpenMP pool at its ``num_cpus`` (OMP_NUM_THREADS), so a
CPU engine replica that reserved one CPU used to run its forward on one core
of however many the machine has. No Ray cluster is started here.
"""

from __future__ import annotations

import pytest

from pagedserve.cluster import placement
from pagedserve.cluster.dispatch import FailoverPolicy
from pagedserve.cluster.serve_app import build_app


@pytest.fixture(autouse=True)
def _no_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Size from this machine even when another test left a Ray cluster up."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def _engine_node(args: dict) -> object:
    app = build_app({"device": "cpu", "num_gpu_blocks": 64, **args})
    return app._bound_deployment.init_args[0]._bound_deployment


@pytest.mark.parametrize("cores,replicas,tp,want", [
    (2, 1, 1, 2), (16, 1, 1, 16), (16, 2, 1, 8), (16, 1, 2, 7), (2, 1, 2, 1), (3, 4, 1, 1),
])
def test_threads_share_the_cores(monkeypatch: pytest.MonkeyPatch, cores: int, replicas: int,
                                 tp: int, want: int) -> None:
    monkeypatch.setattr(placement.os, "cpu_count", lambda: cores)
    assert placement.cpu_threads_per_rank(replicas, tp) == want


def test_replica_reserves_the_cpus_its_threads_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 8)
    eng = _engine_node({})
    assert eng.init_args[0]["num_threads"] == 8
    assert eng.ray_actor_options["num_cpus"] == 8.0
    assert eng.init_args[1] == 50.0  # stream interval default, Ray Serve LLM's
    assert eng.init_args[2] is None  # message budget: the replica's node decides


def test_tensor_parallel_ranks_reserve_their_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 8)
    eng = _engine_node({"tensor_parallel_size": 2})
    assert eng.init_args[0]["num_threads"] == 3
    assert eng._replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 3.0},
                                                            {"CPU": 3.0}]
    env = eng.ray_actor_options["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"


def test_pipeline_stages_reserve_a_bundle_per_rank(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path) -> None:
    """TP=2 x PP=2: four rank bundles behind the replica's own, threads over all four."""
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 16)
    eng = _engine_node({"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert eng.init_args[0]["pipeline_parallel_size"] == 2
    assert eng.init_args[0]["num_threads"] == 3  # (16 - 1) // 4
    assert eng._replica_config.placement_group_bundles == [{"CPU": 1.0}] + [{"CPU": 3.0}] * 4
    with pytest.raises(ValueError, match="enable_lora is not supported"):
        build_app({"device": "cpu", "pipeline_parallel_size": 2, "lora_dir": str(tmp_path)})


def test_prefill_replicas_share_the_cores_and_sit_behind_the_engine_replicas(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.cluster.disagg import PREFILL_DEPLOYMENT, RemotePrefillConfig

    monkeypatch.setattr(placement.os, "cpu_count", lambda: 8)
    eng = _engine_node({"num_replicas": 3, "prefill_replicas": 1,
                        "remote_prefill_min_tokens": 32,
                        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    assert eng.init_args[0]["num_threads"] == 2  # 8 cores over 3 decode + 1 prefill
    prefill = eng.init_args[3]._bound_deployment
    assert prefill.name == PREFILL_DEPLOYMENT and prefill.num_replicas == 1
    assert prefill._deployment_config.autoscaling_config is None  # a fixed pool
    assert prefill.init_args[0] == eng.init_args[0]  # the same engine settings
    assert eng.init_args[4] == RemotePrefillConfig(min_tokens=32, timeout_s=60.0)
    assert _engine_node({}).init_args[3:5] == (None, None)  # colocated by default
    bounded = _engine_node({"prefill_replicas": 1, "remote_prefill_max_inflight": 4})
    assert bounded.init_args[4].max_inflight == 4
    with pytest.raises(ValueError, match="prefill_replicas"):
        build_app({"device": "cpu", "prefill_replicas": -1})
    with pytest.raises(ValueError, match="remote_prefill_min_tokens"):
        build_app({"device": "cpu", "prefill_replicas": 1, "remote_prefill_min_tokens": 0})
    scaled = _engine_node({"prefill_replicas": 1, "prefill_autoscaling_config": {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}})
    assert scaled.init_args[0]["num_threads"] == 2  # 8 cores over 1 decode + 3 prefill
    pool = scaled.init_args[3]._bound_deployment._deployment_config.autoscaling_config
    assert (pool.min_replicas, pool.max_replicas) == (1, 3)
    with pytest.raises(ValueError, match="prefill_autoscaling_config: unknown keys"):
        build_app({"device": "cpu", "prefill_replicas": 1,
                   "prefill_autoscaling_config": {"max_replica": 3}})
    with pytest.raises(ValueError, match="needs prefill_replicas"):
        build_app({"device": "cpu", "prefill_autoscaling_config": {"max_replicas": 3}})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        build_app({"device": "cpu", "prefill_replicas": 1,
                   "engine_kwargs": {"enable_prefix_caching": False}})


def test_explicit_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 8)
    eng = _engine_node({"num_threads": 2, "replica_num_cpus": 0.5, "stream_interval_ms": 0,
                        "dtype": "bfloat16", "checkpoint_interval_ms": 250,
                        "drain_timeout_s": 30})
    assert eng.init_args[0]["num_threads"] == 2 and eng.init_args[0]["dtype"] == "bfloat16"
    assert eng.ray_actor_options["num_cpus"] == 0.5
    assert eng.init_args[1] == 0.0 and eng.init_args[5] == 250.0
    assert eng._deployment_config.graceful_shutdown_timeout_s == 30.0
    ingress = build_app({"device": "cpu", "num_gpu_blocks": 64, "drain_timeout_s": 30})
    # The ingress drains a failover wait longer, to resume what the engines' drain cut.
    assert ingress._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 90.0
    ingress = build_app({"device": "cpu", "num_gpu_blocks": 64, "drain_timeout_s": 30,
                         "failover_wait_s": 300, "resume_streams": False,
                         "allow_runtime_lora_updating": True})
    assert ingress._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 330.0
    *_, failover, lora_updates = ingress._bound_deployment.init_args
    assert failover == FailoverPolicy(resume=False, wait_s=300.0) and lora_updates is True
    # The ingress (clients' connections) is pinned to the head unless told otherwise.
    pinned = build_app({"device": "cpu", "num_gpu_blocks": 64})
    opts = pinned._bound_deployment.ray_actor_options
    assert opts["num_cpus"] == 0 and opts["resources"] == {"node:__internal_head__": 0.001}
    free = build_app({"device": "cpu", "num_gpu_blocks": 64, "ingress_on_head": False})
    assert "resources" not in free._bound_deployment.ray_actor_options
    with pytest.raises(ValueError, match="failover_wait_s"):
        build_app({"device": "cpu", "failover_wait_s": 0})
    assert _engine_node({}).init_args[5] == 1000.0  # checkpoints once a second by default
    with pytest.raises(ValueError, match="drain_timeout_s"):
        build_app({"device": "cpu", "drain_timeout_s": -1})
    with pytest.raises(ValueError, match="stream_interval_ms"):
        build_app({"device": "cpu", "stream_interval_ms": -1})
    with pytest.raises(ValueError, match="stream_messages_per_s"):
        build_app({"device": "cpu", "stream_messages_per_s": -5})
    with pytest.raises(ValueError, match="dtype"):
        build_app({"device": "cpu", "dtype": "int8"})


def test_every_deployment_stops_at_the_wait_loop_asked_for() -> None:
    """``graceful_shutdown_wait_loop_s`` (Serve's 2 s unless asked) reaches the ingress,
    the engine and prefill replicas and the response store: what an idle replica's
    stop takes, in a redeploy, a scale-down or a deletion."""
    def loops(app: object) -> dict[str, float]:
        out, todo = {}, [app._bound_deployment]
        while todo:
            d = todo.pop()
            out[d._name] = d._deployment_config.graceful_shutdown_wait_loop_s
            todo += [a._bound_deployment for a in d.init_args if hasattr(a, "_bound_deployment")]
            todo += [v._bound_deployment for v in d.init_kwargs.values()
                     if hasattr(v, "_bound_deployment")]
        return out

    args = {"device": "cpu", "num_gpu_blocks": 64, "prefill_replicas": 1,
            "enable_responses_store": True}
    assert set(loops(build_app(args)).values()) == {2.0}
    quick = loops(build_app({**args, "graceful_shutdown_wait_loop_s": 0.2}))
    assert len(quick) == 4 and set(quick.values()) == {0.2}, quick
    with pytest.raises(ValueError, match="graceful_shutdown_wait_loop_s"):
        build_app({"device": "cpu", "graceful_shutdown_wait_loop_s": 0})


def test_stream_message_budget_scales_with_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 4)
    assert placement.stream_message_budget(None) == 4 * placement.STREAM_MESSAGES_PER_CORE
    assert placement.stream_message_budget(0) == 0.0
    assert placement.stream_message_budget(12.5) == 12.5
    with pytest.raises(ValueError, match="stream_messages_per_s"):
        placement.stream_message_budget(-1)


def test_local_cluster_env_quiets_serve_unless_the_operator_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS",
              "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "RAY_enable_metrics_collection"):
        monkeypatch.delenv(k, raising=False)
    env = placement.local_cluster_env()
    assert env == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                   "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                   "RAY_enable_metrics_collection": "0"}
    assert "RAY_enable_metrics_collection" not in placement.local_cluster_env(dashboard=True)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    assert placement.local_cluster_env()["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"
