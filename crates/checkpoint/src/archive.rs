//! The contents of a sandbox's staging tmpfs (`/dev`, `/dev/shm`, `/run`): CRIU treats
//! those mounts as external and does not save them, so a dump saves them here and a
//! restore writes them back before CRIU runs.
//!
//! The walk goes through `/proc/<init>/root/<mount point>` (the sandbox's own view) while
//! the sandbox is frozen, never follows a symbolic link, and stays on the mount it
//! started on: whatever is mounted below (device nodes, `devpts`, the agent binary, the
//! ctl directory, `/dev/shm` inside `/dev`) is recorded as an empty placeholder of the
//! same kind, which is what the sandbox had under it. Owners are stored relative to the
//! sandbox's uid range so a restore on another range maps them. Sockets are left out
//! (CRIU binds them again); device nodes cannot exist on a sandbox's tmpfs.
//!
//! Format (little endian): the magic line, then per entry `kind u8`, `section u16`,
//! `path` (u32 length + bytes, relative to the section's directory, empty for the
//! directory itself), `mode u32`, `uid u32`, `gid u32`, `data` (u64 length + bytes: file
//! contents or symlink target). Parents come before their children.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt, lchown};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

const MAGIC: &[u8] = b"cubicle-tmpfs-archive 1\n";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Dir = 1,
    File = 2,
    Symlink = 3,
    Fifo = 4,
    /// A directory something else is mounted on.
    DirMountPoint = 5,
    /// A file something else is mounted on.
    FileMountPoint = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Dir,
            2 => Kind::File,
            3 => Kind::Symlink,
            4 => Kind::Fifo,
            5 => Kind::DirMountPoint,
            6 => Kind::FileMountPoint,
            _ => return None,
        })
    }
}

/// Ids outside the sandbox's range (host ids the sandbox cannot have created).
const FOREIGN: u32 = u32::MAX;

/// Saves the trees `sections` (`(path to walk, section name)`, e.g.
/// `("/proc/42/root/dev", "dev")`) into `out`. Returns the bytes written.
pub fn save(sections: &[(PathBuf, String)], uid_base: u32, out: &Path) -> Result<u64> {
    let f = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(out)
        .map_err(|e| Error::io(format!("create {}", out.display()), e))?;
    let mut w = Counting {
        inner: BufWriter::new(f),
        n: 0,
    };
    let ctx = |e: io::Error| Error::io(format!("write {}", out.display()), e);
    w.write_all(MAGIC).map_err(ctx)?;
    let names: Vec<&str> = sections.iter().map(|(_, n)| n.as_str()).collect();
    w.write_all(&(names.len() as u16).to_le_bytes())
        .map_err(ctx)?;
    for n in &names {
        write_bytes(&mut w, n.as_bytes()).map_err(ctx)?;
    }
    for (i, (dir, _)) in sections.iter().enumerate() {
        let top = mount_id(dir).map_err(|e| Error::io(format!("statx {}", dir.display()), e))?;
        walk(&mut w, i as u16, dir, Path::new(""), top, uid_base)?;
    }
    // Not synced: a checkpoint must survive the host's processes dying (the page cache
    // does), not a power cut; a sync here would stop the frozen sandbox for tens of ms.
    w.inner
        .flush()
        .map_err(|e| Error::io(format!("write {}", out.display()), e))?;
    Ok(w.n)
}

struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn write_bytes(w: &mut impl Write, b: &[u8]) -> io::Result<()> {
    w.write_all(&(b.len() as u32).to_le_bytes())?;
    w.write_all(b)
}

fn rel_id(id: u32, base: u32) -> u32 {
    if id >= base && id - base < cubicle_runtime::DEFAULT_UID_COUNT {
        id - base
    } else {
        FOREIGN
    }
}

fn header(
    w: &mut impl Write,
    kind: Kind,
    section: u16,
    rel: &Path,
    md: &fs::Metadata,
    base: u32,
) -> io::Result<()> {
    w.write_all(&[kind as u8])?;
    w.write_all(&section.to_le_bytes())?;
    write_bytes(w, rel.as_os_str().as_bytes())?;
    w.write_all(&(md.mode() & 0o7777).to_le_bytes())?;
    w.write_all(&rel_id(md.uid(), base).to_le_bytes())?;
    w.write_all(&rel_id(md.gid(), base).to_le_bytes())
}

