//! Unix socket pairs: the parent's end and the child's end of a control channel (the
//! runtime's spawn helper, CRIU's RPC socket).

use std::io;
use std::os::fd::OwnedFd;

use rustix::net::{AddressFamily, SocketFlags, SocketType, socketpair};

/// A connected, close-on-exec `SOCK_SEQPACKET` Unix socket pair (message boundaries kept).
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
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
}
