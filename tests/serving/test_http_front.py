"""Choosing the HTTP front (``cluster/http_front.py``) without starting Ray."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cluster import http_front


def test_auto_is_haproxy_where_ray_serve_bundles_it_else_the_proxy() -> None:
    expected = "haproxy" if http_front.haproxy_binary() else "proxy"
    assert http_front.resolve_ingress("auto") == expected
    if sys.platform.startswith("linux"):
        assert expected == "haproxy", "ray[serve] installs HAProxy on Linux"
    assert http_front.resolve_ingress("proxy") == "proxy"
    assert http_front.ingress_env("proxy") == {}
    with pytest.raises(ValueError, match="ingress must be one of"):
        http_front.resolve_ingress("nginx")


def test_haproxy_env_takes_free_ports_unless_the_operator_set_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not http_front.haproxy_binary():
        pytest.skip("no HAProxy binary here")
    for var in http_front.HAPROXY_PORTS:
        monkeypatch.delenv(var, raising=False)
    env = http_front.ingress_env("haproxy")
    assert env[http_front.HAPROXY] == "1" and env[http_front.ENABLE] == "1"
    ports = {int(env[v]) for v in http_front.HAPROXY_PORTS}
    assert len(ports) == 4 and not ports & {8404, 9101, 8500, 9500}
    monkeypatch.setenv(http_front.HAPROXY_PORTS[0], "18404")
    assert http_front.ingress_env("haproxy")[http_front.HAPROXY_PORTS[0]] == "18404"


def test_direct_env_shortens_the_drain_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(http_front.DRAINING, raising=False)
    env = http_front.ingress_env("direct")
    assert env == {http_front.ENABLE: "1", http_front.DRAINING: "2"}
    monkeypatch.setenv(http_front.DRAINING, "30")
    assert http_front.ingress_env("direct")[http_front.DRAINING] == "30"


def test_leftover_haproxy_of_a_node_is_stopped_and_no_other(tmp_path: Path) -> None:
    """Stand-ins named ``haproxy`` (Python under that name), configs under node directories."""
    fake = tmp_path / "haproxy"
    fake.symlink_to(sys.executable)

    def start(node: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([str(fake), "-c", "import time; time.sleep(60)",
                                 "-f", f"/tmp/haproxy-serve/{node}/haproxy.cfg"])

    mine, other = start("a" * 56), start("b" * 56)
    try:
        assert http_front.stop_leftover_haproxy("a" * 56) == 1
        assert mine.wait(10) == -signal.SIGTERM and other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
