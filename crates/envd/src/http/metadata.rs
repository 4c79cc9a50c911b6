//! Upload metadata: `X-Metadata-<Key>: value` request headers become extended attributes
//! `user.e2b.<key>` (key lower-cased) on every uploaded file, replacing whatever
//! `user.e2b.*` attributes the file had; an upload without such headers clears them.
//!
//! Rules (upstream envd's): keys are HTTP token characters (the header name already
//! guarantees it), non-empty (an empty key is dropped), at most 246 bytes (so that
//! `user.e2b.<key>` fits the kernel's 255-byte attribute name limit); values printable
//! US-ASCII; keys and values together at most 4096 bytes; for a repeated header the first
//! value counts. Anything else is a 400 before a byte is written.
//!
//! Reading the metadata back is the filesystem module's job
//! ([`crate::filesystem::read_metadata`]); here we only write, on the open file
//! descriptor (so a symlinked destination gets the attributes on its target).

use std::{
    collections::BTreeMap,
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

use axum::http::HeaderMap;

use super::HttpError;
use crate::filesystem::entry::METADATA_XATTR_PREFIX;

/// Header prefix of upload metadata (header names are lower-case in `HeaderMap`).
const HEADER_PREFIX: &str = "x-metadata-";
/// Longest key: 255 (kernel limit for attribute names) − `user.e2b.`.
pub(crate) const MAX_KEY_BYTES: usize = 255 - METADATA_XATTR_PREFIX.len();
/// Most bytes of keys and values together.
pub(crate) const MAX_TOTAL_BYTES: usize = 4096;

/// Metadata of one upload: key (lower-case, without prefix) → value.
pub(crate) type Metadata = BTreeMap<String, String>;

/// Reads and validates the `X-Metadata-*` headers.
pub(crate) fn from_headers(headers: &HeaderMap) -> Result<Metadata, HttpError> {
    let mut out = Metadata::new();
    let mut total = 0usize;
    for name in headers.keys() {
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        if key.is_empty() {
            continue;
        }
        let key = key.to_ascii_lowercase();
        if key.len() > MAX_KEY_BYTES {
            return Err(HttpError::bad_request(format!(
                "metadata key '{}…' is longer than {MAX_KEY_BYTES} bytes",
                &key[..32]
            )));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(HttpError::bad_request(format!(
                "metadata key '{key}' is not printable ASCII"
            )));
        }
        // The first value of a repeated header counts.
        let Some(value) = headers.get(name) else {
            continue;
        };
        let value = value.as_bytes();
        if !value.iter().all(|b| (0x20..=0x7e).contains(b)) {
            return Err(HttpError::bad_request(format!(
                "metadata value of '{key}' must be printable US-ASCII"
            )));
        }
        total += key.len() + value.len();
        if total > MAX_TOTAL_BYTES {
            return Err(HttpError::bad_request(format!(
                "metadata is larger than {MAX_TOTAL_BYTES} bytes in total"
            )));
        }
        out.insert(key, String::from_utf8_lossy(value).into_owned());
    }
    Ok(out)
}

/// Makes the file's `user.e2b.*` attributes exactly `metadata`.
///
/// A filesystem without extended attributes is fine when there is nothing to set.
pub(crate) fn apply(fd: BorrowedFd<'_>, metadata: &Metadata) -> io::Result<()> {
    let existing = match list(fd) {
        Ok(names) => names,
        Err(e) if is_unsupported(&e) && metadata.is_empty() => return Ok(()),
        Err(e) if is_unsupported(&e) => Vec::new(),
        Err(e) => return Err(e),
    };
    for name in existing {
        let Some(key) = name
            .to_str()
            .ok()
            .and_then(|n| n.strip_prefix(METADATA_XATTR_PREFIX))
        else {
            continue;
        };
        if metadata.contains_key(key) {
            continue;
        }
        // SAFETY: valid fd and NUL-terminated name.
        if unsafe { libc::fremovexattr(fd.as_raw_fd(), name.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(e);
            }
        }
    }
    for (key, value) in metadata {
        let name = CString::new(format!("{METADATA_XATTR_PREFIX}{key}"))
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in metadata key"))?;
        // SAFETY: valid fd, NUL-terminated name, value valid for value.len() bytes.
        let rc = unsafe {
            libc::fsetxattr(
                fd.as_raw_fd(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn is_unsupported(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOTSUP) || e.raw_os_error() == Some(libc::EOPNOTSUPP)
}

/// `flistxattr(2)`: the attribute names of an open file.
fn list(fd: BorrowedFd<'_>) -> io::Result<Vec<CString>> {
    let mut size = 1024usize;
    loop {
        let mut buf = vec![0u8; size];
        // SAFETY: buf is valid for buf.len() bytes.
        let got = unsafe { libc::flistxattr(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if got >= 0 {
            buf.truncate(got as usize);
            return Ok(buf
                .split(|b| *b == 0)
                .filter(|n| !n.is_empty())
                .filter_map(|n| CString::new(n).ok())
                .collect());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && size < (1 << 20) {
            size *= 4;
            continue;
        }
        return Err(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn parses_headers() {
        let mut h = HeaderMap::new();
        h.insert("x-metadata-Owner", HeaderValue::from_static("me"));
        h.append("x-metadata-owner", HeaderValue::from_static("second"));
        h.insert("x-metadata-", HeaderValue::from_static("dropped"));
        h.insert("x-access-token", HeaderValue::from_static("t"));
        h.insert("x-metadata-a.b_c", HeaderValue::from_static("v a l"));
        let m = from_headers(&h).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m["owner"], "me");
        assert_eq!(m["a.b_c"], "v a l");

        let mut h = HeaderMap::new();
        h.insert(
            "x-metadata-k",
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        assert_eq!(from_headers(&h).unwrap_err().status, 400);

        let mut h = HeaderMap::new();
        let long = format!("x-metadata-{}", "k".repeat(MAX_KEY_BYTES + 1));
        h.insert(
            axum::http::HeaderName::from_bytes(long.as_bytes()).unwrap(),
            HeaderValue::from_static("v"),
        );
        assert_eq!(from_headers(&h).unwrap_err().status, 400);
        let mut h = HeaderMap::new();
        let ok = format!("x-metadata-{}", "k".repeat(MAX_KEY_BYTES));
        h.insert(
            axum::http::HeaderName::from_bytes(ok.as_bytes()).unwrap(),
            HeaderValue::from_static("v"),
        );
        assert!(from_headers(&h).is_ok());

        let mut h = HeaderMap::new();
        for i in 0..3 {
            let name = format!("x-metadata-k{i}");
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(&"v".repeat(1500)).unwrap(),
            );
        }
        assert_eq!(from_headers(&h).unwrap_err().status, 400);
    }
}
