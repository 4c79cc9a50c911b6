"""Access token and signed file URLs.

A second envd is started and given an access token with `POST /init` (as the node
does at sandbox boot). The SDK sandbox object is then built exactly as the SDK
builds one from a create response carrying `envdAccessToken` (see
conftest.sdk_sandbox_for), so `X-Access-Token` is sent on every call and
`download_url()` / `upload_url()` are signed. The signed URLs are then used the
way a browser or curl would: plain HTTP, no headers."""

from __future__ import annotations

import urllib.parse
import uuid

import httpx
import pytest
from e2b import AuthenticationException, InvalidArgumentException, Sandbox

from conftest import SecuredEnvd, sdk_sandbox_for
from helpers import unary


def _with_query(url: str, **changes) -> str:
    parts = urllib.parse.urlsplit(url)
    q = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    for k, v in changes.items():
        if v is None:
            q.pop(k, None)
        else:
            q[k] = v
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(q, quote_via=urllib.parse.quote)))


def _query(url: str) -> dict:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))


def _assert_401_json(r: httpx.Response):
    assert r.status_code == 401, f"{r.status_code} {r.text!r}"
    body = r.json()
    assert body.get("code") == 401 and body.get("message"), body


# --- token enforcement ------------------------------------------------------------


def test_health_needs_no_token(secured_envd: SecuredEnvd):
    assert httpx.get(f"{secured_envd.url}/health").status_code == 204


def test_rpc_without_or_with_wrong_token_is_401(secured_envd: SecuredEnvd):
    _assert_401_json(unary(secured_envd.url, "filesystem.Filesystem/Stat", {"path": "/"}))
    _assert_401_json(
        unary(secured_envd.url, "filesystem.Filesystem/Stat", {"path": "/"}, headers={"X-Access-Token": "wrong"})
    )
    ok = unary(secured_envd.url, "filesystem.Filesystem/Stat", {"path": "/"}, headers={"X-Access-Token": secured_envd.token})
    assert ok.status_code == 200, ok.text


def test_files_and_envs_need_token(secured_envd: SecuredEnvd):
    _assert_401_json(httpx.get(f"{secured_envd.url}/files", params={"path": "/etc/hostname"}))
    _assert_401_json(httpx.post(f"{secured_envd.url}/files", params={"path": "/tmp/x"}, files={"file": ("x", b"x")}))
    _assert_401_json(httpx.get(f"{secured_envd.url}/envs"))
    r = httpx.get(f"{secured_envd.url}/envs", headers={"X-Access-Token": secured_envd.token})
    assert r.status_code == 200
    assert r.json().get("CUBICLE_INIT_VAR") == "from-init"


def test_sdk_without_token_gets_authentication_exception(secured_envd: SecuredEnvd):
    anonymous = sdk_sandbox_for(Sandbox, secured_envd.url, None)
    with pytest.raises(AuthenticationException):
        anonymous.commands.run("true")
    wrong = sdk_sandbox_for(Sandbox, secured_envd.url, "not-the-token")
    with pytest.raises(AuthenticationException):
        wrong.files.list("/")


def test_sdk_with_token_and_init_settings(secured_sbx: Sandbox, secured_envd: SecuredEnvd):
    r = secured_sbx.commands.run('echo "$CUBICLE_INIT_VAR|$(whoami)|$(pwd)|$HOME"')
    assert r.stdout == f"from-init|user|{secured_envd.workdir}|/home/user\n", "defaultWorkdir from /init"
    # a root command without cwd starts in the workdir too; relative paths resolve
    # against the acting user's home, not the workdir (E2B's envd)
    assert secured_sbx.commands.run("pwd", user="root").stdout == f"{secured_envd.workdir}\n"
    n = uuid.uuid4().hex[:8]
    info = secured_sbx.files.write(f"rel-{n}.txt", "w")
    assert info.path == f"/home/user/rel-{n}.txt"
    secured_sbx.files.remove(info.path)
    assert secured_sbx.files.get_info("~").path == "/home/user"
    assert secured_sbx.commands.run("pwd", cwd="/").stdout == "/\n"
    r = secured_sbx.commands.run("echo $CUBICLE_INIT_VAR", envs={"CUBICLE_INIT_VAR": "per-call"})
    assert r.stdout == "per-call\n", "per-call envs override /init envs"
    p = f"/home/user/tok-{uuid.uuid4().hex[:8]}.txt"
    secured_sbx.files.write(p, "secured")
    assert secured_sbx.files.read(p) == "secured"
    secured_sbx.files.remove(p)


async def test_async_sdk_with_token(secured_asbx):
    r = await secured_asbx.commands.run("echo ok")
    assert r.stdout == "ok\n"


# --- signed URLs ----------------------------------------------------------------------


@pytest.fixture
def signed_file(secured_sbx: Sandbox):
    p = f"/home/user/signed-{uuid.uuid4().hex[:8]}.txt"
    secured_sbx.files.write(p, "signed content")
    yield p
    secured_sbx.files.remove(p, user="root")


