//! cgroup v1 `release_agent` (CVE-2022-0492 and the classic privileged-container
//! escape): the kernel runs the program named in a hierarchy's `release_agent` as host
//! root when a cgroup with `notify_on_release` empties. Tries to write `release_agent`
//! and `notify_on_release` under `/sys/fs/cgroup`, to create a cgroup there, and to mount
//! a fresh cgroup v1 hierarchy (where `release_agent` would be writable).
//!
//! Contained by: the read-only cgroup mounts (the sandbox's own cgroups, rooted at its
//! cgroup by the cgroup namespace, where no `release_agent` exists), seccomp (EPERM on
//! mount) and no CAP_SYS_ADMIN. Every host `release_agent` is in the host snapshot.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "cgroup_release_agent",
    about: "set a cgroup v1 release_agent (runs as host root); read-only cgroupfs, no mount",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
static void try_write(const char *name, const char *path, const char *data) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) { report(name, -1, errno); return; }
    long n = write(fd, data, strlen(data));
    report(name, n, errno);
}
int main(void) {
    const char *agent = "/tmp/cubicle-escape-agent\n";
    const char *h[] = { "memory", "pids", "cpu,cpuacct", "freezer", "unified", NULL };
    char path[256], name[96];
    for (int i = 0; h[i]; i++) {
        snprintf(path, sizeof path, "/sys/fs/cgroup/%s/release_agent", h[i]);
        snprintf(name, sizeof name, "write_release_agent_%d", i);
        try_write(name, path, agent);
        snprintf(path, sizeof path, "/sys/fs/cgroup/%s/notify_on_release", h[i]);
        snprintf(name, sizeof name, "write_notify_on_release_%d", i);
        try_write(name, path, "1\n");
        snprintf(path, sizeof path, "/sys/fs/cgroup/%s/escape", h[i]);
        snprintf(name, sizeof name, "mkdir_cgroup_%d", i);
        TRY(name, mkdir(path, 0755));
    }
    TRY("mount_cgroup_v1", mount("cgroup", "/mnt", "cgroup", 0, "memory"));
    TRY("mount_cgroup_v1_none", mount("cgroup", "/mnt", "cgroup", 0, "none,name=escape"));
    TRY("mount_cgroup2", mount("cgroup2", "/mnt", "cgroup2", 0, NULL));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "cgroup_release_agent", PROGRAM, &[]).await?;
    for i in 0..5 {
        out.expect_errno(
            &format!("write_release_agent_{i}"),
            &[EROFS, ENOENT, EACCES],
        )?;
        out.expect_errno(
            &format!("write_notify_on_release_{i}"),
            &[EROFS, ENOENT, EACCES],
        )?;
        out.expect_errno(&format!("mkdir_cgroup_{i}"), &[EROFS, ENOENT, EACCES])?;
    }
    for name in ["mount_cgroup_v1", "mount_cgroup_v1_none", "mount_cgroup2"] {
        out.expect_errno(name, &[EPERM])?;
    }
    sb.kill().await
}
