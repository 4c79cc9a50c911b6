//! The `base` template: Debian 12 (bookworm) like E2B's base image.
//!
//! Steps: `debootstrap --variant=minbase` (no `--include`: a long include list fails to
//! configure, see pitfalls.md), then inside a private mount namespace (so a killed build
//! leaks no mount) `chroot … apt-get install --no-install-recommends` of [`PACKAGES`], a
//! user `user` (uid 1000, `/home/user`, bash, passwordless sudo), apt caches removed.
//! The mirror is the Debian archive this host's apt uses ([`host_debian_mirror`]).
//! Files stay owned by host uid 0; the runtime idmaps them per sandbox.

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::{Progress, TemplateConfig};
use crate::error::{Error, IoContext, Result};

/// Debian suite of the template.
pub const SUITE: &str = "bookworm";

/// Packages installed on top of minbase: what code written for E2B's base image (Debian
/// bookworm's `python:3.11` image plus Node.js, build tools and E2B's provisioning set)
/// commonly relies on. `python-is-python3` makes `python` Python 3; `build-essential` and
/// `python3-dev` let `pip` build C extensions; `yarnpkg` is linked as `yarn`. Deliberate
/// differences (Debian's Node.js 18 and Python 3.11.2, no systemd) are in
/// `docs/templates.md`.
pub const PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "python3",
    "python3-pip",
    "python3-venv",
    "python3-dev",
    "python-is-python3",
    "build-essential",
    "nodejs",
    "npm",
    "yarnpkg",
    "git",
    "gh",
    "curl",
    "wget",
    "ca-certificates",
    "gnupg",
    "sudo",
    "procps",
    "iproute2",
    "iputils-ping",
    "socat",
    "less",
    "nano",
    "jq",
    "unzip",
    "zip",
    "bzip2",
    "xz-utils",
    "patch",
    "file",
    "openssh-client",
    "netcat-openbsd",
    "locales",
    "tzdata",
];

const FALLBACK_MIRROR: &str = "http://deb.debian.org/debian";

fn fail(message: impl Into<String>) -> Error {
    Error::TemplateBuild {
        name: "base".into(),
        message: message.into(),
    }
}

/// The Debian archive URL this host's apt uses for `bookworm` (from
/// `/etc/apt/sources.list` and `/etc/apt/sources.list.d/*.{list,sources}`), skipping
/// security and third-party repositories; falls back to `http://deb.debian.org/debian`.
pub fn host_debian_mirror() -> String {
    let mut texts = Vec::new();
    if let Ok(t) = fs::read_to_string("/etc/apt/sources.list") {
        texts.push(t);
    }
    if let Ok(rd) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
            if (ext == "list" || ext == "sources")
                && let Ok(t) = fs::read_to_string(&p)
            {
                texts.push(t);
            }
        }
    }
    texts
        .iter()
        .find_map(|t| mirror_from_sources(t))
        .unwrap_or_else(|| FALLBACK_MIRROR.to_string())
}

/// Find a Debian (non-security) bookworm archive URL in one sources file's text
/// (one-line `deb URL SUITE …` or deb822 stanzas).
fn mirror_from_sources(text: &str) -> Option<String> {
    let good =
        |url: &str| url.starts_with("http") && url.contains("debian") && !url.contains("security");
    // One-line format.
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first() == Some(&"deb") {
            let mut rest = &f[1..];
            if rest.first().is_some_and(|w| w.starts_with('[')) {
                // skip the optional `[opt=val …]` block
                let end = rest
                    .iter()
                    .position(|w| w.ends_with(']'))
                    .map_or(rest.len(), |i| i + 1);
                rest = &rest[end..];
            }
            if let (Some(url), Some(suite)) = (rest.first(), rest.get(1))
                && *suite == SUITE
                && good(url)
            {
                return Some(url.trim_end_matches('/').to_string());
            }
        }
    }
    // deb822 stanzas.
    for stanza in text.split("\n\n") {
        let mut uris = None;
        let mut suites = None;
        let mut is_deb = false;
        for line in stanza.lines() {
            if let Some((k, v)) = line.split_once(':') {
                match k.trim() {
                    "Types" => is_deb = v.split_whitespace().any(|t| t == "deb"),
                    "URIs" => uris = Some(v.trim().to_string()),
                    "Suites" => suites = Some(v.trim().to_string()),
                    _ => {}
                }
            }
        }
        if let (true, Some(u), Some(s)) = (is_deb, uris, suites) {
            let url = u.split_whitespace().next().unwrap_or("").to_string();
            if s.split_whitespace().any(|x| x == SUITE) && good(&url) {
                return Some(url.trim_end_matches('/').to_string());
            }
        }
    }
    None
}