fn walk(
    w: &mut Counting<BufWriter<File>>,
    section: u16,
    path: &Path,
    rel: &Path,
    top: u64,
    base: u32,
) -> Result<()> {
    let ctx = |what: &str, e: io::Error| Error::io(format!("{what} {}", path.display()), e);
    let md = fs::symlink_metadata(path).map_err(|e| ctx("lstat", e))?;
    let ft = md.file_type();
    let mounted_over = !rel.as_os_str().is_empty()
        && !ft.is_symlink()
        && mount_id(path).map_err(|e| ctx("statx", e))? != top;
    let kind = if mounted_over {
        if ft.is_dir() {
            Kind::DirMountPoint
        } else {
            Kind::FileMountPoint
        }
    } else if ft.is_dir() {
        Kind::Dir
    } else if ft.is_symlink() {
        Kind::Symlink
    } else if ft.is_file() {
        Kind::File
    } else {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            Kind::Fifo
        } else {
            // Sockets (re-bound by CRIU) and anything else: left out.
            return Ok(());
        }
    };
    let werr = |e: io::Error| Error::io("write the tmpfs archive", e);
    header(w, kind, section, rel, &md, base).map_err(werr)?;
    match kind {
        Kind::File => {
            let mut f = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(path)
                .map_err(|e| ctx("open", e))?;
            let len = f.metadata().map_err(|e| ctx("fstat", e))?.len();
            w.write_all(&len.to_le_bytes()).map_err(werr)?;
            let copied = io::copy(&mut (&mut f).take(len), w).map_err(|e| ctx("copy", e))?;
            if copied != len {
                return Err(Error::Image {
                    dir: path.to_path_buf(),
                    message: format!("changed size while saved ({copied} of {len} bytes)"),
                });
            }
        }
        Kind::Symlink => {
            let target = fs::read_link(path).map_err(|e| ctx("readlink", e))?;
            let t = target.as_os_str().as_bytes();
            w.write_all(&(t.len() as u64).to_le_bytes()).map_err(werr)?;
            w.write_all(t).map_err(werr)?;
        }
        _ => w.write_all(&0u64.to_le_bytes()).map_err(werr)?,
    }
    if kind == Kind::Dir {
        let mut names: Vec<_> = fs::read_dir(path)
            .map_err(|e| ctx("readdir", e))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()
            .map_err(|e| ctx("readdir", e))?;
        names.sort();
        for n in names {
            walk(w, section, &path.join(&n), &rel.join(&n), top, base)?;
        }
    }
    Ok(())
}

/// `statx(STATX_MNT_ID)` of `path` without following a final symlink.
fn mount_id(path: &Path) -> io::Result<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: zeroed statx is a valid out buffer.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out buffer.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_MNT_ID,
            &mut stx,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if stx.stx_mask & libc::STATX_MNT_ID == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the kernel reports no mount id (statx STATX_MNT_ID)",
        ));
    }
    Ok(stx.stx_mnt_id)
}

