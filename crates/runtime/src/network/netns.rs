//! Network namespaces: a handle to one, running code inside one, and opening TCP
//! connections to a port inside a sandbox.
//!
//! `setns(CLONE_NEWNET)` changes the namespace of the calling *thread* only, and a
//! socket stays in the namespace it was created in. So every "inside" operation here
//! runs on a short-lived scoped thread that enters the namespace, creates its socket(s)
//! and exits; the sockets are then used from any thread. The caller's threads never
//! change namespace. A thread spawn + setns costs tens of microseconds (measured by the
//! `connect_in_netns_latency` ignored test).

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use super::netlink::RouteSocket;
use crate::error::{Error, Result};

/// An open handle to a network namespace (`/proc/<pid>/ns/net`, `/run/netns/<name>`, or
/// any fd to such a file). Holding it keeps the namespace alive.
#[derive(Debug)]
pub struct Netns {
    fd: OwnedFd,
}

impl Netns {
    /// The network namespace of process `pid` now. Only for a pid that cannot have been
    /// reused (a child not yet reaped); else open a pidfd and use [`Netns::from_fd`].
    pub fn from_pid(pid: i32) -> Result<Self> {
        Self::open(format!("/proc/{pid}/ns/net"))
    }

    /// The network namespace of the live process `pid` that `pidfd` names: opened by pid,
    /// then checked against the pidfd. A process that has not exited still holds its pid,
    /// so the namespace opened is its own; `ESRCH` once it has exited.
    pub fn of_process(pid: i32, pidfd: impl AsFd) -> Result<Self> {
        let ns = Self::from_pid(pid)?;
        if cubicle_syscalls::pidfd::exited(pidfd) {
            return Err(Error::io(
                format!("process {pid} exited while its network namespace was opened"),
                io::Error::from_raw_os_error(libc::ESRCH),
            ));
        }
        Ok(ns)
    }

    /// Opens a namespace file such as `/run/netns/NAME`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::File::open(path)
            .map_err(|e| Error::io(format!("opening network namespace {}", path.display()), e))?;
        Ok(Netns {
            fd: OwnedFd::from(file),
        })
    }

    /// The namespace of the calling thread.
    pub fn current() -> Result<Self> {
        Self::open("/proc/thread-self/ns/net")
    }

    /// Wraps an fd that refers to a network namespace, or a pidfd: then the namespace is
    /// that process's, and entering it fails (ESRCH) once the process has exited — no
    /// reused pid can redirect it, unlike [`Netns::from_pid`]. A pidfd can be entered,
    /// but not named as a new link's peer namespace (`attach`: netlink's
    /// `IFLA_NET_NS_FD` takes namespace files only and answers EINVAL).
    pub fn from_fd(fd: OwnedFd) -> Self {
        Netns { fd }
    }

    /// A second handle to the same namespace.
    pub fn try_clone(&self) -> Result<Self> {
        let fd = self
            .fd
            .try_clone()
            .map_err(|e| Error::io("duplicating netns fd", e))?;
        Ok(Netns { fd })
    }
}

impl AsFd for Netns {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Netns {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Runs `f` on a fresh thread inside `netns` and returns its result. The thread exits
/// afterwards, so the namespace switch never leaks into the caller's threads.
pub fn run_in_netns<F, R>(netns: &Netns, f: F) -> Result<R>
where
    F: FnOnce() -> R + Send,
    R: Send,
{
    let fd = netns.as_raw_fd();
    std::thread::scope(|s| {
        let handle = std::thread::Builder::new()
            .name("cubicle-netns".into())
            .spawn_scoped(s, move || {
                // SAFETY: fd is a valid namespace fd borrowed for the scope's lifetime.
                if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                    return Err(Error::io("setns(CLONE_NEWNET)", io::Error::last_os_error()));
                }
                Ok(f())
            })
            .map_err(|e| Error::io("spawning netns thread", e))?;
        handle
            .join()
            .map_err(|_| Error::io("netns thread", io::Error::other("panicked")))?
    })
}

/// A route (rtnetlink) socket bound to `netns`.
pub(crate) fn route_socket_in(netns: &Netns) -> Result<RouteSocket> {
    run_in_netns(netns, RouteSocket::open)?
        .map_err(|e| Error::io("opening netlink socket in sandbox netns", e))
}

/// Creates a TCP (IPv4) socket that lives in `netns`, non-blocking if asked.
pub fn tcp_socket_in_netns(netns: &Netns, nonblocking: bool) -> Result<OwnedFd> {
    let mut ty = libc::SOCK_STREAM | libc::SOCK_CLOEXEC;
    if nonblocking {
        ty |= libc::SOCK_NONBLOCK;
    }
    run_in_netns(netns, move || {
        // SAFETY: plain socket(2); the fd is wrapped at once.
        let fd = unsafe { libc::socket(libc::AF_INET, ty, 0) };
        if fd < 0 {
            Err(io::Error::last_os_error())
        } else {
            // SAFETY: fresh fd we own.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    })?
    .map_err(|e| Error::io("creating socket in sandbox netns", e))
}

/// Connects to `127.0.0.1:port` inside `netns` (e.g. a sandbox's
/// `python3 -m http.server 8000`). Works whether or not the sandbox has a veth.
pub fn connect_in_netns(netns: &Netns, port: u16) -> Result<TcpStream> {
    let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    connect_addr_in_netns(netns, addr)
}

/// Connects to `addr` from inside `netns` (the connection is made on the helper thread;
/// loopback connects complete immediately).
pub fn connect_addr_in_netns(netns: &Netns, addr: SocketAddr) -> Result<TcpStream> {
    run_in_netns(netns, move || TcpStream::connect(addr))?
        .map_err(|e| Error::io(format!("connecting to {addr} inside sandbox netns"), e))
}

/// Async variant of [`connect_in_netns`]: the socket is created inside the namespace on a
/// blocking-pool thread, the connect itself runs on the tokio reactor.
pub async fn connect_in_netns_async(netns: &Netns, port: u16) -> Result<tokio::net::TcpStream> {
    let ns = netns.try_clone()?;
    let fd = tokio::task::spawn_blocking(move || tcp_socket_in_netns(&ns, true))
        .await
        .map_err(|e| Error::io("netns socket task", io::Error::other(e)))??;
    let socket = tokio::net::TcpSocket::from_std_stream(TcpStream::from(fd));
    let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    socket
        .connect(addr)
        .await
        .map_err(|e| Error::io(format!("connecting to {addr} inside sandbox netns"), e))
}

/// Brings `lo` up inside `netns` (the spawn code does this for real sandboxes; tests and
/// tools use it for namespaces they make).
pub fn loopback_up(netns: &Netns) -> Result<()> {
    let mut sock = route_socket_in(netns)?;
    let index = sock
        .link_index("lo")
        .map_err(|e| Error::io("looking up lo", e))?
        .ok_or_else(|| Error::io("looking up lo", io::Error::from_raw_os_error(libc::ENODEV)))?;
    sock.set_up(index)
        .map_err(|e| Error::io("setting lo up", e))
}
