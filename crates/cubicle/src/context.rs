//! A build context on the client side: the files one COPY step takes, packed as the SDKs
//! pack them (a gzipped tar whose entries are named relative to the context directory)
//! and hashed (the server's cache key for them: the step's `COPY src dest`, then each
//! entry's path, mode, size and content or link target, in path order).
//!
//! Sources are relative to the context and may not leave it; a `*`, `?` or `[…]` in the
//! last component matches names in its directory. `.dockerignore` patterns (a path, a
//! directory prefix, or a glob on whole components) leave entries out.

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context as _, bail};
use sha2::{Digest, Sha256};

/// A context directory and its ignore patterns.
pub struct Context {
    dir: PathBuf,
    ignore: Vec<String>,
}

/// Shell-style match of one path component (`*`, `?`, `[abc]`).
fn glob_match(pat: &[u8], name: &[u8]) -> bool {
    match (pat.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob_match(&pat[1..], name) || (!name.is_empty() && glob_match(pat, &name[1..]))
        }
        (Some(b'?'), Some(_)) => glob_match(&pat[1..], &name[1..]),
        (Some(b'['), Some(c)) => match pat.iter().position(|b| *b == b']') {
            Some(end) => pat[1..end].contains(c) && glob_match(&pat[end + 1..], &name[1..]),
            None => false,
        },
        (Some(p), Some(c)) if p == c => glob_match(&pat[1..], &name[1..]),
        _ => false,
    }
}

fn matches_pattern(pattern: &str, rel: &str) -> bool {
    let p: Vec<&str> = pattern
        .trim_matches('/')
        .split('/')
        .filter(|c| !c.is_empty())
        .collect();
    let r: Vec<&str> = rel.split('/').collect();
    // A pattern matches the path or any of its parents (a directory excludes its contents).
    r.len() >= p.len()
        && !p.is_empty()
        && p.iter()
            .zip(&r)
            .all(|(pc, rc)| *pc == "**" || glob_match(pc.as_bytes(), rc.as_bytes()))
}

impl Context {
    /// The context at `dir` (its `.dockerignore` read if present).
    pub fn new(dir: &Path) -> anyhow::Result<Context> {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("build context {}", dir.display()))?;
        let ignore = fs::read_to_string(dir.join(".dockerignore"))
            .map(|t| {
                t.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(|l| l.trim_start_matches("./").to_string())
                    .collect()
            })
            .unwrap_or_default();
        Ok(Context { dir, ignore })
    }

    fn ignored(&self, rel: &str) -> bool {
        let mut out = false;
        for p in &self.ignore {
            if let Some(neg) = p.strip_prefix('!') {
                if matches_pattern(neg, rel) {
                    out = false;
                }
            } else if matches_pattern(p, rel) {
                out = true;
            }
        }
        out
    }

    /// The relative paths `src` names (each directory followed by everything under it).
    fn entries(&self, src: &str) -> anyhow::Result<Vec<String>> {
        let mut rel = PathBuf::new();
        for c in Path::new(src).components() {
            match c {
                Component::Normal(n) => rel.push(n),
                Component::CurDir => {}
                _ => bail!("COPY source '{src}' must be a relative path inside the context"),
            }
        }
        let name = rel
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let roots: Vec<PathBuf> = if name.contains(['*', '?', '[']) {
            let parent = rel.parent().map(Path::to_path_buf).unwrap_or_default();
            let mut v: Vec<PathBuf> = fs::read_dir(self.dir.join(&parent))
                .with_context(|| format!("COPY {src}: reading {}", parent.display()))?
                .flatten()
                .filter(|e| glob_match(name.as_bytes(), e.file_name().as_encoded_bytes()))
                .map(|e| parent.join(e.file_name()))
                .collect();
            v.sort();
            v
        } else {
            vec![rel]
        };
        if roots.is_empty() {
            bail!("COPY {src}: no file in the context matches");
        }
        let mut out = Vec::new();
        for r in roots {
            let full = self.dir.join(&r);
            let m = fs::symlink_metadata(&full).with_context(|| {
                format!(
                    "COPY {src}: {} is not in the context {}",
                    r.display(),
                    self.dir.display()
                )
            })?;
            self.walk(&r, &m, &mut out)?;
        }
        Ok(out)
    }

    fn walk(&self, rel: &Path, m: &fs::Metadata, out: &mut Vec<String>) -> anyhow::Result<()> {
        let s = rel.to_string_lossy().into_owned();
        if self.ignored(&s) {
            return Ok(());
        }
        out.push(s);
        if m.is_dir() {
            let mut kids: Vec<_> = fs::read_dir(self.dir.join(rel))?.flatten().collect();
            kids.sort_by_key(|e| e.file_name());
            for k in kids {
                let km = fs::symlink_metadata(k.path())?;
                self.walk(&rel.join(k.file_name()), &km, out)?;
            }
        }
        Ok(())
    }

    /// `(hash, gzipped tar)` of what `COPY src dest` takes.
    pub fn archive(&self, src: &str, dest: &str) -> anyhow::Result<(String, Vec<u8>)> {
        let entries = self.entries(src)?;
        let mut h = Sha256::new();
        h.update(format!("COPY {src} {dest}").as_bytes());
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut tar = tar::Builder::new(gz);
        tar.follow_symlinks(false);
        let mut sorted = entries.clone();
        sorted.sort();
        for rel in &sorted {
            let full = self.dir.join(rel);
            let m = fs::symlink_metadata(&full)?;
            h.update(rel.as_bytes());
            h.update(m.mode().to_string().as_bytes());
            if m.is_file() {
                h.update(m.len().to_string().as_bytes());
                h.update(fs::read(&full)?);
            } else if m.file_type().is_symlink() {
                h.update(fs::read_link(&full)?.as_os_str().as_encoded_bytes());
            }
        }
        for rel in &entries {
            tar.append_path_with_name(self.dir.join(rel), rel)
                .with_context(|| format!("packing {rel}"))?;
        }
        let mut gz = tar.into_inner()?;
        gz.flush()?;
        let data = gz.finish()?;
        let hash: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok((hash, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_ignores_and_stable_hashes() {
        let d = std::env::temp_dir().join(format!("cubicle-ctx-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(d.join("src/node_modules")).unwrap();
        fs::write(d.join("src/a.js"), "a").unwrap();
        fs::write(d.join("src/b.txt"), "b").unwrap();
        fs::write(d.join("src/node_modules/x.js"), "x").unwrap();
        fs::write(d.join(".dockerignore"), "**/node_modules\n").unwrap();
        let c = Context::new(&d).unwrap();
        assert_eq!(c.entries("src/*.js").unwrap(), vec!["src/a.js"]);
        assert_eq!(
            c.entries("./src").unwrap(),
            vec!["src", "src/a.js", "src/b.txt"]
        );
        assert!(c.entries("../etc").is_err());
        assert!(c.entries("/etc").is_err());
        assert!(c.entries("nope").is_err());
        let (h1, _) = c.archive("src", "/app/").unwrap();
        let (h2, _) = c.archive("src", "/app/").unwrap();
        assert_eq!(h1, h2);
        fs::write(d.join("src/a.js"), "changed").unwrap();
        assert_ne!(c.archive("src", "/app/").unwrap().0, h1);
        assert_ne!(c.archive("src", "/other/").unwrap().0, h2);
        fs::remove_dir_all(&d).unwrap();
    }
}