/// Writes the archive `f` (opened from `file`, named in errors) back below `staging`
/// (`staging/<section>/...`), giving sandbox-relative owners the uid range at `uid_base`
/// (0 when running as root of the sandbox's user namespace).
pub fn restore(f: File, file: &Path, staging: &Path, uid_base: u32) -> Result<()> {
    let bad = |m: String| Error::Image {
        dir: file.to_path_buf(),
        message: m,
    };
    let mut r = BufReader::new(f);
    let rerr = |e: io::Error| Error::io(format!("read {}", file.display()), e);
    let mut magic = vec![0u8; MAGIC.len()];
    r.read_exact(&mut magic).map_err(rerr)?;
    if magic != MAGIC {
        return Err(bad("not a tmpfs archive of this version".into()));
    }
    let n = read_u16(&mut r).map_err(rerr)?;
    let mut sections = Vec::new();
    for _ in 0..n {
        let name = read_bytes(&mut r).map_err(rerr)?;
        sections.push(safe_rel(OsStr::from_bytes(&name)).ok_or_else(|| bad("bad section".into()))?);
    }
    let id = |rel: u32| {
        if rel == FOREIGN {
            65534 + uid_base
        } else {
            uid_base + rel
        }
    };
    loop {
        let mut k = [0u8; 1];
        if r.read(&mut k).map_err(rerr)? == 0 {
            break;
        }
        let kind = Kind::from_u8(k[0]).ok_or_else(|| bad(format!("bad entry kind {}", k[0])))?;
        let section = read_u16(&mut r).map_err(rerr)? as usize;
        let rel = read_bytes(&mut r).map_err(rerr)?;
        let mode = read_u32(&mut r).map_err(rerr)?;
        let (uid, gid) = (
            read_u32(&mut r).map_err(rerr)?,
            read_u32(&mut r).map_err(rerr)?,
        );
        let len = read_u64(&mut r).map_err(rerr)?;
        let base = sections
            .get(section)
            .ok_or_else(|| bad(format!("entry in unknown section {section}")))?;
        let rel = safe_rel(OsStr::from_bytes(&rel)).ok_or_else(|| bad("bad path".into()))?;
        let path = staging.join(base).join(&rel);
        let ctx = |what: &str, e: io::Error| Error::io(format!("{what} {}", path.display()), e);
        match kind {
            Kind::Dir | Kind::DirMountPoint => {
                if !path.is_dir() {
                    fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(&path)
                        .map_err(|e| ctx("mkdir", e))?;
                }
            }
            Kind::File | Kind::FileMountPoint => {
                let mut f = OpenOptions::new()
                    .create(true)
                    .truncate(true)
                    .write(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(0o600)
                    .open(&path)
                    .map_err(|e| ctx("create", e))?;
                let copied = io::copy(&mut (&mut r).take(len), &mut f).map_err(rerr)?;
                if copied != len {
                    return Err(bad(format!("{} is cut short", rel.display())));
                }
            }
            Kind::Symlink => {
                let mut t = vec![0u8; len as usize];
                r.read_exact(&mut t).map_err(rerr)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&t), &path)
                    .map_err(|e| ctx("symlink", e))?;
            }
            Kind::Fifo => {
                let c = std::ffi::CString::new(path.as_os_str().as_bytes())
                    .map_err(|_| bad("NUL in path".into()))?;
                // SAFETY: valid path.
                if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } < 0 {
                    return Err(ctx("mkfifo", io::Error::last_os_error()));
                }
            }
        }
        if !matches!(kind, Kind::File | Kind::FileMountPoint | Kind::Symlink) && len != 0 {
            io::copy(&mut (&mut r).take(len), &mut io::sink()).map_err(rerr)?;
        }
        lchown(&path, Some(id(uid)), Some(id(gid))).map_err(|e| ctx("chown", e))?;
        if kind != Kind::Symlink {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(|e| ctx("chmod", e))?;
        }
    }
    Ok(())
}

/// A relative path without `..`, root or prefix components.
fn safe_rel(p: &OsStr) -> Option<PathBuf> {
    let p = Path::new(p);
    p.components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        .then(|| p.to_path_buf())
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_le_bytes(b))
}
fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}
fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let n = read_u32(r)? as usize;
    if n > 64 << 10 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "name too long"));
    }
    let mut b = vec![0u8; n];
    r.read_exact(&mut b)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_files_links_modes_and_owners() {
        if !nix_root() {
            eprintln!("skipped: needs root (chown)");
            return;
        }
        let src = tempfile::tempdir().unwrap();
        let base = 200_000;
        let run = src.path().join("run");
        fs::create_dir_all(run.join("lock")).unwrap();
        fs::write(run.join("pidfile"), b"1234\n").unwrap();
        fs::set_permissions(run.join("lock"), fs::Permissions::from_mode(0o1777)).unwrap();
        std::os::unix::fs::symlink("../pidfile", run.join("lock/link")).unwrap();
        lchown(run.join("pidfile"), Some(base + 1000), Some(base + 1000)).unwrap();
        let out = src.path().join("archive");
        save(&[(run.clone(), "run".into())], base, &out).unwrap();

        let dst = tempfile::tempdir().unwrap();
        let new_base = 300_000;
        restore(File::open(&out).unwrap(), &out, dst.path(), new_base).unwrap();
        let r = dst.path().join("run");
        assert_eq!(fs::read(r.join("pidfile")).unwrap(), b"1234\n");
        assert_eq!(
            fs::symlink_metadata(r.join("pidfile")).unwrap().uid(),
            new_base + 1000
        );
        assert_eq!(
            fs::read_link(r.join("lock/link")).unwrap(),
            Path::new("../pidfile")
        );
        assert_eq!(
            fs::metadata(r.join("lock")).unwrap().mode() & 0o7777,
            0o1777
        );
    }

    #[test]
    fn refuses_paths_that_leave_the_staging_directory() {
        assert!(safe_rel(OsStr::new("a/../../etc")).is_none());
        assert!(safe_rel(OsStr::new("/etc")).is_none());
        assert_eq!(safe_rel(OsStr::new("a/b")), Some(PathBuf::from("a/b")));
        assert_eq!(safe_rel(OsStr::new("")), Some(PathBuf::from("")));
    }

    fn nix_root() -> bool {
        // SAFETY: geteuid has no arguments.
        unsafe { libc::geteuid() == 0 }
    }
}
