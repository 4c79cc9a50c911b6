//! Issue 10, item 5: neighbour-table pollution. Sandboxes kept CAP_NET_RAW, and ARP
//! requests with forged sender addresses created 64 host neighbour entries in a second
//! (past `gc_thresh3` the whole host gets "neighbour table overflow"). Tries, as root and
//! as `user`: packet sockets (raw and cooked, ARP), raw IP sockets, `IP_TRANSPARENT`; and
//! checks that `ping` still works. Then — as if a sandbox found another way to emit
//! frames — the host itself sends 64 forged ARP requests from the sandbox's side of its
//! veth, and the host's neighbour table must not learn a single sender.
//!
//! Contained by: no CAP_NET_RAW in the bounding set (`capabilities.rs`; `ping` uses ICMP
//! echo sockets through the sandbox's `net.ipv4.ping_group_range`, and templates lose
//! file capabilities a sandbox cannot hold), and the host side of every veth runs
//! without ARP with permanent neighbour entries for both ends (`network/mod.rs`).
//! Shown to fail with NET_RAW kept (`packet_raw` succeeded) and with ARP on the host
//! side (64 neighbour entries appeared).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cubicle_node::CreateRequest;
use cubicle_runtime::network::{Netns, run_in_netns};

use crate::common;
use crate::kit::*;

pub const ATTACK: Attack = Attack {
    name: "net_raw",
    about: "raw/packet sockets and forged ARP filling the host's neighbour table; no NET_RAW, NOARP veths",
    run: |c| Box::pin(run(c)),
};

const PROGRAM: &str = r#"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
int main(void) {
    TRY("packet_raw", socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)));
    TRY("packet_dgram_arp", socket(AF_PACKET, SOCK_DGRAM, htons(ETH_P_ARP)));
    TRY("inet_raw_icmp", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    TRY("inet_raw_raw", socket(AF_INET, SOCK_RAW, IPPROTO_RAW));
    TRY("inet6_raw", socket(AF_INET6, SOCK_RAW, IPPROTO_ICMPV6));
    int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    TRY("ip_transparent", setsockopt(s, SOL_IP, 19 /* IP_TRANSPARENT */, &one, sizeof one));
    TRY("icmp_echo_socket", socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP));
    return 0;
}
"#;

async fn run(ctx: Arc<Ctx>) -> TestResult {
    let sb = ctx
        .sandbox_with(CreateRequest {
            internet: true,
            ..common::base()
        })
        .await?;
    for who in [As::Root, As::User] {
        let at = |e: anyhow::Error| anyhow::anyhow!("as {who:?}: {e}");
        let out = sb.c(who, "net_raw", PROGRAM, &[]).await?;
        for name in [
            "packet_raw",
            "packet_dgram_arp",
            "inet_raw_icmp",
            "inet_raw_raw",
            "inet6_raw",
            "ip_transparent",
        ] {
            out.expect_errno(name, &[EPERM]).map_err(at)?;
        }
        out.expect_ok("icmp_echo_socket").map_err(at)?;
        let o = sb
            .sh(
                who,
                "ping -c 1 -W 2 127.0.0.1 >/dev/null && echo ping-ok; grep CapBnd /proc/self/status",
            )
            .await?;
        anyhow::ensure!(
            o.out.contains("ping-ok"),
            "as {who:?}: ping does not work: {}",
            o.all()
        );
        let bnd = o
            .field("CapBnd:\t")
            .or_else(|| o.out.lines().find_map(|l| l.strip_prefix("CapBnd:")))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .ok_or_else(|| anyhow::anyhow!("no CapBnd: {}", o.all()))?;
        anyhow::ensure!(
            bnd & (1 << 13) == 0,
            "as {who:?}: CAP_NET_RAW is in the bounding set ({bnd:x})"
        );
    }
    // Forged ARP from the sandbox's side of the veth, sent by the host.
    let pid = sb
        .info
        .pid
        .ok_or_else(|| anyhow::anyhow!("no pid for {}", sb.id()))?;
    let ifname = format!("cbs{}", common::slot_of(sb.info.uid_base));
    let before = learned(&ifname)?;
    let ns = Netns::from_pid(pid)?;
    let sent = run_in_netns(&ns, || forge_arp(64))??;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let after = learned(&ifname)?;
    println!("  forged {sent} ARP requests; {ifname} neighbours: {before:?} -> {after:?}");
    anyhow::ensure!(sent == 64, "only {sent} forged frames were sent");
    anyhow::ensure!(
        after.len() <= before.len(),
        "the host learned forged neighbours on {ifname}: {after:?}"
    );
    sb.kill().await
}

/// Non-permanent neighbour entries of the host on `ifname`.
fn learned(ifname: &str) -> anyhow::Result<Vec<String>> {
    let o = std::process::Command::new("ip")
        .args(["-4", "neigh", "show", "dev", ifname])
        .output()?;
    Ok(String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| !l.contains("PERMANENT"))
        .map(str::to_string)
        .collect())
}

/// Sends `n` ARP requests "who has <gateway>? tell 10.77.x.y" with distinct forged sender
/// addresses out of `eth0` of the calling thread's network namespace. Returns how many
/// went out.
fn forge_arp(n: u16) -> anyhow::Result<u16> {
    // SAFETY: plain socket(2); the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            (libc::ETH_P_ARP as u16).to_be() as i32,
        )
    };
    anyhow::ensure!(
        fd >= 0,
        "packet socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: fresh descriptor.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: valid C string.
    let ifindex = unsafe { libc::if_nametoindex(c"eth0".as_ptr()) };
    anyhow::ensure!(ifindex != 0, "no eth0 in the sandbox");
    let route = std::fs::read_to_string("/proc/thread-self/net/route")?;
    // The gateway of the default route (little-endian hex; this thread's namespace).
    let gw = route
        .lines()
        .skip(1)
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[1] == "00000000")
                .then(|| u32::from_str_radix(f[2], 16).ok())
                .flatten()
        })
        .ok_or_else(|| anyhow::anyhow!("no default route in the sandbox"))?
        .to_le_bytes();
    let mut sent = 0;
    for i in 0..n {
        let mut f = Vec::with_capacity(42);
        f.extend_from_slice(&[0xff; 6]); // broadcast
        f.extend_from_slice(&[0x02, 0xee, 0, 0, (i >> 8) as u8, i as u8]); // forged source MAC
        f.extend_from_slice(&[0x08, 0x06]); // ARP
        f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]); // Ethernet/IPv4, request
        f.extend_from_slice(&[0x02, 0xee, 0, 0, (i >> 8) as u8, i as u8]); // sender MAC
        f.extend_from_slice(&[10, 77, (i >> 8) as u8, i as u8]); // forged sender IP
        f.extend_from_slice(&[0; 6]); // target MAC
        f.extend_from_slice(&gw); // target IP: the host side
        // SAFETY: a zeroed sockaddr_ll is valid; fields set below.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = (libc::ETH_P_ARP as u16).to_be();
        addr.sll_ifindex = ifindex as i32;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        // SAFETY: valid socket, buffer and address of the given length.
        let r = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                f.as_ptr().cast(),
                f.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if r == f.len() as isize {
            sent += 1;
        }
    }
    Ok(sent)
}
