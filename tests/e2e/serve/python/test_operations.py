"""What an operator sees (issue 16): Prometheus metrics, the JSON access log with request
ids, lifecycle events in the log and through E2B's events API, signed webhooks with
retries. Sandboxes are made with the official SDK, as users make them; the operator's
side is read as Prometheus, a log shipper or a webhook receiver would read it.

run.sh starts the server with `--log-format json` and a 1 s webhook retry interval
(`CUBICLE_WEBHOOK_RETRY_INTERVAL`), and tells the tests where its log is
(`CUBICLE_E2E_SERVER_LOG`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional

import httpx
import pytest

from conftest import (
    API_KEY,
    CLUSTER,
    FAST_TEMPLATE,
    KEY_B,
    SPLIT_REPLICAS,
    TEMPLATE,
    Tracker,
    api,
    poll,
    unique,
)
from e2b import Sandbox

SERVER_LOG = os.environ.get("CUBICLE_E2E_SERVER_LOG", "")


# ---------------------------------------------------------------------------
# Prometheus


def scrape(key: Optional[str] = API_KEY, bearer: bool = True) -> httpx.Response:
    headers = {}
    if key and bearer:
        headers["Authorization"] = f"Bearer {key}"
    elif key:
        headers["X-API-KEY"] = key
    return api("GET", "/metrics", key=None, headers=headers)


def samples(text: str) -> Dict[str, float]:
    """`name{labels}` → value, from the OpenMetrics text."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        out[series] = float(value)
    return out


