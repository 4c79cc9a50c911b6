//! The sandbox's identity files, as upstream envd writes them for programs that look
//! for them: `/run/e2b/.E2B_SANDBOX` (`true`), `.E2B_SANDBOX_ID` and `.E2B_TEMPLATE_ID`.
//!
//! `POST /init` writes them from its env vars. A pooled sandbox's envd is also told its
//! ids at its start (`CUBICLE_ENVD_SANDBOX_ID`, `CUBICLE_ENVD_TEMPLATE_ID`) and writes
//! them then, while the pool refills at low priority; a claim's `/init` (sent only for a
//! create with variables) names the same ids and writes nothing (a directory and three
//! files on a tmpfs were a fifth of envd's work in a claim). Ids that differ from the
//! last ones written (a fork's new id) are written again.

use std::path::Path;
use std::sync::Mutex;

/// The directory of the identity files.
const RUN_DIR: &str = "/run/e2b";

/// The (sandbox id, template id) last written, all files with success.
static WRITTEN: Mutex<Option<(Option<String>, Option<String>)>> = Mutex::new(None);

/// Writes the identity files of `sandbox_id` and `template_id` (a missing one: that file
/// is left as it is) into [`RUN_DIR`], unless they are the ones last written. Failures
/// are logged, not returned: no program of the sandbox depends on these files.
pub fn write(sandbox_id: Option<&str>, template_id: Option<&str>) {
    write_into(Path::new(RUN_DIR), sandbox_id, template_id);
}

fn write_into(dir: &Path, sandbox_id: Option<&str>, template_id: Option<&str>) {
    let want = (
        sandbox_id.map(str::to_string),
        template_id.map(str::to_string),
    );
    let mut written = WRITTEN.lock().unwrap_or_else(|e| e.into_inner());
    if written.as_ref() == Some(&want) {
        return;
    }
    *written = None;
    if let Err(e) = std::fs::create_dir_all(dir) {
        tracing::warn!(error = %e, "cannot create {}", dir.display());
        return;
    }
    let files = [
        (".E2B_SANDBOX", Some("true")),
        (".E2B_SANDBOX_ID", sandbox_id),
        (".E2B_TEMPLATE_ID", template_id),
    ];
    let mut ok = true;
    for (name, content) in files {
        if let Some(content) = content
            && let Err(e) = std::fs::write(dir.join(name), content)
        {
            tracing::warn!(error = %e, file = name, "cannot write identity file");
            ok = false;
        }
    }
    if ok {
        *written = Some(want);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_only_what_changed() {
        let dir =
            std::env::temp_dir().join(format!("cubicle-envd-identity-{}", std::process::id()));
        let read = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap();
        write_into(&dir, Some("sb1"), Some("tiny"));
        assert_eq!(read(".E2B_SANDBOX"), "true");
        assert_eq!(read(".E2B_SANDBOX_ID"), "sb1");
        assert_eq!(read(".E2B_TEMPLATE_ID"), "tiny");
        // The same ids again (a claim after the pooled start): nothing is written.
        std::fs::remove_file(dir.join(".E2B_SANDBOX_ID")).unwrap();
        write_into(&dir, Some("sb1"), Some("tiny"));
        assert!(!dir.join(".E2B_SANDBOX_ID").exists());
        // Another id (a fork): written.
        write_into(&dir, Some("sb2"), Some("tiny"));
        assert_eq!(read(".E2B_SANDBOX_ID"), "sb2");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
