//! Netlink, minimally: the message builder and parser every netlink protocol here shares
//! ([`Msg`], [`attrs`], [`NetlinkSocket`]), and an rtnetlink client on top ([`RouteSocket`]:
//! just the link, address and route messages the sandbox network needs). The nftables
//! set-element and conntrack clients (`nftables.rs`, `conntrack.rs`) use the same socket.
//!
//! A netlink socket belongs to the network namespace it was created in, whatever thread
//! later uses it; so a socket opened once on a thread that `setns`ed into a sandbox's
//! namespace configures that namespace from anywhere (see `netns::route_socket_in`).
//! Spawning `ip` costs ~1–2 ms per call; a message here costs a few microseconds plus
//! the kernel's work.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};

// Message types and flags (linux/rtnetlink.h, linux/netlink.h).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
const RTM_NEWROUTE: u16 = 24;
const RTM_NEWNEIGH: u16 = 28;

pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
pub(crate) const NLM_F_EXCL: u16 = 0x200;
pub(crate) const NLM_F_CREATE: u16 = 0x400;
/// Attribute type flag of a nested attribute (NLA_F_NESTED).
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
const NLM_F_REPLACE: u16 = 0x100;

// Attributes.
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_MTU: u16 = 4;
const IFLA_LINKINFO: u16 = 18;
const IFLA_STATS64: u16 = 23;
const IFLA_GROUP: u16 = 27;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_NUM_TX_QUEUES: u16 = 31;
const IFLA_NUM_RX_QUEUES: u16 = 32;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;

const IFF_UP: u32 = 0x1;
/// No ARP on the link: the kernel neither answers nor learns from ARP there.
pub(crate) const IFF_NOARP: u32 = 0x80;
const NUD_PERMANENT: u16 = 0x80;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RTN_UNICAST: u8 = 1;
const RTNH_F_ONLINK: u32 = 4;

pub(crate) const NLMSG_HDRLEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;

pub(crate) fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// `struct ifinfomsg` (family AF_UNSPEC).
fn ifinfomsg(index: i32, flags: u32, change: u32) -> [u8; IFINFOMSG_LEN] {
    let mut h = [0u8; IFINFOMSG_LEN];
    h[4..8].copy_from_slice(&index.to_ne_bytes());
    h[8..12].copy_from_slice(&flags.to_ne_bytes());
    h[12..16].copy_from_slice(&change.to_ne_bytes());
    h
}

/// One netlink request being built.
pub(crate) struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    pub(crate) fn new(ty: u16, flags: u16) -> Self {
        let mut buf = vec![0u8; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&ty.to_ne_bytes());
        buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        Msg {
            buf,
            nests: Vec::new(),
        }
    }

    fn pad(&mut self) {
        let n = align4(self.buf.len());
        self.buf.resize(n, 0);
    }

    pub(crate) fn header(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        self.pad();
    }

    pub(crate) fn attr(&mut self, ty: u16, data: &[u8]) {
        let len = (4 + data.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
    }

    pub(crate) fn attr_str(&mut self, ty: u16, s: &str) {
        let mut data = Vec::with_capacity(s.len() + 1);
        data.extend_from_slice(s.as_bytes());
        data.push(0);
        self.attr(ty, &data);
    }

    pub(crate) fn attr_u32(&mut self, ty: u16, v: u32) {
        self.attr(ty, &v.to_ne_bytes());
    }

    /// Starts a nested attribute (closed by `end_nest`). Like iproute2, without
    /// NLA_F_NESTED: the veth peer payload is not a plain attribute list.
    pub(crate) fn begin_nest(&mut self, ty: u16) {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
    }

    pub(crate) fn end_nest(&mut self) {
        if let Some(pos) = self.nests.pop() {
            let len = (self.buf.len() - pos) as u16;
            self.buf[pos..pos + 2].copy_from_slice(&len.to_ne_bytes());
        }
    }

    pub(crate) fn finish(&mut self, seq: u32) -> &[u8] {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

/// Iterates the `(type, payload)` attributes of a message body (type without the
/// nested / byte-order flags).
pub(crate) fn attrs(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([data[0], data[1]]) as usize;
        let ty = u16::from_ne_bytes([data[2], data[3]]) & 0x3fff;
        if len < 4 || len > data.len() {
            return None;
        }
        let payload = &data[4..len];
        data = &data[align4(len).min(data.len())..];
        Some((ty, payload))
    })
}

