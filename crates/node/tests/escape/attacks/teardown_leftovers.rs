//! Issue 10, item 1: teardown must succeed whatever a tenant left in its writable layer,
//! and must never act outside it. Leaves a tree deeper than `PATH_MAX` (thousands of
//! levels of long names), a directory of 100,000 inodes, symlinks to host paths (a host
//! canary directory, `/`, `/etc`, `..` chains), names that look like mount points or
//! mountinfo escapes (`rootfs`, `upper`, `\040(deleted)`, newlines), hard links, FIFOs
//! and sockets, and tries immutable/append-only flags; then the sandbox is killed.
//!
//! Contained by: teardown destroys the sandbox's btrfs subvolume whole, or walks it with
//! `cubicle_runtime::remove_tree` (iterative, no symlink followed, no mount crossed,
//! flags cleared); the node checks that nothing is left (`kill_and_check`) and the host
//! canary is intact. (Read-only and nested subvolumes, which a sandbox can no longer
//! create, are covered by `storage::tests::removal_survives_what_a_tenant_leaves`.)

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "teardown_leftovers",
    about: "leave deep trees, many inodes, symlinks to the host, odd names; teardown must finish and follow nothing",
    run: |c| Box::pin(run(c)),
};

/// A host directory a teardown that follows symlinks would empty.
const CANARY: &str = "/tmp/cubicle-escape-canary";

const PROGRAM: &str = r#"
#include <linux/fs.h>
#include <sys/un.h>
int main(int argc, char **argv) {
    int depth = atoi(argv[1]), files = atoi(argv[2]);
    char name[256];
    memset(name, 'd', 200); name[200] = 0;
    /* Deeper than PATH_MAX: mkdir + chdir, one level at a time. */
    if (mkdir("/tmp/deep", 0755) || chdir("/tmp/deep")) return 2;
    int levels = 0;
    for (; levels < depth; levels++)
        if (mkdir(name, 0755) || chdir(name)) break;
    int fd = open("leaf", O_WRONLY | O_CREAT, 0644);
    printf("deep_levels=%d\ndeep_leaf=%d\n", levels, fd >= 0);
    /* Many inodes. */
    if (mkdir("/tmp/many", 0755) || chdir("/tmp/many")) return 3;
    int made = 0;
    for (int i = 0; i < files; i++) {
        snprintf(name, sizeof name, "%d", i);
        int f = open(name, O_WRONLY | O_CREAT, 0644);
        if (f < 0) break;
        close(f);
        made++;
    }
    printf("many_files=%d\n", made);
    /* Symlinks out, odd names, links, special files. */
    mkdir("/tmp/odd", 0755);
    if (chdir("/tmp/odd")) return 4;
    symlink(argv[3], "to-canary");
    symlink("/", "to-root");
    symlink("/etc", "to-etc");
    symlink("../../../../../../../../..", "dotdot");
    mkdir("rootfs", 0755); mkdir("upper", 0755); mkdir("work", 0755);
    mkdir("x\\040(deleted)", 0755);
    mkdir("line\nbreak", 0755);
    int f = open("file", O_WRONLY | O_CREAT, 0644);
    link("file", "hardlink");
    mkfifo("fifo", 0644);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = { .sun_family = AF_UNIX };
    strcpy(a.sun_path, "/tmp/odd/sock");
    bind(s, (struct sockaddr *)&a, sizeof a);
    long flags = FS_IMMUTABLE_FL;
    TRY("immutable", ioctl(f, FS_IOC_SETFLAGS, &flags));
    flags = FS_APPEND_FL;
    int d = open("/tmp/odd", O_RDONLY | O_DIRECTORY);
    TRY("append_only_dir", ioctl(d, FS_IOC_SETFLAGS, &flags));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    std::fs::create_dir_all(CANARY)?;
    std::fs::write(format!("{CANARY}/keep"), "must survive\n")?;
    let sb = ctx.sandbox(false).await?;
    let out = sb
        .c(
            As::Root,
            "teardown_leftovers",
            PROGRAM,
            &["5000", "100000", CANARY],
        )
        .await?;
    anyhow::ensure!(
        out.field("deep_levels") == Some("5000") && out.field("deep_leaf") == Some("1"),
        "could not build the deep tree: {}",
        out.all()
    );
    anyhow::ensure!(
        out.field("many_files") == Some("100000"),
        "could not make the inodes: {}",
        out.all()
    );
    out.expect_errno("immutable", &[EPERM])?;
    out.expect_errno("append_only_dir", &[EPERM])?;
    let t = std::time::Instant::now();
    let res = sb.kill().await;
    println!("  teardown of the littered sandbox took {:?}", t.elapsed());
    let canary = std::fs::read_to_string(format!("{CANARY}/keep"));
    let _ = std::fs::remove_dir_all(CANARY);
    res?;
    anyhow::ensure!(
        canary.is_ok(),
        "teardown followed a symlink out of the sandbox: the host canary is gone"
    );
    Ok(())
}