/// Run a command, feeding each output line to the progress bar; error with the tail of
/// the output on failure.
fn run_streamed(cmd: &mut Command, what: &str, p: &Progress) -> Result<()> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("{what}: cannot start: {e}")))?;
    let stderr = child.stderr.take();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let tx2 = tx.clone();
    let t_err = std::thread::spawn(move || {
        if let Some(s) = stderr {
            for l in BufReader::new(s).lines().map_while(|l| l.ok()) {
                let _ = tx2.send(l);
            }
        }
    });
    let stdout = child.stdout.take();
    let t_out = std::thread::spawn(move || {
        if let Some(s) = stdout {
            for l in BufReader::new(s).lines().map_while(|l| l.ok()) {
                let _ = tx.send(l);
            }
        }
    });
    let mut tail: std::collections::VecDeque<String> = Default::default();
    for line in rx {
        p.line(&line);
        tail.push_back(line);
        if tail.len() > 30 {
            tail.pop_front();
        }
    }
    let _ = t_err.join();
    let _ = t_out.join();
    let status = child.wait().map_err(|e| fail(format!("{what}: {e}")))?;
    if !status.success() {
        let t: Vec<String> = tail.into_iter().collect();
        return Err(fail(format!(
            "{what} failed ({status}); last output:\n{}",
            t.join("\n")
        )));
    }
    Ok(())
}

/// A shell script run as `unshare --mount --propagation private sh -c SCRIPT`, with
/// `$R` the rootfs: mounts made by it die with the process, even on SIGKILL.
pub(crate) fn in_private_chroot(
    rootfs: &Path,
    script: &str,
    what: &str,
    p: &Progress,
) -> Result<()> {
    let prelude = "set -e\n\
        mount -t proc proc \"$R/proc\"\n\
        mount -t tmpfs -o mode=755 tmpfs \"$R/dev\"\n\
        for d in null zero full random urandom tty; do touch \"$R/dev/$d\"; mount --bind /dev/$d \"$R/dev/$d\"; done\n\
        mkdir -p \"$R/dev/pts\" \"$R/dev/shm\"\n\
        ln -sf /proc/self/fd \"$R/dev/fd\"\n\
        cp /etc/resolv.conf \"$R/etc/resolv.conf\" 2>/dev/null || true\n";
    let full = format!("{prelude}{script}\n");
    run_streamed(
        Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                &full,
            ])
            .env("R", rootfs)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .env("LC_ALL", "C")
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            ),
        what,
        p,
    )
}