pub(crate) fn cstr(data: &[u8]) -> String {
    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    String::from_utf8_lossy(&data[..end]).into_owned()
}

/// A link as seen in a dump.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    pub index: i32,
    pub name: String,
    pub kind: Option<String>,
    /// Packets the link received (`rtnl_link_stats64.rx_packets`), when reported.
    pub rx_packets: Option<u64>,
}

fn parse_link(payload: &[u8]) -> Option<Link> {
    if payload.len() < IFINFOMSG_LEN {
        return None;
    }
    let index = i32::from_ne_bytes([payload[4], payload[5], payload[6], payload[7]]);
    let mut name = None;
    let mut kind = None;
    let mut rx_packets = None;
    for (ty, data) in attrs(&payload[IFINFOMSG_LEN..]) {
        match ty {
            IFLA_IFNAME => name = Some(cstr(data)),
            // struct rtnl_link_stats64 starts with rx_packets (u64).
            IFLA_STATS64 => {
                rx_packets = data
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_ne_bytes)
            }
            IFLA_LINKINFO => {
                for (t, d) in attrs(data) {
                    if t == IFLA_INFO_KIND {
                        kind = Some(cstr(d));
                    }
                }
            }
            _ => {}
        }
    }
    Some(Link {
        index,
        name: name?,
        kind,
        rx_packets,
    })
}

/// A netlink socket of one protocol, bound to the network namespace it was created in.
pub(crate) struct NetlinkSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl NetlinkSocket {
    /// Opens a `protocol` (e.g. `NETLINK_ROUTE`, `NETLINK_NETFILTER`) socket in the calling
    /// thread's network namespace.
    pub fn open(protocol: libc::c_int) -> io::Result<Self> {
        Self::open_groups(protocol, 0)
    }

    /// Like [`NetlinkSocket::open`], subscribed to the multicast `groups` (a bit mask).
    pub fn open_groups(protocol: libc::c_int, groups: u32) -> io::Result<Self> {
        let fd = crate::sys::socket(libc::AF_NETLINK, libc::SOCK_RAW, protocol)?;
        // SAFETY: zeroed sockaddr_nl is valid; pid 0 lets the kernel choose.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = groups;
        // SAFETY: a valid socket and a sockaddr_nl with its true length.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // Do not echo the whole request back in error messages.
        let one: libc::c_int = 1;
        // SAFETY: valid option pointer and length.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_NETLINK,
                libc::NETLINK_CAP_ACK,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        Ok(NetlinkSocket {
            fd,
            seq: 0,
            buf: vec![0u8; 64 * 1024],
        })
    }

    /// The next sequence number (for callers that build batches themselves).
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends `msg` with a fresh sequence number, which it returns.
    pub fn send(&mut self, msg: &mut Msg) -> io::Result<u32> {
        let seq = self.next_seq();
        let bytes = msg.finish(seq).to_vec();
        self.send_bytes(&bytes)?;
        Ok(seq)
    }

