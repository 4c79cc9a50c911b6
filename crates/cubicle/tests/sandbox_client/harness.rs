//! Shared helpers of the `cubicle sandbox …` end-to-end tests: running the binary, a
//! PTY to drive `shell`, the envd binary, free ports.

#![allow(dead_code)]

use std::{
    io::{Read, Write},
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

pub const BIN: &str = env!("CARGO_BIN_EXE_cubicle");

/// `cubicle sandbox ARGS…` against `api` with `key`.
pub fn sandbox_cmd(api: &str, key: &str, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("sandbox")
        .args(args)
        .env("E2B_API_URL", api)
        .env("E2B_API_KEY", key)
        .env_remove("E2B_SANDBOX_URL")
        .env_remove("CUBICLE_LOG");
    c
}

pub fn run(api: &str, key: &str, args: &[&str]) -> Output {
    sandbox_cmd(api, key, args)
        .stdin(Stdio::null())
        .output()
        .expect("running cubicle")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts success and returns stdout.
pub fn ok(o: Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what}: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Waits until something accepts connections on `port`.
pub fn wait_port(port: u16, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited early: {st}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} never listened on {port}");
}

/// The statically linked envd (built with scripts/build-envd.sh when missing).
pub fn envd_binary() -> PathBuf {
    let exe_dir = Path::new(BIN).parent().unwrap().to_path_buf();
    let envd = exe_dir
        .parent()
        .unwrap()
        .join("x86_64-unknown-linux-gnu")
        .join(exe_dir.file_name().unwrap())
        .join("cubicle-envd");
    if !envd.exists() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-envd.sh");
        let ok = Command::new("bash")
            .arg(&script)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "building envd with {} failed", script.display());
    }
    envd
}

/// Kills a child when dropped.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `cubicle sandbox shell` on a fresh PTY: what it printed, how it exited, and whether
/// the terminal settings were the same afterwards.
pub struct ShellRun {
    pub output: String,
    pub code: Option<i32>,
    pub termios_restored: bool,
}

fn termios(fd: &OwnedFd) -> (u32, u32, u32) {
    let t = nix::sys::termios::tcgetattr(fd).unwrap();
    (
        t.local_flags.bits(),
        t.input_flags.bits(),
        t.output_flags.bits(),
    )
}

/// Runs `cubicle sandbox shell ARGS…` with a PTY as its terminal; once the remote shell
/// has printed something (its prompt), types each of `lines`.
pub fn shell_on_pty(api: &str, key: &str, args: &[&str], lines: &[&str]) -> ShellRun {
    shell_on_pty_with(Path::new(BIN), api, key, args, lines, None)
}

/// Same, with `program` standing in for the cubicle binary (e.g. an nsenter wrapper),
/// and optionally the window resized to `(cols, rows)` (plus SIGWINCH) before typing.
pub fn shell_on_pty_with(
    program: &Path,
    api: &str,
    key: &str,
    args: &[&str],
    lines: &[&str],
    resize: Option<(u16, u16)>,
) -> ShellRun {
    let ws = nix::pty::Winsize {
        ws_row: 30,
        ws_col: 100,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&ws), None).unwrap();
    let (master, slave) = (pty.master, pty.slave);
    let before = termios(&slave);
    let mut child = {
        // The Command owns the slave copies it hands the child: dropped with it, here.
        let mut cmd = Command::new(program);
        cmd.arg("sandbox")
            .arg("shell")
            .args(args)
            .env("E2B_API_URL", api)
            .env("E2B_API_KEY", key)
            .env_remove("E2B_SANDBOX_URL")
            .env_remove("CUBICLE_LOG");
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave.try_clone().unwrap()))
            .env("TERM", "xterm");
        KillOnDrop(cmd.spawn().unwrap())
    };

    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    let reader = {
        let out = out.clone();
        let mut m = std::fs::File::from(master.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once every slave fd is closed.
            while let Ok(n) = m.read(&mut buf) {
                if n == 0 {
                    break;
                }
                out.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.lock().unwrap().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    if let Some((cols, rows)) = resize {
        let ws = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a valid winsize.
        let r = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&master),
                libc::TIOCSWINSZ,
                &ws,
            )
        };
        assert_eq!(r, 0, "TIOCSWINSZ");
        // The child is not a session leader on this terminal: signal it ourselves.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.0.id() as i32),
            nix::sys::signal::Signal::SIGWINCH,
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(300));
    }
    let mut w = std::fs::File::from(master.try_clone().unwrap());
    for l in lines {
        w.write_all(l.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut code = None;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.0.try_wait() {
            code = st.code();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let termios_restored = termios(&slave) == before;
    drop(slave);
    drop(w);
    // The reader ends on EIO now that the child and our slave copies are gone.
    drop(child);
    let _ = reader.join();
    let output = String::from_utf8_lossy(&out.lock().unwrap()).into_owned();
    ShellRun {
        output,
        code,
        termios_restored,
    }
}
