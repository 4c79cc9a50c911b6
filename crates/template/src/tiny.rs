//! The `tiny` template: Debian's `busybox-static` and nothing else.
//!
//! Layout: `/bin/busybox` plus one symlink per applet (what `busybox --install -s`
//! makes, at the paths `busybox --list-full` names), `/etc/passwd` and `/etc/group` with
//! `root` (0) and `user` (1000, home `/home/user`, shell `/bin/sh`), `/etc/hostname`,
//! `/etc/hosts`, `/tmp` (1777), `/home/user` (owned by 1000), `/root`, and the empty
//! mount points `/proc`, `/sys`, `/dev`, `/run/cubicle/{envd,ctl}`. Default user `user`,
//! workdir `/home/user`. It builds in a few milliseconds and exists for fast tests.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::process::Command;

use super::{Progress, TemplateConfig};
use crate::error::{Error, IoContext, Result};

/// The host binary the template is made from (package `busybox-static`).
pub const BUSYBOX: &str = "/bin/busybox";

const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
const GROUP: &str = "root:x:0:\nsudo:x:27:user\nuser:x:1000:\nnogroup:x:65534:\n";
const HOSTS: &str = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";

/// Build the tiny rootfs into the (empty) directory `rootfs`.
pub fn build(rootfs: &Path, p: &Progress) -> Result<TemplateConfig> {
    let fail = |m: String| Error::TemplateBuild {
        name: "tiny".into(),
        message: m,
    };
    if !Path::new(BUSYBOX).is_file() {
        return Err(fail(format!(
            "{BUSYBOX} not found: install the busybox-static package (scripts/install-deps.sh)"
        )));
    }
    p.stages(3);
    p.stage("creating directories");
    for d in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "root",
        "home/user",
        "tmp",
        "proc",
        "sys",
        "dev",
        "run",
        "var/tmp",
        "mnt",
    ] {
        let path = rootfs.join(d);
        fs::create_dir_all(&path).ctx("mkdir", &path)?;
    }
    fs::set_permissions(rootfs.join("tmp"), fs::Permissions::from_mode(0o1777))
        .ctx("chmod", rootfs.join("tmp"))?;
    fs::set_permissions(rootfs.join("var/tmp"), fs::Permissions::from_mode(0o1777))
        .ctx("chmod", rootfs.join("var/tmp"))?;
    fs::set_permissions(rootfs.join("root"), fs::Permissions::from_mode(0o700))
        .ctx("chmod", rootfs.join("root"))?;
    std::os::unix::fs::chown(rootfs.join("home/user"), Some(1000), Some(1000))
        .ctx("chown", rootfs.join("home/user"))?;

    p.stage("installing busybox");
    let bb = rootfs.join("bin/busybox");
    fs::copy(BUSYBOX, &bb).ctx("copy", &bb)?;
    fs::set_permissions(&bb, fs::Permissions::from_mode(0o755)).ctx("chmod", &bb)?;
    let out = Command::new(BUSYBOX)
        .arg("--list-full")
        .output()
        .ctx("run", BUSYBOX)?;
    if !out.status.success() {
        return Err(fail(format!(
            "{BUSYBOX} --list-full failed: {}",
            out.status
        )));
    }
    let list = String::from_utf8_lossy(&out.stdout);
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        // Applet paths are relative ("usr/bin/awk"); refuse anything odd.
        if applet.contains("..") || applet.starts_with('/') {
            continue;
        }
        let link = rootfs.join(applet);
        if link.symlink_metadata().is_ok() {
            continue;
        }
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent).ctx("mkdir", parent)?;
        }
        symlink("/bin/busybox", &link).ctx("symlink", &link)?;
    }

    p.stage("writing /etc");
    let files: [(&str, &str); 6] = [
        ("etc/passwd", PASSWD),
        ("etc/group", GROUP),
        ("etc/hostname", "cubicle\n"),
        ("etc/hosts", HOSTS),
        ("etc/resolv.conf", ""),
        ("etc/shells", "/bin/sh\n/bin/ash\n"),
    ];
    for (f, content) in files {
        let path = rootfs.join(f);
        fs::write(&path, content).ctx("write", &path)?;
    }
    super::add_cubicle_mount_points(rootfs)?;
    let mut cfg = TemplateConfig::with_defaults("tiny", "tiny/1");
    cfg.env
        .insert("PATH".into(), "/usr/sbin:/usr/bin:/sbin:/bin".into());
    Ok(cfg)
}