def test_download_url_without_expiration(secured_sbx: Sandbox, signed_file: str):
    url = secured_sbx.download_url(signed_file)
    q = _query(url)
    assert q["path"] == signed_file and q["signature"].startswith("v1_")
    assert "signature_expiration" not in q
    r = httpx.get(url)
    assert r.status_code == 200, r.text
    assert r.content == b"signed content"


def test_download_url_with_expiration(secured_sbx: Sandbox, signed_file: str):
    url = secured_sbx.download_url(signed_file, use_signature_expiration=120)
    assert "signature_expiration" in _query(url)
    r = httpx.get(url)
    assert r.status_code == 200, r.text
    assert r.content == b"signed content"


def test_download_url_as_root(secured_sbx: Sandbox):
    p = f"/root/signed-root-{uuid.uuid4().hex[:8]}"
    secured_sbx.files.write(p, "root only", user="root")
    try:
        assert httpx.get(secured_sbx.download_url(p, user="root")).content == b"root only"
        # the default user may not read /root: signed as `user` still fails on permissions
        assert httpx.get(secured_sbx.download_url(p)).status_code != 200
    finally:
        secured_sbx.files.remove(p, user="root")


def test_expired_download_url_is_401(secured_sbx: Sandbox, signed_file: str):
    url = secured_sbx.download_url(signed_file, use_signature_expiration=-30)
    _assert_401_json(httpx.get(url))


def test_tampered_urls_are_401(secured_sbx: Sandbox, signed_file: str):
    url = secured_sbx.download_url(signed_file)
    sig = _query(url)["signature"]
    bad = sig[:-2] + ("AA" if not sig.endswith("AA") else "BB")
    _assert_401_json(httpx.get(_with_query(url, signature=bad)))
    _assert_401_json(httpx.get(_with_query(url, signature=None)))
    _assert_401_json(httpx.get(_with_query(url, signature="v1_")))
    _assert_401_json(httpx.get(_with_query(url, signature="garbage")))
    # a signature is bound to its path, user and operation
    _assert_401_json(httpx.get(_with_query(url, path="/etc/passwd")))
    _assert_401_json(httpx.get(_with_query(url, username="root")))
    _assert_401_json(httpx.post(url, files={"file": ("f", b"overwrite")}))
    # dropping or moving the expiration of an expiring signature breaks it
    exp_url = secured_sbx.download_url(signed_file, use_signature_expiration=120)
    _assert_401_json(httpx.get(_with_query(exp_url, signature_expiration=None)))
    exp = int(_query(exp_url)["signature_expiration"])
    _assert_401_json(httpx.get(_with_query(exp_url, signature_expiration=str(exp + 1000))))
    assert secured_sbx.files.read(signed_file) == "signed content"


def test_upload_url_without_expiration(secured_sbx: Sandbox):
    p = f"/home/user/up-{uuid.uuid4().hex[:8]}/new.txt"
    url = secured_sbx.upload_url(p)
    r = httpx.post(url, files={"file": ("local-name.txt", b"uploaded by browser", "text/plain")})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and body[0]["path"] == p
    assert secured_sbx.files.read(p) == "uploaded by browser"
    assert secured_sbx.files.get_info(p).owner == "user"
    # the upload URL does not grant reads
    _assert_401_json(httpx.get(url))


def test_upload_url_with_expiration(secured_sbx: Sandbox):
    p = f"/home/user/upx-{uuid.uuid4().hex[:8]}.txt"
    url = secured_sbx.upload_url(p, use_signature_expiration=60)
    assert "signature_expiration" in _query(url)
    r = httpx.post(url, files={"file": ("x.txt", b"expiring upload")})
    assert r.status_code == 200, r.text
    assert secured_sbx.files.read(p) == "expiring upload"
    expired = secured_sbx.upload_url(p, use_signature_expiration=-1)
    _assert_401_json(httpx.post(expired, files={"file": ("x.txt", b"late")}))
    assert secured_sbx.files.read(p) == "expiring upload"


def test_upload_url_octet_stream(secured_sbx: Sandbox):
    p = f"/home/user/upo-{uuid.uuid4().hex[:8]}.bin"
    url = secured_sbx.upload_url(p)
    r = httpx.post(url, content=b"\x00raw\xff", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert bytes(secured_sbx.files.read(p, format="bytes")) == b"\x00raw\xff"


def test_unsigned_urls_without_token(sbx: Sandbox, home_dir: str):
    """No token configured (the debug-mode envd): URLs are unsigned and work as is."""
    p = f"{home_dir}/plain.txt"
    sbx.files.write(p, "plain")
    url = sbx.download_url(p)
    assert "signature" not in _query(url)
    assert httpx.get(url).content == b"plain"
    up = sbx.upload_url(f"{home_dir}/plain-up.txt")
    assert httpx.post(up, files={"file": ("a", b"up")}).status_code == 200
    assert sbx.files.read(f"{home_dir}/plain-up.txt") == "up"
    with pytest.raises(InvalidArgumentException):
        sbx.download_url(p, use_signature_expiration=10)