    /// Sends already-finished message bytes (one message or a batch) to the kernel.
    pub fn send_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        // SAFETY: zeroed sockaddr_nl with pid 0 addresses the kernel.
        let mut dst: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        dst.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `bytes` and `dst` outlive the call; the lengths are theirs.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
                0,
                &dst as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receives replies to `seq` and hands each non-error message to `on_msg`, until an
    /// ACK / error (for requests) or NLMSG_DONE (for dumps).
    pub fn recv_until_done(
        &mut self,
        seq: u32,
        mut on_msg: impl FnMut(u16, &[u8]) -> bool,
    ) -> io::Result<()> {
        loop {
            let (fd, buf) = (self.fd.as_raw_fd(), &mut self.buf);
            // SAFETY: buf is a valid writable buffer of its length.
            let n = crate::sys::retry_eintr(|| unsafe {
                libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0)
            })?;
            let mut data = &self.buf[..n];
            while data.len() >= NLMSG_HDRLEN {
                let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
                let ty = u16::from_ne_bytes([data[4], data[5]]);
                let mseq = u32::from_ne_bytes([data[8], data[9], data[10], data[11]]);
                if len < NLMSG_HDRLEN || len > data.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "truncated netlink message",
                    ));
                }
                let payload = &data[NLMSG_HDRLEN..len];
                data = &data[align4(len).min(data.len())..];
                if mseq != seq {
                    continue; // a stale reply to an earlier request
                }
                match ty {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        if payload.len() < 4 {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "short netlink error",
                            ));
                        }
                        let err =
                            i32::from_ne_bytes([payload[0], payload[1], payload[2], payload[3]]);
                        return if err == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-err))
                        };
                    }
                    _ => {
                        if on_msg(ty, payload) {
                            return Ok(());
                        }
                    }
                }
            }
        }
    }

    /// Sends `msg` (which must ask for an ACK) and waits for the kernel's answer.
    pub fn request_ack(&mut self, mut msg: Msg) -> io::Result<()> {
        let seq = self.send(&mut msg)?;
        self.recv_until_done(seq, |_, _| false)
    }

    /// Waits at most `timeout` for the next datagram (event subscriptions) and hands each
    /// message in it to `on_msg(type, flags, payload)`. Returns false on timeout.
    /// Overruns (`ENOBUFS`: the kernel dropped events) are reported as an error once and
    /// reading goes on.
    pub fn recv_events(
        &mut self,
        timeout: std::time::Duration,
        mut on_msg: impl FnMut(u16, u16, &[u8]),
    ) -> io::Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe {
            libc::poll(
                &mut pfd,
                1,
                timeout.as_millis().min(i32::MAX as u128) as i32,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        if n == 0 {
            return Ok(false);
        }
        // SAFETY: buf is a valid writable buffer of its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr() as *mut libc::c_void,
                self.buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(false),
                _ => Err(e),
            };
        }
        let mut data = &self.buf[..n as usize];
        while data.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
            let ty = u16::from_ne_bytes([data[4], data[5]]);
            let flags = u16::from_ne_bytes([data[6], data[7]]);
            if len < NLMSG_HDRLEN || len > data.len() {
                break;
            }
            on_msg(ty, flags, &data[NLMSG_HDRLEN..len]);
            data = &data[align4(len).min(data.len())..];
        }
        Ok(true)
    }

    /// Sets the socket's receive buffer (events arrive in bursts).
    pub fn set_recv_buffer(&self, bytes: usize) {
        let v = bytes.min(i32::MAX as usize) as libc::c_int;
        // SAFETY: valid option pointer and length. SO_RCVBUFFORCE needs CAP_NET_ADMIN;
        // SO_RCVBUF (capped by rmem_max) is the fallback.
        unsafe {
            for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
                if libc::setsockopt(
                    self.fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &v as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                ) == 0
                {
                    break;
                }
            }
        }
    }

    /// Sends a dump request and hands every answer message to `on_msg`.
    pub fn dump(&mut self, mut msg: Msg, mut on_msg: impl FnMut(u16, &[u8])) -> io::Result<()> {
        let seq = self.send(&mut msg)?;
        self.recv_until_done(seq, |ty, payload| {
            on_msg(ty, payload);
            false
        })
    }
}

/// An IPv4 address of a host interface, as seen in an address dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IfAddr {
    pub index: i32,
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

/// A `NETLINK_ROUTE` socket, bound to the network namespace it was created in.
pub(crate) struct RouteSocket {
    sock: NetlinkSocket,
}

impl RouteSocket {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> io::Result<Self> {
        Ok(RouteSocket {
            sock: NetlinkSocket::open(libc::NETLINK_ROUTE)?,
        })
    }

    fn send(&mut self, msg: &mut Msg) -> io::Result<u32> {
        self.sock.send(msg)
    }

    fn recv_until_done(
        &mut self,
        seq: u32,
        on_msg: impl FnMut(u16, &[u8]) -> bool,
    ) -> io::Result<()> {
        self.sock.recv_until_done(seq, on_msg)
    }

    fn request_ack(&mut self, msg: Msg) -> io::Result<()> {
        self.sock.request_ack(msg)
    }

    /// Every IPv4 address of this namespace's interfaces.
    pub fn ipv4_addresses(&mut self) -> io::Result<Vec<IfAddr>> {
        let mut m = Msg::new(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP);
        let mut h = [0u8; 8];
        h[0] = libc::AF_INET as u8;
        m.header(&h);
        let mut out = Vec::new();
        self.sock.dump(m, |ty, payload| {
            if ty != RTM_NEWADDR || payload.len() < 8 || payload[0] != libc::AF_INET as u8 {
                return;
            }
            let prefix_len = payload[1];
            let index = u32::from_ne_bytes([payload[4], payload[5], payload[6], payload[7]]) as i32;
            let mut local = None;
            let mut address = None;
            for (ty, data) in attrs(&payload[8..]) {
                if data.len() == 4 {
                    let a = Ipv4Addr::new(data[0], data[1], data[2], data[3]);
                    match ty {
                        IFA_LOCAL => local = Some(a),
                        IFA_ADDRESS => address = Some(a),
                        _ => {}
                    }
                }
            }
            if let Some(addr) = local.or(address) {
                out.push(IfAddr {
                    index,
                    addr,
                    prefix_len,
                });
            }
        })?;
        Ok(out)
    }

