"""The OpenAPI description (`GET /openapi.json`, generated from the route definitions)
against the running server: schemathesis (pinned in tests/e2e/schemathesis-requirements.txt,
its own venv tests/e2e/.venv-schemathesis) generates requests from it — valid and
invalid bodies, parameters and headers, with and without credentials — and checks every
answer: no 5xx, every status documented, every body matching its schema, valid data
accepted, invalid data refused, a deleted resource gone.

It runs with the key of a team of its own (`cubicle apikey create --team schemathesis`);
afterwards every sandbox of that team is killed with the operator's key (the fuzzer may
have made its own key useless), and the team's keys are revoked.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import API_KEY, API_URL, api, record_id

ROOT = Path(__file__).resolve().parents[4]
# The description's checks and their two reasoned exceptions: schemathesis.toml here.
SCHEMATHESIS = ROOT / "tests/e2e/.venv-schemathesis/bin/schemathesis"
CUBICLE_BIN = os.environ.get("CUBICLE_BIN", str(ROOT / "target/debug/cubicle"))
STATE_DIR = os.environ.get("CUBICLE_E2E_STATE_DIR", "")


def test_the_description_is_served_and_names_the_routes():
    r = api("GET", "/openapi.json", key=None)
    assert r.status_code == 200
    spec = r.json()
    assert spec["openapi"].startswith("3.")
    paths = spec["paths"]
    for p in ("/v2/sandboxes", "/sandboxes/{id}", "/sandboxes/{id}/timeout", "/v2/sandboxes/{id}/connect",
              "/sandboxes/{id}/logs", "/v2/sandboxes/{id}/logs", "/sandboxes/{id}/metrics",
              "/events/sandboxes", "/events/webhooks", "/events/webhooks/{webhookID}", "/metrics",
              "/cubicle/pool", "/health", "/sandboxes/{id}/network", "/cubicle/sandboxes/{id}/netlog",
              "/snapshots", "/templates/{id}", "/templates", "/default-templates", "/templates/{id}/tags",
              "/v3/templates", "/templates/{id}/files/{hash}", "/v2/templates/{id}/builds/{build}",
              "/templates/{id}/builds/{build}/status", "/cubicle/templates/{id}/builds/{build}/cancel",
              "/templates/tags", "/cubicle/templates/gc", "/cubicle/uploads/{token}",
              "/sandboxes/{id}/pause",
              "/sandboxes/{id}/resume", "/sandboxes/{id}/snapshots", "/sandboxes/{id}/fork",
              "/sandboxes/{id}/rollback", "/volumes", "/volumes/{volumeID}",
              "/volumecontent/{volumeID}/dir", "/volumecontent/{volumeID}/path",
              "/volumecontent/{volumeID}/file", "/secrets", "/secrets/{s}"):
        assert p in paths, p
    assert spec["components"]["securitySchemes"]["ApiKeyAuth"] == {
        "type": "apiKey", "in": "header", "name": "X-API-KEY"}


@pytest.mark.skipif(not SCHEMATHESIS.exists(), reason="schemathesis not installed: scripts/install-test-deps.sh")
@pytest.mark.skipif(not STATE_DIR, reason="CUBICLE_E2E_STATE_DIR not set (run.sh sets it)")
def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path):
    key = subprocess.run(
        [CUBICLE_BIN, "apikey", "create", "--team", "schemathesis", "--state-dir", STATE_DIR],
        check=True, capture_output=True, text=True,
    ).stdout.strip().split()[-1]
    report = tmp_path / "report.json"
    try:
        run = subprocess.run(
            [str(SCHEMATHESIS), "--config-file", str(Path(__file__).parent / "schemathesis.toml"),
             "run", f"{API_URL}/openapi.json",
             "--url", API_URL,
             "--header", f"X-API-KEY: {key}",
             "--max-examples", os.environ.get("CUBICLE_E2E_SCHEMATHESIS_EXAMPLES", "30"),
             "--seed", os.environ.get("CUBICLE_E2E_SCHEMATHESIS_SEED", "1616"),
             "--request-timeout", "60",
             "--workers", "1",
             "--no-color",
             "--report", "ndjson", "--report-ndjson-path", str(report)],
            capture_output=True, text=True, timeout=1800,
            cwd=Path(__file__).parent,
            env={**os.environ, "CUBICLE_E2E_ADMIN_KEY": os.environ.get("E2B_API_KEY", "")},
        )
        print(run.stdout[-20000:])
        print(run.stderr[-5000:])
        assert run.returncode == 0, "schemathesis found problems (see the output above)"
    finally:
        _clean_up_team("schemathesis", key)


def _clean_up_team(team: str, key: str) -> None:
    """Kill every sandbox of `team`, delete its webhooks and revoke all its keys (also
    those the fuzzer made). Sandboxes are found and killed with the operator's key
    (`/cubicle/sandboxes`), so that this works whatever the fuzzer did to its own key;
    a failing listing fails the test instead of leaving sandboxes behind unnoticed."""
    left = []
    for _ in range(20):
        left = []
        r = api("GET", "/cubicle/sandboxes", key=API_KEY)
        assert r.status_code == 200, f"listing the host's sandboxes: {r.status_code} {r.text}"
        mine = [s["sandboxID"] for s in r.json() if s["team"] == team]
        # The operator's view lists running sandboxes only; the fuzzer's may have paused
        # (autoPause with a short timeout): those are found with the team's own key.
        p = api("GET", "/v2/sandboxes?state=paused", key=key)
        if p.status_code == 200:
            mine += [s["sandboxID"] for s in p.json() if s["sandboxID"] not in mine]
        if not mine:
            break
        for sid in mine:
            record_id(sid)
            d = api("DELETE", f"/cubicle/sandboxes/{sid}", key=API_KEY)
            if d.status_code not in (204, 404):
                left.append((sid, d.status_code, d.text))
        if left:
            time.sleep(0.5)
    r = api("GET", "/events/webhooks", key=key)
    if r.status_code == 200:
        for w in r.json():
            api("DELETE", f"/events/webhooks/{w['id']}", key=key)
    # Snapshots, volumes and secrets the fuzzer made (with its key, before it is revoked).
    for _ in range(20):
        r = api("GET", "/snapshots?limit=100", key=key)
        if r.status_code != 200 or not r.json():
            break
        for snap in r.json():
            # A named snapshot's id is its name, `team/name:tag`: one path segment.
            d = api("DELETE", f"/templates/{quote(snap['snapshotID'], safe='')}", key=key)
            assert d.status_code in (204, 404), f"deleting snapshot {snap}: {d.status_code} {d.text}"
    r = api("GET", "/volumes", key=key)
    if r.status_code == 200:
        for v in r.json():
            d = api("DELETE", f"/volumes/{v['volumeID']}", key=key)
            assert d.status_code == 204, f"deleting volume {v}: {d.status_code} {d.text}"
    r = api("GET", "/secrets", key=key)
    if r.status_code == 200:
        for sec in r.json():
            api("DELETE", f"/secrets/{sec['secretID']}", key=key)
    r = api("GET", "/cubicle/api-keys", key=API_KEY)
    assert r.status_code == 200, f"listing API keys: {r.status_code} {r.text}"
    for k in r.json():
        if k["team"] == team and not k.get("revokedAt"):
            subprocess.run([CUBICLE_BIN, "apikey", "revoke", k["prefix"], "--state-dir", STATE_DIR],
                           capture_output=True, text=True)
    assert not left, f"could not kill {left}"
