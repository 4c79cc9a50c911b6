#!/usr/bin/env python3
"""Checks the deployment recipes in deploy/ offline (scripts/test.sh's `deploy` suite).

  tests/e2e/.venv-deploy/bin/python scripts/check-deploy.py --cubicle target/debug/cubicle

- deploy/kubernetes/*.yaml: every object is validated (strictly: unknown fields are
  errors) against the Kubernetes OpenAPI schemas of the `kubernetes-validate` package,
  for the oldest and newest Kubernetes versions named below; kustomization.yaml must
  list files that exist.
- The manifests cannot drift from the CLI: every `--flag` a container of the `cubicle`
  image passes and every CUBICLE_* variable it sets must be in `cubicle SUB --help`
  (clap prints each option's environment variable there); every path under /etc/cubicle
  a flag names must lie in a mounted volume; every Secret/ConfigMap key the workloads
  read must exist in secrets.example.yaml / config.yaml.
- deploy/systemd/*.service: the ExecStart flags are checked the same way, and
  `systemd-analyze verify` (with the binary's path put in) when systemd-analyze exists.
- --self-test first proves the checks can fail: broken copies of the manifests (a
  misspelt field, a wrong type, a flag the CLI lacks, a path outside every mount) must
  each be refused.

Flags that other work in progress adds (PENDING) are reported, not failed; once the CLI
has one, the check fails until it is removed from PENDING (no silent drift either way).
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "kubernetes")
SYSTEMD = os.path.join(ROOT, "deploy", "systemd")
VERSIONS = ["1.30.0", "1.37.0"]
# (subcommand, flag or variable): added by the cluster's coordination work (h19d: node
# registration, replicas taking their nodes from the database) and the moving of
# state between nodes (h19e: the node's object store). Remove each once the CLI has it.
PENDING: set[tuple[str, str]] = set()


# What every unit keeps from `cubicle service unit` (readiness, a stop that spares the
# sandboxes, restarts, file limits), and the sandboxing of the replica's unit (it holds
# no sandboxes, so it can be locked down).
REQUIRED = {
    "*": ["Type=notify", "KillMode=mixed", "LimitNOFILE=", "Restart=on-failure"],
    "cubicle-node.service": ["TasksMax=infinity", "MemoryAccounting=yes", "TimeoutStartSec="],
    "cubicle-api.service": ["NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=",
                            "SystemCallFilter=", "PrivateTmp=yes"],
}


class Failure(Exception):
    pass


def load_docs(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def cli_help(cubicle: str, sub: str, cache: dict) -> str:
    if sub not in cache:
        out = subprocess.run([cubicle, sub, "--help"], capture_output=True, text=True)
        if out.returncode != 0:
            raise Failure(f"`cubicle {sub} --help` failed: {out.stderr.strip()}")
        cache[sub] = out.stdout
    return cache[sub]


def check_cli(sub: str, flags: list[str], envs: list[str], cubicle: str, cache: dict,
              where: str, pending_seen: set) -> list[str]:
    """Errors for flags/variables `cubicle SUB` does not have."""
    text = cli_help(cubicle, sub, cache)
    have_flags = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", text))
    have_envs = set(re.findall(r"\[env: ([A-Z0-9_]+)=", text))
    errors = []
    for name, have in [(f, have_flags) for f in flags] + [(e, have_envs) for e in envs]:
        pending = (sub, name) in PENDING
        if name in have and pending:
            errors.append(f"{where}: `cubicle {sub}` now has {name}: remove it from PENDING in scripts/check-deploy.py")
        elif name not in have and not pending:
            kind = "option" if name.startswith("--") else "environment variable"
            errors.append(f"{where}: `cubicle {sub} --help` has no {kind} {name}")
        elif pending:
            pending_seen.add(f"cubicle {sub} {name}")
    return errors


def flags_of(args: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for a in args:
        if a.startswith("--"):
            name, _, value = a.partition("=")
            out.append((name, value if _ else None))
    return out


def check_workloads(objs: list[tuple[str, dict]], cubicle: str, cache: dict,
                    pending_seen: set) -> list[str]:
    errors = []
    secrets, configmaps = {}, {}
    for _, o in objs:
        kind, name = o.get("kind"), o.get("metadata", {}).get("name")
        data = {**o.get("data", {}), **o.get("stringData", {})}
        if kind == "Secret":
            secrets[name] = set(data)
        elif kind == "ConfigMap":
            configmaps[name] = set(data)
    for src, o in objs:
        if o.get("kind") not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod.get("containers", []):
            where = f"{os.path.basename(src)}: {o['kind']}/{o.get('metadata', {}).get('name')}/{c.get('name', '?')}"
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    errors.append(f"{where}: mounts volume {m['name']}, which the pod lacks")
            for v in volumes.values():
                ref = v.get("secret")
                if ref and ref["secretName"] not in secrets:
                    errors.append(f"{where}: volume {v['name']} reads Secret {ref['secretName']}, which secrets.example.yaml lacks")
            for e in c.get("env", []):
                vf = e.get("valueFrom", {})
                for key, table, what in (("secretKeyRef", secrets, "Secret"),
                                         ("configMapKeyRef", configmaps, "ConfigMap")):
                    ref = vf.get(key)
                    if ref and ref["key"] not in table.get(ref["name"], set()):
                        errors.append(f"{where}: env {e['name']} reads {what} {ref['name']} key {ref['key']}, which is not defined")
            if c.get("image", "").split(":")[0] != "cubicle":
                continue
            args = c.get("args", [])
            if not args or args[0].startswith("-"):
                errors.append(f"{where}: args must start with the subcommand (serve, node)")
                continue
            sub = args[0]
            flags = flags_of(args[1:])
            envs = [e["name"] for e in c.get("env", []) if e["name"].startswith("CUBICLE_")]
            errors += check_cli(sub, [f for f, _ in flags], envs, cubicle, cache, where, pending_seen)
            for f, value in flags:
                if value and value.startswith("/etc/cubicle/") and not any(
                        value.startswith(m.rstrip("/") + "/") for m in mounts):
                    errors.append(f"{where}: {f}={value} is in no mounted volume")
    return errors


def check_kubernetes(cubicle: str, cache: dict, pending_seen: set, files: dict | None = None) -> list[str]:
    """Errors of the manifests (`files`: path -> documents, default: read deploy/kubernetes)."""
    if files is None:
        files = {p: load_docs(p) for p in sorted(glob.glob(os.path.join(K8S, "*.yaml")))}
    errors = []
    objs = []
    for path, docs in files.items():
        for d in docs:
            if d.get("kind") == "Kustomization":
                for r in d.get("resources", []):
                    if not os.path.exists(os.path.join(os.path.dirname(path), r)):
                        errors.append(f"{os.path.basename(path)}: resource {r} does not exist")
                continue
            objs.append((path, d))
            for v in VERSIONS:
                try:
                    kubernetes_validate.validate(d, v, strict=True)
                except kubernetes_validate.ValidationError as e:
                    loc = ".".join(str(p) for p in e.path)
                    errors.append(f"{os.path.basename(path)}: {d.get('kind')}/{d.get('metadata', {}).get('name')} (Kubernetes {v}): {loc}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    errors.append(f"{os.path.basename(path)}: {e}")
    if not objs:
        errors.append("no Kubernetes objects found")
    errors += check_workloads(objs, cubicle, cache, pending_seen)
    return errors


def unit_exec(text: str) -> list[str]:
    """The ExecStart command line of a unit (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    m = re.search(r"^ExecStart=(.*)$", joined, re.M)
    return m.group(1).split() if m else []


def check_systemd(cubicle: str, cache: dict, pending_seen: set, units: dict | None = None) -> list[str]:
    if units is None:
        units = {}
        for p in sorted(glob.glob(os.path.join(SYSTEMD, "*.service"))):
            with open(p) as f:
                units[p] = f.read()
    errors = []
    if not units:
        errors.append("no systemd units in deploy/systemd")
    for path, text in units.items():
        where = os.path.basename(path)
        argv = unit_exec(text)
        if not argv or not argv[0].endswith("/cubicle"):
            errors.append(f"{where}: ExecStart does not run cubicle")
            continue
        rest = [a for a in argv[1:]]
        # Global options come before the subcommand (`cubicle --config F node …`).
        while rest and rest[0].startswith("-"):
            opt = rest.pop(0)
            if "=" not in opt and rest and not rest[0].startswith("-"):
                rest.pop(0)
        if not rest:
            errors.append(f"{where}: ExecStart names no subcommand")
            continue
        sub = rest[0]
        envs = re.findall(r"^Environment=\"?(CUBICLE_[A-Z0-9_]+)=", text, re.M)
        # The example environment file next to the unit (set and commented-out lines).
        env_file = path[: -len(".service")] + ".env"
        if os.path.exists(env_file):
            with open(env_file) as f:
                envs += re.findall(r"^#?(CUBICLE_[A-Z0-9_]+)=", f.read(), re.M)
        errors += check_cli(sub, [f for f, _ in flags_of(rest[1:])], envs, cubicle, cache, where, pending_seen)
        for word in REQUIRED["*"] + REQUIRED.get(where, []):
            if not re.search(rf"^{re.escape(word)}", text, re.M):
                errors.append(f"{where}: missing {word} (see REQUIRED in scripts/check-deploy.py)")
    analyze = shutil.which("systemd-analyze")
    if analyze and not errors:
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for path, text in units.items():
                p = os.path.join(d, os.path.basename(path))
                with open(p, "w") as f:
                    f.write(text.replace("/usr/local/bin/cubicle", os.path.abspath(cubicle)))
                paths.append(p)
            out = subprocess.run([analyze, "verify", *paths], capture_output=True, text=True)
            # Complaints about other units of this host are not ours.
            ours = [ln for ln in (out.stdout + out.stderr).splitlines()
                    if any(os.path.basename(p) in ln for p in paths)]
            if out.returncode != 0 or ours:
                errors += [f"systemd-analyze verify: {ln}" for ln in (ours or [out.stderr.strip()])]
    elif not analyze:
        print("check-deploy: systemd-analyze not found: unit files checked without it")
    return errors


def self_test(cubicle: str, cache: dict) -> list[str]:
    """Each broken copy must be refused; returns the ones that were not."""
    files = {p: load_docs(p) for p in sorted(glob.glob(os.path.join(K8S, "*.yaml")))}
    api = os.path.join(K8S, "api.yaml")
    node = os.path.join(K8S, "node.yaml")

    def container(fs, path):
        return fs[path][0]["spec"]["template"]["spec"]["containers"][0]

    def misspelt(fs):
        container(fs, api)["imagePullPolicyy"] = "Always"

    def wrong_type(fs):
        fs[api][0]["spec"]["replicas"] = "two"

    def missing_required(fs):
        del container(fs, node)["name"]

    def unknown_flag(fs):
        container(fs, node)["args"].append("--no-such-flag=1")

    def unknown_env(fs):
        container(fs, api)["env"].append({"name": "CUBICLE_NO_SUCH_SETTING", "value": "1"})

    def unmounted_path(fs):
        container(fs, api)["args"].append("--node-ca=/etc/cubicle/nowhere/ca.crt")

    def missing_secret_key(fs):
        container(fs, api)["env"][0]["valueFrom"]["secretKeyRef"]["key"] = "no-such-key"

    # Each broken copy must bring errors the intact files do not have.
    failed = []
    baseline = set(check_kubernetes(cubicle, cache, set(), files))
    for breaks in (misspelt, wrong_type, missing_required, unknown_flag, unknown_env,
                   unmounted_path, missing_secret_key):
        fs = copy.deepcopy(files)
        breaks(fs)
        if not set(check_kubernetes(cubicle, cache, set(), fs)) - baseline:
            failed.append(f"self-test: a manifest with {breaks.__name__.replace('_', ' ')} passed the check")
    units = {}
    for p in sorted(glob.glob(os.path.join(SYSTEMD, "*.service"))):
        with open(p) as f:
            units[p] = f.read()
    baseline = set(check_systemd(cubicle, cache, set(), units))
    broken = {p: t.replace("node \\\n", "node --bogus-flag \\\n", 1).replace("serve \\\n", "serve --bogus-flag \\\n", 1)
              for p, t in units.items()}
    if units and not set(check_systemd(cubicle, cache, set(), broken)) - baseline:
        failed.append("self-test: a unit with an unknown flag passed the check")
    if units and shutil.which("systemd-analyze") and not baseline:
        broken = {p: t.replace("[Service]", "[Service]\nNoSuchDirective=yes", 1) for p, t in units.items()}
        if not check_systemd(cubicle, cache, set(), broken):
            failed.append("self-test: a unit with an unknown directive passed systemd-analyze verify")
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cubicle", default=os.path.join(ROOT, "target", "debug", "cubicle"))
    ap.add_argument("--no-self-test", action="store_true")
    a = ap.parse_args()
    if not os.access(a.cubicle, os.X_OK):
        print(f"check-deploy: {a.cubicle} is not an executable (cargo build -p cubicle)", file=sys.stderr)
        return 2
    cache: dict = {}
    pending: set = set()
    try:
        errors = [] if a.no_self_test else self_test(a.cubicle, cache)
        errors += check_kubernetes(a.cubicle, cache, pending)
        errors += check_systemd(a.cubicle, cache, pending)
    except Failure as e:
        errors = [str(e)]
    for p in sorted(pending):
        print(f"check-deploy: not in this CLI yet (PENDING): {p}")
    for e in errors:
        print(f"check-deploy: FAIL {e}", file=sys.stderr)
    if errors:
        return 1
    n = len(glob.glob(os.path.join(K8S, "*.yaml"))) + len(glob.glob(os.path.join(SYSTEMD, "*.service")))
    print(f"check-deploy: OK ({n} files; Kubernetes {', '.join(VERSIONS)}; self-test {'skipped' if a.no_self_test else 'passed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
