"""Provision Grafana for pagedserve: a Prometheus data source and the pagedserve dashboard.

    python deploy/grafana/provision.py --grafana-url http://127.0.0.1:3000 \\
        --prometheus-url http://127.0.0.1:9090 --user admin --password admin
    python deploy/grafana/provision.py --dry-run        # print the API payloads only

Uses ``grafana-client`` (``pip install grafana-client``) when it is installed, and
Grafana's HTTP API directly otherwise, so the script needs nothing beyond the standard
library. Re-running it is safe: the data source is reused and the dashboard overwritten.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("pagedserve-dashboard.json")
DATASOURCE_NAME = "pagedserve-prometheus"


def datasource_payload(prometheus_url: str) -> dict[str, Any]:
    return {"name": DATASOURCE_NAME, "type": "prometheus", "access": "proxy",
            "url": prometheus_url, "isDefault": False, "jsonData": {"timeInterval": "10s"}}


def dashboard_payload(datasource_uid: str | None) -> dict[str, Any]:
    """The dashboard with its ``datasource`` variable preset to the provisioned source."""
    dash = json.loads(DASHBOARD.read_text())
    dash.pop("id", None)
    if datasource_uid:
        for var in dash.get("templating", {}).get("list", []):
            if var.get("name") == "datasource":
                var["current"] = {"text": DATASOURCE_NAME, "value": datasource_uid}
    return {"dashboard": dash, "overwrite": True, "message": "provisioned by pagedserve"}


class _Http:
    """The three Grafana API calls this script needs, over urllib."""

    def __init__(self, url: str, user: str | None, password: str | None, token: str | None
                 ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        elif user:
            raw = f"{user}:{password or ''}".encode()
            self.headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=self.headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def ensure_datasource(self, payload: dict[str, Any]) -> str:
        try:
            return str(self._call("GET", f"/api/datasources/name/{DATASOURCE_NAME}")["uid"])
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        return str(self._call("POST", "/api/datasources", payload)["datasource"]["uid"])

    def put_dashboard(self, payload: dict[str, Any]) -> Any:
        return self._call("POST", "/api/dashboards/db", payload)


class _Client:
    """The same calls through ``grafana-client``."""

    def __init__(self, url: str, user: str | None, password: str | None, token: str | None
                 ) -> None:
        from grafana_client import GrafanaApi

        cred: Any = token if token else ((user, password or "") if user else None)
        self.api = GrafanaApi.from_url(url, credential=cred)

    def ensure_datasource(self, payload: dict[str, Any]) -> str:
        try:
            return str(self.api.datasource.get_datasource_by_name(DATASOURCE_NAME)["uid"])
        except Exception:  # grafana_client raises GrafanaClientError subclasses on 404
            return str(self.api.datasource.create_datasource(payload)["datasource"]["uid"])

    def put_dashboard(self, payload: dict[str, Any]) -> Any:
        return self.api.dashboard.update_dashboard(payload)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grafana-url", default="http://127.0.0.1:3000")
    p.add_argument("--prometheus-url", default="http://127.0.0.1:9090",
                   help="as Grafana's server reaches it")
    p.add_argument("--user", default=None)
    p.add_argument("--password", default=None)
    p.add_argument("--token", default=None, help="a Grafana service-account token")
    p.add_argument("--dry-run", action="store_true", help="print the payloads and exit")
    args = p.parse_args(argv)
    ds = datasource_payload(args.prometheus_url)
    if args.dry_run:
        print(json.dumps({"datasource": ds, "dashboard": dashboard_payload("<uid>")}, indent=1))
        return 0
    try:
        api: Any = _Client(args.grafana_url, args.user, args.password, args.token)
    except ImportError:
        api = _Http(args.grafana_url, args.user, args.password, args.token)
    uid = api.ensure_datasource(ds)
    result = api.put_dashboard(dashboard_payload(uid))
    print(f"data source {DATASOURCE_NAME} ({uid}); dashboard: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
