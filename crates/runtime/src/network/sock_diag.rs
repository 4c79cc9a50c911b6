//! Socket diagnostics over netlink (`NETLINK_SOCK_DIAG`): destroying a sandbox's TCP
//! socket from the outside (`SOCK_DESTROY`), so that a connection its new policy refuses
//! ends at once on the sandbox's side too. Deleting the connection's conntrack entry
//! (`conntrack.rs`) stops its packets, but a socket whose far end speaks next would
//! hear nothing until its own next packet was refused or its read timed out: a download
//! without a timeout would hang. Destroyed, the socket's reads and writes fail with
//! `ECONNABORTED` and the kernel sends the far end a reset.

use std::io;
use std::net::SocketAddrV4;

use super::conntrack::TcpFlow;
use super::netlink::{Msg, NLM_F_ACK, NLM_F_REQUEST, NetlinkSocket};
use super::netns::{Netns, run_in_netns};
use crate::error::{Error, Result};

/// `SOCK_DESTROY` (linux/sock_diag.h).
const SOCK_DESTROY: u16 = 21;
/// `inet_diag_sockid.idiag_cookie` for "any socket with this address pair".
const NO_COOKIE: u32 = !0;

/// The `inet_diag_req_v2` naming the TCP socket `local` → `remote`, in any state.
fn request(local: SocketAddrV4, remote: SocketAddrV4) -> Vec<u8> {
    let mut r = Vec::with_capacity(56);
    r.extend_from_slice(&[libc::AF_INET as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    r.extend_from_slice(&u32::MAX.to_ne_bytes()); // idiag_states: all
    r.extend_from_slice(&local.port().to_be_bytes());
    r.extend_from_slice(&remote.port().to_be_bytes());
    for ip in [local.ip(), remote.ip()] {
        let mut a = [0u8; 16];
        a[..4].copy_from_slice(&ip.octets());
        r.extend_from_slice(&a);
    }
    r.extend_from_slice(&0u32.to_ne_bytes()); // idiag_if: any
    r.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    r.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    r
}

/// Destroys the TCP sockets `flows` name (their opener's ends) in the network namespace
/// `ns`; how many there were. A kernel without `SOCK_DESTROY`
/// (`CONFIG_INET_DIAG_DESTROY`) destroys none.
pub(crate) fn destroy_in(ns: &Netns, flows: Vec<TcpFlow>) -> Result<usize> {
    let destroyed = run_in_netns(ns, move || -> io::Result<usize> {
        let mut sock = NetlinkSocket::open(libc::NETLINK_SOCK_DIAG)?;
        let mut n = 0;
        for f in flows {
            match destroy_tcp(&mut sock, f.local, f.remote) {
                Ok(found) => n += usize::from(found),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(n),
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    })?;
    destroyed.map_err(|e| Error::io("destroying the sandbox's sockets of cut connections", e))
}

/// Destroys the TCP socket `local` → `remote` of the network namespace `sock` (a
/// `NETLINK_SOCK_DIAG` socket) was opened in. Returns whether there was one.
fn destroy_tcp(
    sock: &mut NetlinkSocket,
    local: SocketAddrV4,
    remote: SocketAddrV4,
) -> io::Result<bool> {
    let mut m = Msg::new(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&request(local, remote));
    match sock.request_ack(m) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_an_inet_diag_req_v2() {
        let r = request(
            "10.200.0.3:40000".parse().unwrap(),
            "198.51.100.2:80".parse().unwrap(),
        );
        // 8 bytes of header, then inet_diag_sockid (48).
        assert_eq!(r.len(), 56);
        assert_eq!(&r[..2], &[libc::AF_INET as u8, libc::IPPROTO_TCP as u8]);
        assert_eq!(&r[8..12], &[0x9c, 0x40, 0, 80]);
        assert_eq!(&r[12..16], &[10, 200, 0, 3]);
        assert_eq!(&r[28..32], &[198, 51, 100, 2]);
        assert_eq!(&r[48..56], &[0xff; 8]);
    }
}
