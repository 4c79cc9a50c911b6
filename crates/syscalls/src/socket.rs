//! Unix socket pairs: the parent's end and the child's end of a control channel (the
//! runtime's spawn helper, CRIU's RPC socket); whether a kept connection is still usable.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::net::{AddressFamily, RecvFlags, SocketFlags, SocketType, recv, socketpair};

/// A connected, close-on-exec `SOCK_SEQPACKET` Unix socket pair (message boundaries kept).
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Whether connected stream socket `sock` is open with nothing to read: the peer has not
/// closed it (that reads as end of file) nor sent anything unasked. Does not block or
/// consume anything (`MSG_PEEK | MSG_DONTWAIT`).
pub fn is_idle_open(sock: impl AsFd) -> bool {
    let mut b = [0u8; 1];
    matches!(
        recv(sock, &mut b, RecvFlags::PEEK | RecvFlags::DONTWAIT),
        Err(rustix::io::Errno::AGAIN)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_keeps_message_boundaries_and_is_cloexec() {
        let (a, b) = seqpacket_pair().unwrap();
        rustix::io::write(&a, b"one").unwrap();
        rustix::io::write(&a, b"two").unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(rustix::io::read(&b, &mut buf).unwrap(), 3);
        assert_eq!(&buf[..3], b"one");
        let flags = rustix::io::fcntl_getfd(&b).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
    }

    #[test]
    fn an_idle_connection_is_open_until_the_peer_writes_or_closes() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(is_idle_open(&a));
        rustix::io::write(&b, b"x").unwrap();
        assert!(!is_idle_open(&a), "unread data: not idle");
        let mut buf = [0u8; 1];
        assert_eq!(rustix::io::read(&a, &mut buf).unwrap(), 1);
        assert!(is_idle_open(&a), "idle again once read");
        drop(b);
        assert!(!is_idle_open(&a), "the peer closed it");
    }
}
