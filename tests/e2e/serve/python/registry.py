"""A local OCI registry for the template tests, with images this module makes itself.

`Registry.start()` runs Debian's `docker-registry` (the reference distribution server)
on a free loopback port of the test's private network namespace (against a cluster: on
the address its nodes reach this namespace by), optionally behind htpasswd basic auth. Images are OCI layouts written here from files of this host (one
gzipped tar per layer, entries sorted and timestamps fixed, so the same directory makes
the same layer in every image) and pushed with Debian's `skopeo copy`. (Debian 12's
`umoci` 0.4.7 was tried first: on this machine its `insert` cut the last ~700 bytes off
a layer's gzip stream, so the last file of a layer arrived truncated.)

  sh:1      busybox (its applets as symlinks) + bash and the libraries it needs, and an
            /etc/passwd with root only (so the E2B additions must add `user`)
  big:1     sh:1's layer + a second layer of ~30 MB (Python's standard library): the
            two images share sh:1's layer
  static:1  one statically linked file and nothing else (no shell, no libc)
  broken:1  a layer whose content does not match the config's diff id
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

BASE_PYTHON_LIB = "usr/lib/python3.11"


def free_port(addr: str = "127.0.0.1") -> int:
    s = socket.socket()
    s.bind((addr, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


class Registry:
    def __init__(self, auth: Optional[Tuple[str, str]] = None, addr: str = "127.0.0.1"):
        # addr: where the builds reach it (a cluster's nodes: an address of this host
        # their network namespaces route to)
        self.addr = addr
        self.port = free_port(addr)
        self.host = f"{addr}:{self.port}"
        self.auth = auth
        self.dir = Path(tempfile.mkdtemp(prefix="cubicle-e2e-registry-"))
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Registry":
        cfg = {
            "version": 0.1,
            "log": {"level": "error"},
            "storage": {"filesystem": {"rootdirectory": str(self.dir / "data")}},
            "http": {"addr": self.host},
        }
        if self.auth:
            import crypt  # bcrypt ($2b$), what the registry's htpasswd accepts

            user, pw = self.auth
            hashed = crypt.crypt(pw, crypt.mksalt(crypt.METHOD_BLOWFISH))
            (self.dir / "htpasswd").write_text(f"{user}:{hashed}\n")
            cfg["auth"] = {"htpasswd": {"realm": "cubicle-e2e", "path": str(self.dir / "htpasswd")}}
        (self.dir / "config.yml").write_text(json.dumps(cfg))
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(self.dir / "config.yml")],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "registry.log", "w"),
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.addr, self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"docker-registry did not start: {(self.dir / 'registry.log').read_text()}")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def push(self, layout: Path, name: str) -> str:
        """Push `layout:name` as `<registry>/<name>:1`; returns the reference."""
        ref = f"{self.host}/{name}:1"
        cmd = ["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:{name}", f"docker://{ref}"]
        if self.auth:
            cmd[2:2] = ["--dest-creds", f"{self.auth[0]}:{self.auth[1]}"]
        run(*cmd)
        return ref


# --- images --------------------------------------------------------------------------


def _copy_with_libs(binary: str, root: Path) -> None:
    """Copy `binary` and the shared libraries `ldd` names into `root`."""
    paths = [binary]
    for line in run("ldd", binary).splitlines():
        parts = line.split()
        for p in parts:
            if p.startswith("/") and os.path.exists(p):
                paths.append(p)
    for p in paths:
        real = os.path.realpath(p)
        dest = root / p.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real, dest)


def shell_rootfs(root: Path) -> None:
    """busybox with its applets, bash, and root-only /etc files."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin/busybox")
    for applet in run("/bin/busybox", "--list-full").split():
        link = root / applet
        if link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/bin/busybox", link)
    bash = root / "bin/bash"
    if bash.is_symlink():
        bash.unlink()
    _copy_with_libs("/bin/bash", root)
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\nsudo:x:27:\n")
    (root / "etc/sudoers.d").mkdir()
    for d in ("root", "tmp", "home"):
        (root / d).mkdir(exist_ok=True)
    os.chmod(root / "tmp", 0o1777)


def _layer_tar(d: Path) -> bytes:
    """A gzipped tar of directory `d` (entries sorted, mtime 0, owners as on disk)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        paths = sorted(p for p in d.rglob("*"))
        for p in paths:
            info = t.gettarinfo(str(p), arcname=str(p.relative_to(d)))
            info.mtime = 0
            info.uname = info.gname = ""
            if info.isreg():
                with open(p, "rb") as f:
                    t.addfile(info, f)
            else:
                t.addfile(info)
    return gzip.compress(buf.getvalue(), compresslevel=1, mtime=0)


def oci_image(layout: Path, name: str, layers: list, env: dict) -> None:
    """An image `name` in the OCI layout `layout`: one layer per directory in `layers`."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    if not (layout / "index.json").exists():
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": []}))
    descs, diff_ids = [], []
    for d in layers:
        blob = _layer_tar(Path(d))
        diff_ids.append("sha256:" + hashlib.sha256(gzip.decompress(blob)).hexdigest())
        descs.append(
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _blob(layout, blob), "size": len(blob)}
        )
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": [f"{k}={v}" for k, v in env.items()]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _blob(layout, config),
                "size": len(config),
            },
            "layers": descs,
        }
    ).encode()
    index = json.loads((layout / "index.json").read_text())
    index["manifests"].append(
        {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": _blob(layout, manifest),
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": name},
        }
    )
    (layout / "index.json").write_text(json.dumps(index))


def _blob(layout: Path, data: bytes) -> str:
    h = hashlib.sha256(data).hexdigest()
    p = layout / "blobs/sha256" / h
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return f"sha256:{h}"


def broken_image(layout: Path, name: str) -> None:
    """An image whose layer is not what its config's diff id says (written by hand)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("hello.txt")
        data = b"hello\n"
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    layer = gzip.compress(buf.getvalue())
    layer_d = _blob(layout, layer)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]},
        }
    ).encode()
    config_d = _blob(layout, config)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_d, "size": len(config)},
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_d, "size": len(layer)}
            ],
        }
    ).encode()
    manifest_d = _blob(layout, manifest)
    index = json.loads((layout / "index.json").read_text())
    index["manifests"].append(
        {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_d,
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": name},
        }
    )
    (layout / "index.json").write_text(json.dumps(index))


def make_images(work: Path, python_lib: Optional[Path]) -> Path:
    """The layout with sh:1, big:1, static:1 and broken:1 (see the module doc)."""
    layout = work / "layout"
    sh = work / "sh"
    shell_rootfs(sh)
    path = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    oci_image(layout, "sh", [sh], path)
    extra = work / "extra"
    dest = extra / "opt/pylib"
    if python_lib and python_lib.is_dir():
        shutil.copytree(python_lib, dest, symlinks=True)
    else:
        dest.mkdir(parents=True)
        (dest / "filler.bin").write_bytes(os.urandom(30 << 20))
    oci_image(layout, "big", [sh, extra], path)
    static = work / "static"
    static.mkdir()
    shutil.copy2("/bin/busybox", static / "hello")
    oci_image(layout, "static", [static], {})
    broken_image(layout, "broken")
    return layout
