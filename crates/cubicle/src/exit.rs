//! Exit codes of the commands that pass on another program's exit code (`run`,
//! `sandbox exec`, `sandbox shell`), as Docker's `run`/`exec` have them, so a script
//! can tell Cubicle's own failures from the command's:
//!
//! - [`FAILED`] (125): Cubicle failed — bad arguments, no server, unknown sandbox, a
//!   dropped connection;
//! - [`CANNOT_INVOKE`] (126): the sandbox refused to start the command (no such working
//!   directory or user, not executable);
//! - [`NOT_FOUND`] (127): the command's program does not exist (bash's own code for an
//!   unknown command is 127 too);
//! - anything else: the command's own exit code (128 + N when signal N ended it).
//!
//! Other commands exit 1 on failure and 2 on bad arguments.

/// Cubicle itself failed.
pub const FAILED: i32 = 125;
/// The command could not be started.
pub const CANNOT_INVOKE: i32 = 126;
/// The command's program was not found.
pub const NOT_FOUND: i32 = 127;

/// An error that ends the process with `code` (the message is printed first).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Exit {
    pub code: i32,
    pub message: String,
}

/// The exit code for an error of a command: the code an [`Exit`] in its chain asks
/// for, else [`FAILED`] for commands that pass on exit codes, else 1.
pub fn code_for(e: &anyhow::Error, passes_on_exit_codes: bool) -> i32 {
    if let Some(x) = e.chain().find_map(|c| c.downcast_ref::<Exit>()) {
        return x.code;
    }
    if passes_on_exit_codes { FAILED } else { 1 }
}

/// An error and its causes as one line, each cause once (`a: b: c`): many errors
/// already repeat their source's text, which `{:#}` would print twice.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for c in e.chain() {
        let t = c.to_string();
        if t.is_empty() || out.contains(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
    }
    out
}

/// Whether `e` comes from the operating system refusing access.
pub fn is_permission_denied(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
            || c.to_string().contains("Permission denied (os error 13)")
            || c.to_string()
                .contains("Operation not permitted (os error 1)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_lines() {
        let e = anyhow::Error::new(Exit {
            code: 127,
            message: "no such program".into(),
        })
        .context("running x");
        assert_eq!(code_for(&e, true), 127);
        let plain = anyhow::anyhow!("boom");
        assert_eq!(code_for(&plain, true), FAILED);
        assert_eq!(code_for(&plain, false), 1);
        let io = std::io::Error::from_raw_os_error(13);
        let e = anyhow::Error::new(io).context("open /x: Permission denied (os error 13)");
        assert_eq!(one_line(&e), "open /x: Permission denied (os error 13)");
        assert!(is_permission_denied(&e));
        assert!(!is_permission_denied(&plain));
    }
}