    /// Creates a veth pair: `host` (name, MAC; down) in this socket's namespace and
    /// `peer` (name, MAC; down: set it up with `set_up` from a socket in that namespace)
    /// in `peer_netns`.
    ///
    /// One transmit and one receive queue per side. By default a veth gets one of each per
    /// possible CPU and then uses one: a queue's sysfs directories per CPU per side, and
    /// lowering the transmit queues to one waits for an RCU grace period under the rtnl
    /// lock, in every sandbox's create.
    pub fn create_veth(
        &mut self,
        host: (&str, [u8; 6]),
        peer: (&str, [u8; 6]),
        peer_netns: &impl AsRawFd,
        mtu: Option<u32>,
    ) -> io::Result<()> {
        let (host_name, host_mac) = host;
        let (peer_name, peer_mac) = peer;
        let mut m = Msg::new(
            RTM_NEWLINK,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        );
        // Down: the caller configures it (IPv6 off) before setting it up.
        m.header(&ifinfomsg(0, 0, 0));
        m.attr_str(IFLA_IFNAME, host_name);
        m.attr(IFLA_ADDRESS, &host_mac);
        if let Some(mtu) = mtu {
            m.attr_u32(IFLA_MTU, mtu);
        }
        m.attr_u32(IFLA_NUM_TX_QUEUES, 1);
        m.attr_u32(IFLA_NUM_RX_QUEUES, 1);
        m.begin_nest(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_KIND, "veth");
        m.begin_nest(IFLA_INFO_DATA);
        m.begin_nest(VETH_INFO_PEER);
        // Not IFF_UP here: the kernel opens the peer before linking the pair (ENOTCONN).
        m.header(&ifinfomsg(0, 0, 0));
        m.attr_str(IFLA_IFNAME, peer_name);
        m.attr(IFLA_ADDRESS, &peer_mac);
        m.attr_u32(IFLA_NET_NS_FD, peer_netns.as_raw_fd() as u32);
        if let Some(mtu) = mtu {
            m.attr_u32(IFLA_MTU, mtu);
        }
        m.attr_u32(IFLA_NUM_TX_QUEUES, 1);
        m.attr_u32(IFLA_NUM_RX_QUEUES, 1);
        m.end_nest();
        m.end_nest();
        m.end_nest();
        self.request_ack(m)
    }

    /// Deletes a link by name (deleting one end of a veth pair deletes both).
    pub fn delete_link(&mut self, name: &str) -> io::Result<()> {
        let mut m = Msg::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.header(&ifinfomsg(0, 0, 0));
        m.attr_str(IFLA_IFNAME, name);
        self.request_ack(m)
    }

