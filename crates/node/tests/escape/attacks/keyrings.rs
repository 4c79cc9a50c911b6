//! Kernel keyrings: they are not namespaced, so a key a sandbox adds (or the user and
//! session keyrings it can look up) would be shared with the host and other tenants.
//! Tries `add_key`, `keyctl(GET_KEYRING_ID)` and `request_key`, and reads `/proc/keys`.
//!
//! Contained by: the seccomp policy (EPERM on all three) and the `/proc/keys` mask
//! (`masked_paths.rs`: an empty file).

use std::sync::Arc;

use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "keyrings",
    about: "use the host-wide kernel keyrings; seccomp denies add_key, keyctl, request_key",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#define KEY_SPEC_SESSION_KEYRING -3
#define KEY_SPEC_USER_KEYRING -4
#define KEYCTL_GET_KEYRING_ID 0
int main(void) {
    TRY("add_key", syscall(SYS_add_key, "user", "cubicle-escape", "secret", 6, KEY_SPEC_USER_KEYRING));
    TRY("keyctl", syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 1));
    TRY("request_key", syscall(SYS_request_key, "user", "cubicle-escape", 0, 0));
    char buf[256];
    int fd = open("/proc/keys", O_RDONLY);
    long n = fd < 0 ? -1 : read(fd, buf, sizeof buf);
    printf("proc_keys_bytes=%ld\n", n);
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx.sandbox(false).await?;
    let out = sb.c(As::Root, "keyrings", PROGRAM, &[]).await?;
    for name in ["add_key", "keyctl", "request_key"] {
        out.expect_errno(name, &[EPERM])?;
    }
    anyhow::ensure!(
        matches!(out.field("proc_keys_bytes"), Some("0") | Some("-1")),
        "/proc/keys is readable: {}",
        out.all()
    );
    sb.kill().await
}