def value(s: Dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels`."""
    total = 0.0
    for series, v in s.items():
        base, _, rest = series.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if all(have.get(k) == want for k, want in labels.items()):
            total += v
    return total


@pytest.mark.skipif(
    SPLIT_REPLICAS,
    reason="counts data-plane requests in the API replica's metrics and log; split, they go through the other replica",
)
def test_metrics_are_for_the_operator_and_count_what_happens(sandboxes: Tracker):
    # Who may scrape: the admin team's key (Prometheus sends it as a bearer token).
    assert scrape(key=None).status_code == 401
    if KEY_B:
        r = scrape(KEY_B)
        assert r.status_code == 403, r.text
        assert r.json()["code"] == 403
    r = scrape()
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
    before = samples(r.text)
    assert scrape(bearer=False).status_code == 200, "X-API-KEY works too"

    sbx = sandboxes.create(TEMPLATE, timeout=120)  # the SDK runs commands with bash
    assert sbx.commands.run("echo hi").stdout == "hi\n"
    sbx.set_timeout(200)

    def after_sample():
        s = samples(scrape().text)
        # The sampler takes a sandbox's usage every 5 s.
        return s if value(s, "cubicle_sandbox_memory_bytes", sandbox_id=sbx.sandbox_id) > 0 else None

    s = poll(after_sample, timeout=15, interval=0.5)
    assert s, "no usage sample of the sandbox within 15 s"
    assert value(s, "cubicle_sandboxes", state="running", template=TEMPLATE) >= 1
    assert value(s, "cubicle_sandbox_cpu_seconds_total", sandbox_id=sbx.sandbox_id) > 0
    assert value(s, "cubicle_sandbox_disk_bytes", sandbox_id=sbx.sandbox_id) >= 0
    assert value(s, "cubicle_sandbox_operations_total", operation="create", outcome="ok") > value(
        before, "cubicle_sandbox_operations_total", operation="create", outcome="ok"
    )
    assert value(s, "cubicle_sandbox_create_duration_seconds_count") > value(
        before, "cubicle_sandbox_create_duration_seconds_count"
    )
    assert value(s, "cubicle_sandbox_first_command_duration_seconds_count") > value(
        before, "cubicle_sandbox_first_command_duration_seconds_count"
    )
    assert value(s, "cubicle_sandbox_lifecycle_events_total", type="sandbox.lifecycle.updated") >= 1
    for node in ("cubicle_node_cpus", "cubicle_node_memory_total_bytes", "cubicle_node_disk_total_bytes"):
        assert value(s, node) > 0, node
    if not CLUSTER:
        # A host's CPU time: a replica has no host of its own to report (the nodes'
        # totals above are summed from their statuses; CPU seconds are not in them).
        assert value(s, "cubicle_node_cpu_seconds_total", mode="idle") > 0
    # Routes are templates: no sandbox id ever becomes a route label.
    routes = {
        m for series in s for m in re.findall(r'route="([^"]*)"', series)
    }
    assert "/v2/sandboxes" in routes and "/sandboxes/{id}/timeout" in routes, routes
    assert "sandbox:envd/process.Process/Start" in routes, routes
    assert not any(sbx.sandbox_id in r for r in routes), routes

    sbx.kill()
    s = poll(
        lambda: (lambda x: x if value(x, "cubicle_sandbox_ends_total", reason="killed")
                 > value(before, "cubicle_sandbox_ends_total", reason="killed") else None)(samples(scrape().text)),
        timeout=10,
    )
    assert s, "the kill was not counted"
    assert value(s, "cubicle_sandbox_memory_bytes", sandbox_id=sbx.sandbox_id) == 0, (
        "a dead sandbox's usage series are gone"
    )


# ---------------------------------------------------------------------------
# logs


def log_lines() -> List[dict]:
    out = []
    with open(SERVER_LOG, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


@pytest.mark.skipif(
    SPLIT_REPLICAS,
    reason="counts data-plane requests in the API replica's metrics and log; split, they go through the other replica",
)
@pytest.mark.skipif(not SERVER_LOG, reason="CUBICLE_E2E_SERVER_LOG not set (run.sh sets it)")
def test_json_access_log_with_request_ids_and_lifecycle_lines(sandboxes: Tracker):
    rid = f"e2e-{unique()}"
    r = api("GET", "/v2/sandboxes", headers={"X-Request-Id": rid})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == rid, "the client's request id comes back"
    r = api("GET", "/v2/sandboxes")
    generated = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated), generated
    r = api("GET", "/v2/sandboxes", headers={"X-Request-Id": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"

    sbx = sandboxes.create(TEMPLATE, timeout=120, metadata={"e2e": "log"})
    sbx.commands.run("true")
    sbx.kill()

    def find():
        lines = log_lines()
        mine = [l for l in lines if l.get("request_id") == rid]
        ended = [l for l in lines if l.get("target") == "cubicle::lifecycle"
                 and l.get("sandbox") == sbx.sandbox_id and l.get("event") == "sandbox.lifecycle.killed"]
        return (mine, lines) if mine and ended else None

    found = poll(find, timeout=10)
    assert found, "the access line or the lifecycle line is missing from the log"
    mine, lines = found
    line = mine[0]
    assert line["target"] == "cubicle::access" and line["level"] == "INFO"
    assert line["method"] == "GET" and line["route"] == "/v2/sandboxes" and line["status"] == 200
    assert isinstance(line["duration_ms"], (int, float)) and "timestamp" in line
    assert line["client"].startswith("127.0.0.1:")
    created = [l for l in lines if l.get("target") == "cubicle::lifecycle"
               and l.get("sandbox") == sbx.sandbox_id and l.get("event") == "sandbox.lifecycle.created"]
    assert created and created[0]["level"] == "INFO" and created[0]["team"] == "admin"
    # The data plane is logged too, with its sandbox and a bounded route label.
    starts = [l for l in lines if l.get("target") == "cubicle::access"
              and l.get("sandbox") == sbx.sandbox_id and l.get("route") == "sandbox:envd/process.Process/Start"]
    assert starts, "no access line for the command's process.Process/Start"
    # Every line is JSON (no stray text from the server).
    with open(SERVER_LOG, errors="replace") as f:
        stray = [l for l in f if l.strip() and not l.startswith("{") and not l.startswith("export ")
                 and not l.startswith("#") and l.strip() != "cubicle: ready"]
    assert not stray, f"non-JSON lines in the server log: {stray[:5]}"


# ---------------------------------------------------------------------------
# lifecycle events and webhooks


class Receiver:
    """A webhook endpoint on 127.0.0.1 that answers 500 to its first `fail_first`
    deliveries and records everything."""

    def __init__(self, fail_first: int = 0):
        self.fail_first = fail_first
        self.seen: List[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with outer.lock:
                    outer.seen.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                    failing = len(outer.seen) <= outer.fail_first
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def deliveries(self) -> List[dict]:
        with self.lock:
            return list(self.seen)

    def close(self):
        self.server.shutdown()


def e2b_signature(secret: str, body: bytes) -> str:
    """As E2B documents it: sha256(secret + payload), base64, padding removed."""
    return base64.b64encode(hashlib.sha256(secret.encode() + body).digest()).decode().rstrip("=")


def test_events_api_and_signed_webhooks_with_retries(sandboxes: Tracker):
    rx = Receiver(fail_first=1)
    secret = f"secret-{unique()}"
    hook = None
    try:
        r = api("POST", "/events/webhooks", json={
            "name": "e2e", "url": rx.url, "enabled": True, "signatureSecret": secret,
            "events": ["sandbox.lifecycle.created", "sandbox.lifecycle.updated", "sandbox.lifecycle.killed"],
        })
        assert r.status_code == 201, r.text
        hook = r.json()
        assert set(hook) >= {"id", "teamId", "name", "createdAt", "enabled", "url", "events"}
        assert "signatureSecret" not in hook
        assert api("GET", f"/events/webhooks/{hook['id']}").json()["url"] == rx.url

        tag = unique()
        sbx = sandboxes.create(FAST_TEMPLATE, timeout=120, metadata={"tag": tag})
        sbx.set_timeout(300)
        sbx.kill()

        def three_events():
            got = {}
            for d in rx.deliveries():
                ev = json.loads(d["body"])
                if ev["sandboxId"] == sbx.sandbox_id:
                    got.setdefault(ev["id"], []).append((ev, d))
            # three events, one of them twice (the failed first attempt and its retry)
            return got if len(got) == 3 and sum(map(len, got.values())) >= 4 else None

        # The first delivery fails (500) and comes again after the retry interval.
        got = poll(three_events, timeout=20, interval=0.3)
        assert got, f"webhook deliveries: {rx.deliveries()}"
        by_type = {}
        for attempts in got.values():
            for ev, d in attempts:
                h = d["headers"]
                assert h["e2b-signature"] == e2b_signature(secret, d["body"]), "signature as E2B signs"
                assert h["e2b-signature-version"] == "v1"
                assert h["e2b-webhook-id"] == hook["id"]
                assert h["content-type"] == "application/json"
            ev = attempts[0][0]
            by_type[ev["type"]] = (ev, attempts)
        assert set(by_type) == {"sandbox.lifecycle.created", "sandbox.lifecycle.updated", "sandbox.lifecycle.killed"}
        retried = [a for _, a in by_type.values() if len(a) > 1]
        assert len(retried) == 1, "exactly the first delivery was retried"
        ids = {d["headers"]["e2b-delivery-id"] for _, d in retried[0]}
        assert len(ids) == len(retried[0]), "every attempt has its own delivery id"
        created = by_type["sandbox.lifecycle.created"][0]
        assert created["version"] == "v1" and created["sandboxTemplateId"] == FAST_TEMPLATE
        assert created["eventData"]["sandbox_metadata"] == {"tag": tag}
        assert created["sandboxTeamId"] == "admin"
        killed = by_type["sandbox.lifecycle.killed"][0]
        assert set(killed["eventData"]["execution"]) == {"started_at", "vcpu_count", "memory_mb", "execution_time"}
        assert killed["sandboxExecutionId"] == created["sandboxExecutionId"]

        # The events API (E2B's): newest first by default, oldest first with orderAsc.
        evs = api("GET", f"/events/sandboxes/{sbx.sandbox_id}?orderAsc=true").json()
        assert [e["type"] for e in evs] == [
            "sandbox.lifecycle.created", "sandbox.lifecycle.updated", "sandbox.lifecycle.killed"]
        assert evs[1]["eventData"]["set_timeout"].endswith("Z")
        newest = api("GET", f"/events/sandboxes/{sbx.sandbox_id}?limit=1").json()
        assert [e["id"] for e in newest] == [evs[-1]["id"]]
        only = api("GET", "/events/sandboxes", params={"types": "sandbox.lifecycle.updated", "limit": 100}).json()
        assert only and all(e["type"] == "sandbox.lifecycle.updated" for e in only)
        if KEY_B:
            assert api("GET", f"/events/sandboxes/{sbx.sandbox_id}", key=KEY_B).json() == []
            assert api("GET", f"/events/webhooks/{hook['id']}", key=KEY_B).status_code == 404
            assert hook["id"] not in {w["id"] for w in api("GET", "/events/webhooks", key=KEY_B).json()}

        # Disabled: nothing more arrives.
        r = api("PATCH", f"/events/webhooks/{hook['id']}", json={"enabled": False})
        assert r.status_code == 200 and r.json()["enabled"] is False
        n = len(rx.deliveries())
        other = sandboxes.create(FAST_TEMPLATE, timeout=60)
        assert poll(lambda: api("GET", f"/events/sandboxes/{other.sandbox_id}").json(), timeout=5)
        time.sleep(1.5)
        assert len(rx.deliveries()) == n, "a disabled webhook got a delivery"
    finally:
        if hook:
            assert api("DELETE", f"/events/webhooks/{hook['id']}").status_code == 200
            assert api("GET", f"/events/webhooks/{hook['id']}").status_code == 404
        rx.close()


def test_webhook_validation_errors_are_e2b_shaped():
    base = {"name": "x", "url": "http://127.0.0.1:9/x", "events": ["sandbox.lifecycle.created"],
            "signatureSecret": "s"}
    for change in ({"url": "ftp://x"}, {"events": []}, {"events": ["sandbox.lifecycle.exploded"]},
                   {"name": ""}, {"signatureSecret": ""}):
        r = api("POST", "/events/webhooks", json={**base, **change})
        assert r.status_code == 400, (change, r.text)
        assert r.json()["code"] == 400 and r.json()["message"]
    assert api("GET", "/events/webhooks/nope").status_code == 404
    assert api("GET", "/events/sandboxes?limit=1000").status_code == 400
    assert api("GET", "/events/webhooks", key=None).status_code == 401