    /// Moves the link `name` into device group `group`.
    pub fn set_group(&mut self, name: &str, group: u32) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.header(&ifinfomsg(0, 0, 0));
        m.attr_str(IFLA_IFNAME, name);
        m.attr_u32(IFLA_GROUP, group);
        self.request_ack(m)
    }

    /// Deletes every link of device group `group` (ENODEV: there is none), in one
    /// `unregister_netdevice_many`.
    pub fn delete_group(&mut self, group: u32) -> io::Result<()> {
        let mut m = Msg::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.header(&ifinfomsg(0, 0, 0));
        m.attr_u32(IFLA_GROUP, group);
        self.request_ack(m)
    }

    /// Sets a link up by index.
    pub fn set_up(&mut self, index: i32) -> io::Result<()> {
        self.set_up_with(index, 0)
    }

    /// Sets a link up by index, with the link `flags` (e.g. [`IFF_NOARP`]) set as well.
    pub fn set_up_with(&mut self, index: i32, flags: u32) -> io::Result<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.header(&ifinfomsg(index, IFF_UP | flags, IFF_UP | flags));
        self.request_ack(m)
    }

    /// Adds (or replaces) a permanent neighbour entry: `addr` is at `mac` on link `index`.
    pub fn add_permanent_neighbour(
        &mut self,
        index: i32,
        addr: Ipv4Addr,
        mac: [u8; 6],
    ) -> io::Result<()> {
        let mut m = Msg::new(
            RTM_NEWNEIGH,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        );
        // struct ndmsg: family, pad1, pad2, ifindex, state, flags, type.
        let mut h = [0u8; 12];
        h[0] = libc::AF_INET as u8;
        h[4..8].copy_from_slice(&index.to_ne_bytes());
        h[8..10].copy_from_slice(&NUD_PERMANENT.to_ne_bytes());
        h[11] = RTN_UNICAST;
        m.header(&h);
        m.attr(NDA_DST, &addr.octets());
        m.attr(NDA_LLADDR, &mac);
        self.request_ack(m)
    }

    /// The index of the link called `name`, if any.
    pub fn link_index(&mut self, name: &str) -> io::Result<Option<i32>> {
        Ok(self.link(name)?.map(|l| l.index))
    }

    /// The link called `name` (with its counters), if any.
    pub fn link(&mut self, name: &str) -> io::Result<Option<Link>> {
        let mut m = Msg::new(RTM_GETLINK, NLM_F_REQUEST);
        m.header(&ifinfomsg(0, 0, 0));
        m.attr_str(IFLA_IFNAME, name);
        let seq = self.send(&mut m)?;
        let mut found = None;
        let r = self.recv_until_done(seq, |ty, payload| {
            if ty == RTM_NEWLINK {
                found = parse_link(payload);
                true
            } else {
                false
            }
        });
        match r {
            Ok(()) => Ok(found),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// All links of this namespace.
    pub fn links(&mut self) -> io::Result<Vec<Link>> {
        let mut m = Msg::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP);
        m.header(&ifinfomsg(0, 0, 0));
        let seq = self.send(&mut m)?;
        let mut out = Vec::new();
        self.recv_until_done(seq, |ty, payload| {
            if ty == RTM_NEWLINK
                && let Some(l) = parse_link(payload)
            {
                out.push(l);
            }
            false
        })?;
        Ok(out)
    }

    /// Adds `addr/prefix_len` to link `index`.
    pub fn add_address(&mut self, index: i32, addr: Ipv4Addr, prefix_len: u8) -> io::Result<()> {
        let mut m = Msg::new(
            RTM_NEWADDR,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        );
        let mut h = [0u8; 8];
        h[0] = libc::AF_INET as u8;
        h[1] = prefix_len;
        h[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
        m.header(&h);
        m.attr(IFA_LOCAL, &addr.octets());
        m.attr(IFA_ADDRESS, &addr.octets());
        self.request_ack(m)
    }

    /// Adds a default route via `gateway` on link `index` (onlink: no need to wait for
    /// the connected route).
    pub fn add_default_route(&mut self, index: i32, gateway: Ipv4Addr) -> io::Result<()> {
        let mut m = Msg::new(
            RTM_NEWROUTE,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        );
        let mut h = [0u8; 12];
        h[0] = libc::AF_INET as u8;
        h[4] = RT_TABLE_MAIN;
        h[5] = RTPROT_BOOT;
        h[6] = 0; // RT_SCOPE_UNIVERSE
        h[7] = RTN_UNICAST;
        h[8..12].copy_from_slice(&RTNH_F_ONLINK.to_ne_bytes());
        m.header(&h);
        m.attr(RTA_GATEWAY, &gateway.octets());
        m.attr_u32(RTA_OIF, index as u32);
        self.request_ack(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_have_correct_lengths() {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST);
        m.header(&ifinfomsg(0, 0, 0));
        m.begin_nest(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_KIND, "veth");
        m.end_nest();
        let bytes = m.finish(7).to_vec();
        assert_eq!(bytes.len(), 16 + 16 + 4 + 12);
        assert_eq!(
            u32::from_ne_bytes(bytes[0..4].try_into().unwrap()) as usize,
            bytes.len()
        );
        let body = &bytes[32..];
        let (ty, inner) = attrs(body).next().unwrap();
        assert_eq!(ty, IFLA_LINKINFO);
        let (kty, kind) = attrs(inner).next().unwrap();
        assert_eq!(kty, IFLA_INFO_KIND);
        assert_eq!(cstr(kind), "veth");
    }

    #[test]
    fn attrs_stop_on_garbage() {
        assert_eq!(attrs(&[0xff, 0xff, 0, 0]).count(), 0);
        assert_eq!(attrs(&[1, 0]).count(), 0);
    }
}
