//! The part of CRIU's RPC protocol (`criu swrk`) Cubicle speaks: requests and answers as
//! protobuf messages, one per `SOCK_SEQPACKET` packet, over the socket CRIU inherits.
//!
//! Only the fields Cubicle sets or reads are declared; the numbers are those of CRIU's
//! `images/rpc.proto` (proto2), which is the wire contract. A dump or restore is one
//! request; during a restore CRIU sends a `NOTIFY` answer at each stage (with
//! `notify_scripts`) and waits for a `NOTIFY` request saying whether to go on.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use prost::Message;

/// `criu_req_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum ReqType {
    Empty = 0,
    Dump = 1,
    Restore = 2,
    Check = 3,
    Notify = 6,
    Version = 10,
}

/// `criu_cg_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum CgMode {
    Ignore = 0,
    None = 1,
    Props = 2,
    Soft = 3,
    Full = 4,
    Strict = 5,
    Default = 6,
}

/// `criu_network_lock_method`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum NetworkLock {
    Iptables = 1,
    Nftables = 2,
    Skip = 3,
}

/// `inherit_fd`: a descriptor CRIU got from its parent stands for `key`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InheritFd {
    #[prost(string, required, tag = "1")]
    pub key: String,
    #[prost(int32, required, tag = "2")]
    pub fd: i32,
}

/// `cgroup_root`: where the dumped root cgroup of controller `ctrl` goes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CgroupRoot {
    #[prost(string, optional, tag = "1")]
    pub ctrl: Option<String>,
    #[prost(string, required, tag = "2")]
    pub path: String,
}

/// `criu_opts` (subset).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Opts {
    #[prost(int32, required, tag = "1")]
    pub images_dir_fd: i32,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    #[prost(bool, optional, tag = "3")]
    pub leave_running: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    pub tcp_established: Option<bool>,
    #[prost(bool, optional, tag = "8")]
    pub file_locks: Option<bool>,
    #[prost(int32, optional, tag = "9")]
    pub log_level: Option<i32>,
    #[prost(string, optional, tag = "10")]
    pub log_file: Option<String>,
    #[prost(bool, optional, tag = "12")]
    pub notify_scripts: Option<bool>,
    #[prost(string, optional, tag = "13")]
    pub root: Option<String>,
    #[prost(int32, optional, tag = "17")]
    pub work_dir_fd: Option<i32>,
    #[prost(message, repeated, tag = "25")]
    pub cg_root: Vec<CgroupRoot>,
    #[prost(bool, optional, tag = "26")]
    pub rst_sibling: Option<bool>,
    #[prost(message, repeated, tag = "27")]
    pub inherit_fd: Vec<InheritFd>,
    #[prost(enumeration = "CgMode", optional, tag = "34")]
    pub manage_cgroups_mode: Option<i32>,
    #[prost(string, repeated, tag = "37")]
    pub external: Vec<String>,
    #[prost(uint32, optional, tag = "38")]
    pub empty_ns: Option<u32>,
    #[prost(string, repeated, tag = "43")]
    pub cgroup_dump_controller: Vec<String>,
    #[prost(string, optional, tag = "44")]
    pub freeze_cgroup: Option<String>,
    #[prost(uint32, optional, tag = "45")]
    pub timeout: Option<u32>,
    #[prost(bool, optional, tag = "50")]
    pub orphan_pts_master: Option<bool>,
    #[prost(string, optional, tag = "60")]
    pub cgroup_yard: Option<String>,
    #[prost(enumeration = "NetworkLock", optional, tag = "64")]
    pub network_lock: Option<i32>,
    /// Used when `images_dir_fd` is -1. (An fd would be looked up in the *client's*
    /// descriptor table, through `/proc/<client>/fd`, i.e. in the client's mount
    /// namespace — not the private one CRIU runs in.)
    #[prost(string, optional, tag = "68")]
    pub images_dir: Option<String>,
}

/// `criu_req`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Req {
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    #[prost(message, optional, tag = "2")]
    pub opts: Option<Opts>,
    #[prost(bool, optional, tag = "3")]
    pub notify_success: Option<bool>,
}

/// `criu_restore_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreResp {
    #[prost(int32, required, tag = "1")]
    pub pid: i32,
}

/// `criu_notify`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Notify {
    #[prost(string, optional, tag = "1")]
    pub script: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
}

/// `criu_version`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Version {
    #[prost(int32, required, tag = "1")]
    pub major_number: i32,
    #[prost(int32, required, tag = "2")]
    pub minor_number: i32,
    #[prost(int32, optional, tag = "4")]
    pub sublevel: Option<i32>,
}

/// `criu_resp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resp {
    #[prost(enumeration = "ReqType", required, tag = "1")]
    pub r#type: i32,
    #[prost(bool, required, tag = "2")]
    pub success: bool,
    #[prost(message, optional, tag = "4")]
    pub restore: Option<RestoreResp>,
    #[prost(message, optional, tag = "5")]
    pub notify: Option<Notify>,
    #[prost(int32, optional, tag = "7")]
    pub cr_errno: Option<i32>,
    #[prost(string, optional, tag = "9")]
    pub cr_errmsg: Option<String>,
    #[prost(message, optional, tag = "10")]
    pub version: Option<Version>,
}

/// Largest answer CRIU sends (it has no large fields in what Cubicle asks for).
const MAX_PACKET: usize = 64 << 10;

/// Sends one request packet.
pub fn send(sock: &OwnedFd, req: &Req) -> io::Result<()> {
    let buf = req.encode_to_vec();
    // SAFETY: valid socket and buffer for the duration of the call.
    let n = unsafe {
        libc::send(
            sock.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one answer packet; `UnexpectedEof` when CRIU closed the socket (it exited).
pub fn recv(sock: &OwnedFd) -> io::Result<Resp> {
    let mut buf = vec![0u8; MAX_PACKET];
    let n = loop {
        // SAFETY: valid socket and buffer.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break n as usize;
    };
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "criu closed its RPC socket",
        ));
    }
    Resp::decode(&buf[..n]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_encodes_required_fields() {
        let req = Req {
            r#type: ReqType::Dump as i32,
            opts: Some(Opts {
                images_dir_fd: 5,
                pid: Some(42),
                external: vec!["mnt[/dev]:/dev".into()],
                ..Default::default()
            }),
            notify_success: None,
        };
        let bytes = req.encode_to_vec();
        // type = 1 (varint 1), opts = 2 (length-delimited) containing images_dir_fd = 1.
        assert_eq!(&bytes[..2], &[0x08, 0x01]);
        assert_eq!(bytes[2], 0x12);
        let back = Req::decode(bytes.as_slice()).unwrap();
        assert_eq!(back, req);
    }

    #[test]
    fn answers_decode() {
        let resp = Resp {
            r#type: ReqType::Restore as i32,
            success: true,
            restore: Some(RestoreResp { pid: 1234 }),
            notify: None,
            cr_errno: None,
            cr_errmsg: None,
            version: None,
        };
        let back = Resp::decode(resp.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back.restore.unwrap().pid, 1234);
    }
}
