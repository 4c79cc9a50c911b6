"""Secrets through the official Python SDK (issue 17): E2B's `/secrets` routes, values
write-only (no read surface returns one), by id or name, paging, team isolation, and a
value that never reaches Cubicle's database or log in clear.

Header injection of `${e2b.secrets.NAME}` by the egress proxy (network rules) is in
test_network.py (it needs the private internet of netlab/).

Every secret a test makes is deleted in `finally`.
"""

from __future__ import annotations

import os
import secrets as pysecrets
from typing import Iterator, List

import pytest

from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException

from conftest import API_KEY, KEY_B, api, unique

STATE_DIR = os.environ.get("CUBICLE_E2E_STATE_DIR", "")
SERVE_LOG = os.environ.get("CUBICLE_E2E_SERVE_LOG", "")


class Secrets:
    """Makes secrets and deletes every one at teardown."""

    def __init__(self) -> None:
        self.made: List[str] = []

    def create(self, value: str, name: str | None = None, **kw):
        info = Secret.create(name or f"e2e-{unique()}", value, **kw)
        self.made.append(info.secret_id)
        return info

    def cleanup(self) -> None:
        for sid in self.made:
            Secret.destroy(sid)


@pytest.fixture
def made() -> Iterator[Secrets]:
    s = Secrets()
    try:
        yield s
    finally:
        s.cleanup()


def test_secret_routes(made: Secrets):
    name = f"E2E-{unique()}"
    value = "tok-" + pysecrets.token_hex(16)
    info = made.create(value, name=name, metadata={"owner": "e2e"})
    assert info.secret_id.startswith("sec_")
    # Names are case-insensitive and stored lowercase.
    assert (info.name, info.version, info.metadata) == (name.lower(), 1, {"owner": "e2e"})
    assert info.created_at.tzinfo is not None
    for key in (info.secret_id, name, name.lower(), info.secret_id.upper()):
        got = Secret.get_info(key)
        assert (got.secret_id, got.version) == (info.secret_id, 1), key
    assert Secret.exists(name) and not Secret.exists(f"nope-{unique()}")
    with pytest.raises(SecretException) as e:
        Secret.create(name.lower(), "other")
    assert "already" in str(e.value) or "409" in str(e.value), e.value
    # An update is a new version; metadata is replaced only when given.
    up = Secret.update(name, value + "-2")
    assert (up.version, up.metadata) == (2, {"owner": "e2e"})
    up = Secret.update(info.secret_id, value + "-3", metadata={})
    assert (up.version, up.metadata) == (3, {})
    with pytest.raises(SecretNotFoundException):
        Secret.update(f"nope-{unique()}", "x")
    # No read surface returns a value: details, list, update answers.
    for r in (
        api("GET", f"/secrets/{info.secret_id}"),
        api("GET", "/secrets"),
        api("POST", f"/secrets/{info.secret_id}", json={"value": value}),
    ):
        assert r.status_code == 200, r.text
        items = r.json() if isinstance(r.json(), list) else [r.json()]
        assert value not in r.text and all("value" not in i for i in items), r.text
    made.made.clear()
    assert Secret.destroy(name) is True
    assert Secret.destroy(info.secret_id) is False
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(info.secret_id)


def test_secret_list_pages(made: Secrets):
    tag = unique()
    names = [f"e2e-page-{tag}-{i}" for i in range(3)]
    for n in names:
        made.create("v", name=n)
    seen = []
    pages = 0
    paginator = Secret.list(limit=1)
    while paginator.has_next:
        page = paginator.next_items()
        assert len(page) <= 1
        seen += [s.name for s in page]
        pages += 1
        assert pages < 1000
    assert [n for n in seen if tag in n] == names
    assert seen == sorted(seen), "pages are ordered by name"


def test_bad_secrets_are_refused(made: Secrets):
    for name in ("a b", "sec_reserved", "x" * 129):
        r = api("POST", "/secrets", json={"name": name, "value": "v"})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["code"] == 400 and r.json()["message"]
    for value in ("", "a\r\nX-Injected: 1", "a\0b", "x" * 8193):
        r = api("POST", "/secrets", json={"name": f"e2e-{unique()}", "value": value})
        assert r.status_code == 400, r.text
    # A malformed body is refused without echoing what it held.
    r = api("POST", "/secrets", json={"name": f"e2e-{unique()}", "value": 9182736450})
    assert r.status_code == 400 and "9182736450" not in r.text, r.text
    assert api("GET", "/secrets", key=None).status_code == 401
    assert api("GET", "/secrets", key="e2b_" + "0" * 40).status_code == 401


@pytest.mark.skipif(not KEY_B, reason="no second team's key")
def test_secrets_are_per_team(made: Secrets):
    info = made.create("team-a-value")
    assert Secret.exists(info.secret_id)
    assert not Secret.exists(info.secret_id, api_key=KEY_B)
    assert not Secret.exists(info.name, api_key=KEY_B)
    assert Secret.destroy(info.secret_id, api_key=KEY_B) is False
    with pytest.raises(SecretNotFoundException):
        Secret.update(info.name, "stolen", api_key=KEY_B)
    paginator = Secret.list(api_key=KEY_B)
    while paginator.has_next:
        assert all(s.secret_id != info.secret_id for s in paginator.next_items())
    # The same name is free in another team.
    other = Secret.create(info.name, "team-b-value", api_key=KEY_B)
    try:
        assert other.secret_id != info.secret_id
        assert Secret.get_info(info.name).secret_id == info.secret_id
    finally:
        Secret.destroy(other.secret_id, api_key=KEY_B)


@pytest.mark.single_host("reads the server's SQLite file (on PostgreSQL the store's own tests check the sealing)")
@pytest.mark.skipif(not STATE_DIR, reason="CUBICLE_E2E_STATE_DIR is not set")
def test_value_is_not_stored_or_logged_in_clear(made: Secrets):
    value = "clear-" + pysecrets.token_hex(24)
    info = made.create(value)
    Secret.update(info.secret_id, value + "-v2")
    # The database (and its write-ahead log) hold only the sealed value.
    files = [os.path.join(STATE_DIR, f) for f in os.listdir(STATE_DIR) if f.startswith("cubicle.db")]
    assert files, f"no database in {STATE_DIR}"
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        assert value.encode() not in data, f"secret value in clear in {path}"
    if SERVE_LOG:
        with open(SERVE_LOG, "rb") as f:
            log = f.read()
        assert info.secret_id.encode() in log, "the log should name the secret it created"
        assert value.encode() not in log, "secret value in the server's log"
