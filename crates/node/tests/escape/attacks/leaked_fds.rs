//! Leaked descriptors: a descriptor a sandbox's process holds that refers to a host file
//! or directory outside the sandbox's own mounts is a way out (a directory: `openat(fd,
//! "..")` climbs past `pivot_root`; a file: read or write host data, as PID 1's old
//! `init.log` was). Looks at every descriptor of every process in the sandbox (PID 1
//! included, through `/proc/<pid>/fd` and `pidfd_getfd`, as root and as `user`), and
//! for each regular file or
//! directory checks that its mount (`mnt_id` in `/proc/<pid>/fdinfo`) is one of the
//! sandbox's mounts; directory descriptors are also climbed with `..` to the top, which
//! must be the sandbox's `/`.
//!
//! Contained by: the runtime marks every inherited descriptor close-on-exec before PID 1
//! runs (except the ctl socket on fd 3), PID 1's stdio is `/dev/null` and a FIFO, and
//! envd starts processes with fresh pipes. Shown to fail against the previous runtime:
//! PID 1's fds 1 and 2 were `init.log` on a host mount.

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "leaked_fds",
    about: "use a descriptor of a host file or directory held by a sandbox process; close-on-exec, pipes",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <dirent.h>
/* Mount ids of the sandbox's mount namespace. */
static int mnt_ids[4096], n_mnt = 0;
static int is_own_mount(int id) {
    for (int i = 0; i < n_mnt; i++) if (mnt_ids[i] == id) return 1;
    return 0;
}
int main(void) {
    FILE *mi = fopen("/proc/self/mountinfo", "r");
    char line[4096];
    while (mi && fgets(line, sizeof line, mi) && n_mnt < 4096) mnt_ids[n_mnt++] = atoi(line);
    struct stat root;
    stat("/", &root);
    DIR *procs = opendir("/proc");
    struct dirent *p;
    int checked = 0, leaks = 0, unreadable = 0, pid1 = 0;
    while ((p = readdir(procs))) {
        int pid = atoi(p->d_name);
        if (pid <= 0 || pid == getpid()) continue;
        char path[256];
        snprintf(path, sizeof path, "/proc/%d/fd", pid);
        DIR *fds = opendir(path);
        if (!fds) continue;
        int pidfd = syscall(SYS_pidfd_open, pid, 0);
        struct dirent *f;
        while ((f = readdir(fds))) {
            if (f->d_name[0] == '.') continue;
            int n = atoi(f->d_name);
            int fd = pidfd < 0 ? -1 : syscall(SYS_pidfd_getfd, pidfd, n, 0);
            if (fd < 0) { unreadable++; continue; } /* not ours to take: nothing leaks */
            struct stat st;
            fstat(fd, &st);
            checked++;
            if (pid == 1) pid1++;
            if (S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) {
                char info[256], buf[4096];
                snprintf(info, sizeof info, "/proc/%d/fdinfo/%d", pid, n);
                int ifd = open(info, O_RDONLY);
                long len = ifd < 0 ? 0 : read(ifd, buf, sizeof buf - 1);
                buf[len > 0 ? len : 0] = 0;
                char *m = strstr(buf, "mnt_id:");
                int id = m ? atoi(m + 7) : -1;
                char target[512] = "";
                snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, n);
                readlink(path, target, sizeof target - 1);
                if (!is_own_mount(id)) {
                    printf("LEAK pid=%d fd=%d mnt_id=%d target=%s\n", pid, n, id, target);
                    leaks++;
                }
                if (S_ISDIR(st.st_mode)) {
                    /* Climb to the top: it must be the sandbox's root. */
                    int d = fd;
                    for (int i = 0; i < 4096; i++) {
                        int up = openat(d, "..", O_RDONLY | O_DIRECTORY);
                        struct stat a, b;
                        fstat(d, &a); fstat(up, &b);
                        if (d != fd) close(d);
                        d = up;
                        if (a.st_dev == b.st_dev && a.st_ino == b.st_ino) break;
                    }
                    struct stat top;
                    fstat(d, &top);
                    if (top.st_dev != root.st_dev || top.st_ino != root.st_ino) {
                        printf("LEAK-DIR pid=%d fd=%d climbs to a foreign root (%s)\n", pid, n, target);
                        leaks++;
                    }
                }
            }
            close(fd);
        }
        closedir(fds);
    }
    printf("checked=%d\npid1=%d\nunreadable=%d\nleaks=%d\n", checked, pid1, unreadable, leaks);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let count =
        |out: &Out, k: &str| -> u32 { out.field(k).and_then(|v| v.parse().ok()).unwrap_or(0) };
    // PID 1 first: once envd has started a process as another user (a vfork-style clone
    // shares its memory, and the child's setuid marks it), PID 1 is not dumpable and
    // the sandbox's root can no longer take its descriptors at all.
    let out = sb.c(As::Root, "leaked_fds", PROGRAM, &[]).await?;
    anyhow::ensure!(
        count(&out, "pid1") >= 4 && out.field("leaks") == Some("0"),
        "PID 1: {}",
        out.all()
    );
    // Then long-running processes of root and of `user`, started through envd.
    for who in [As::Root, As::User] {
        let o = sb
            .sh(
                who,
                "nohup sleep 600 >/dev/null 2>&1 & (cd /tmp && nohup python3 -c 'import time; import os; f=open(os.path.expanduser(\"~/held\"), \"a\"); time.sleep(600)' >/dev/null 2>&1 &) ; sleep 0.5; echo started",
            )
            .await?;
        anyhow::ensure!(o.out.contains("started"), "{}", o.all());
    }
    for who in [As::Root, As::User] {
        let out = sb.c(who, "leaked_fds", PROGRAM, &[]).await?;
        anyhow::ensure!(
            count(&out, "checked") >= 6,
            "as {who:?}: too few descriptors inspected: {}",
            out.all()
        );
        anyhow::ensure!(
            out.field("leaks") == Some("0"),
            "as {who:?}: descriptors of host files or directories: {}",
            out.all()
        );
    }
    sb.kill().await
}