/// Build the base rootfs into the (empty) directory `rootfs`.
pub fn build(rootfs: &Path, p: &Progress) -> Result<TemplateConfig> {
    if Command::new("debootstrap")
        .arg("--version")
        .output()
        .is_err()
    {
        return Err(fail(
            "debootstrap not found: install it (scripts/install-deps.sh)",
        ));
    }
    let mirror = host_debian_mirror();
    p.stages(5);
    p.stage(&format!("debootstrap --variant=minbase {SUITE} ({mirror})"));
    run_streamed(
        Command::new("debootstrap")
            .args(["--variant=minbase", SUITE])
            .arg(rootfs)
            .arg(&mirror),
        "debootstrap",
        p,
    )?;

    p.stage("configuring apt");
    let sources = format!("deb {mirror} {SUITE} main\ndeb {mirror} {SUITE}-updates main\n");
    let sl = rootfs.join("etc/apt/sources.list");
    fs::write(&sl, sources).ctx("write", &sl)?;
    // No service may start inside the chroot during the build.
    let prc = rootfs.join("usr/sbin/policy-rc.d");
    fs::write(&prc, "#!/bin/sh\nexit 101\n").ctx("write", &prc)?;
    fs::set_permissions(&prc, fs::Permissions::from_mode(0o755)).ctx("chmod", &prc)?;
    let noinst = rootfs.join("etc/apt/apt.conf.d/90cubicle");
    fs::write(
        &noinst,
        "APT::Install-Recommends \"false\";\nAPT::Install-Suggests \"false\";\nAcquire::Languages \"none\";\n",
    )
    .ctx("write", &noinst)?;

    p.stage("apt-get install (python3, build-essential, nodejs, npm, git, curl, sudo, ...)");
    let script = format!(
        "chroot \"$R\" apt-get update\n\
         chroot \"$R\" apt-get install -y --no-install-recommends {}\n",
        PACKAGES.join(" ")
    );
    in_private_chroot(rootfs, &script, "apt-get install", p)?;

    p.stage("creating user 'user' with passwordless sudo");
    let script = "chroot \"$R\" useradd --create-home --uid 1000 --user-group --shell /bin/bash --groups sudo user\n\
        sed -i 's/^# *\\(en_US.UTF-8\\)/\\1/' \"$R/etc/locale.gen\" && chroot \"$R\" locale-gen || true\n";
    in_private_chroot(rootfs, script, "useradd", p)?;
    // As E2B's image: `pip install` works without a venv (Debian's python marks itself
    // externally managed, which makes pip refuse), `yarn` exists, `/usr/local` is
    // writable by everyone (user-installed packages land there, visible to root too)
    // and there is a world-writable `/code`.
    let script = "rm -f \"$R\"/usr/lib/python3*/EXTERNALLY-MANAGED\n\
        ln -sf /usr/bin/yarnpkg \"$R/usr/local/bin/yarn\"\n\
        chmod -R a+rwX \"$R/usr/local\"\n\
        mkdir -p \"$R/code\" && chmod 777 \"$R/code\"\n";
    in_private_chroot(rootfs, script, "E2B compatibility", p)?;
    let sudoers = rootfs.join("etc/sudoers.d/cubicle-user");
    fs::write(&sudoers, "user ALL=(ALL:ALL) NOPASSWD: ALL\n").ctx("write", &sudoers)?;
    fs::set_permissions(&sudoers, fs::Permissions::from_mode(0o440)).ctx("chmod", &sudoers)?;

    p.stage("cleaning apt caches");
    let script = "chroot \"$R\" apt-get clean\n\
        rm -rf \"$R\"/var/lib/apt/lists/* \"$R\"/var/cache/apt/*.bin \"$R\"/var/cache/debconf/*-old \\\n\
               \"$R\"/var/log/apt/* \"$R\"/var/log/dpkg.log \"$R\"/var/log/bootstrap.log \"$R\"/root/.npm \"$R\"/tmp/*\n";
    in_private_chroot(rootfs, script, "cleanup", p)?;
    let _ = fs::remove_file(&prc);
    for (f, content) in [
        ("etc/hostname", "cubicle\n"),
        (
            "etc/hosts",
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        ),
        ("etc/resolv.conf", ""),
    ] {
        let path = rootfs.join(f);
        fs::write(&path, content).ctx("write", &path)?;
    }
    super::add_cubicle_mount_points(rootfs)?;

    let mut cfg = TemplateConfig::with_defaults("base", "base/2");
    cfg.env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    cfg.env.insert("LANG".into(), "C.UTF-8".into());
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_deb822_sources() {
        let t = "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                 Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n";
        assert_eq!(
            mirror_from_sources(t).as_deref(),
            Some("http://deb.debian.org/debian")
        );
    }

    #[test]
    fn parses_one_line_sources() {
        let t = "deb [arch=amd64] http://mirror.example/debian/ bookworm main\n";
        assert_eq!(
            mirror_from_sources(t).as_deref(),
            Some("http://mirror.example/debian")
        );
        let t = "deb http://security.debian.org/debian-security bookworm-security main\n";
        assert_eq!(mirror_from_sources(t), None);
        let t = "deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n";
        assert_eq!(mirror_from_sources(t), None);
    }
}
