//! The object store Cubicle nodes share templates, snapshots and paused sandboxes
//! through (issue 19, "moving state"): one bucket, named by a URL.
//!
//! - `s3://bucket/prefix`: any S3-compatible server. Endpoint, region and credentials
//!   come from the usual AWS environment variables (`AWS_ENDPOINT_URL`,
//!   `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//!   `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP`); an `http://` endpoint is allowed as such.
//! - `file:///path`: a local directory (one host, or a shared filesystem).
//!
//! Layout below the prefix:
//!
//! ```text
//! blobs/sha256/<hex>        content-addressed data (tar archives); written once,
//!                           never changed, verified against its name when read
//! <kind>/<name>.json        small manifests that name blobs (templates/, snapshots/,
//!                           paused/); a manifest is written after every blob it names
//! ```
//!
//! So a reader that finds a manifest finds its blobs, a blob that is there is complete
//! (S3 puts and the local store's renames are atomic), pushing twice uploads nothing
//! new, and a corrupted or truncated blob is refused on download before anyone unpacks
//! it ([`Error::Corrupt`]).

use std::path::Path;
use std::sync::Arc;

use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What went wrong with the object store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bucket URL is not one this understands.
    #[error("object store URL '{url}': {message}")]
    BadUrl { url: String, message: String },
    /// The store refused or failed a request.
    #[error("object store {url}: {op} {key}: {source}")]
    Store {
        url: String,
        op: &'static str,
        key: String,
        #[source]
        source: Box<object_store::Error>,
    },
    /// A key that is not there.
    #[error("object store {url}: {op} {key}: no such object")]
    NotFound {
        url: String,
        op: &'static str,
        key: String,
    },
    /// A blob whose content does not match its digest (damaged in the store or on the
    /// way): nothing was installed from it.
    #[error(
        "object store {url}: blob {key} is corrupt (its content hashes to sha256:{actual}); nothing was installed from it — push it again from a node that has it"
    )]
    Corrupt {
        url: String,
        key: String,
        actual: String,
    },
    /// A manifest that does not parse.
    #[error("object store {url}: manifest {key} is not valid: {message}")]
    BadManifest {
        url: String,
        key: String,
        message: String,
    },
    /// A local file could not be read or written.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error + use<> {
    let path = path.display().to_string();
    move |source| Error::Io { op, path, source }
}

/// One bucket (and prefix) of an object store.
#[derive(Clone)]
pub struct Bucket {
    store: Arc<dyn ObjectStore>,
    prefix: Option<ObjPath>,
    url: String,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket").field("url", &self.url).finish()
    }
}

/// Longest one request to the store may take.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Bytes per part of a multipart upload.
const PART_BYTES: usize = 16 << 20;

/// Whether `digest` is a SHA-256 in lowercase hex.
pub fn valid_digest(digest: &str) -> bool {
    digest.len() == 64
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Bucket {
    /// The bucket `url` names (`s3://bucket[/prefix]` or `file:///dir`; the directory is
    /// created).
    pub fn open(url: &str) -> Result<Bucket> {
        let bad = |m: &str| Error::BadUrl {
            url: url.to_string(),
            message: m.to_string(),
        };
        if let Some(rest) = url.strip_prefix("file://") {
            if !rest.starts_with('/') {
                return Err(bad("a file:// URL needs an absolute path (file:///dir)"));
            }
            let dir = Path::new(rest);
            std::fs::create_dir_all(dir).map_err(io_err("mkdir", dir))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .map_err(|e| bad(&e.to_string()))?
                .with_automatic_cleanup(true);
            return Ok(Bucket {
                store: Arc::new(store),
                prefix: None,
                url: url.to_string(),
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = match rest.split_once('/') {
                Some((b, p)) => (b, p.trim_matches('/')),
                None => (rest, ""),
            };
            if bucket.is_empty() {
                return Err(bad("no bucket name (s3://bucket/prefix)"));
            }
            // reqwest's TLS needs a process-wide provider; ours is ring (as everywhere).
            let _ = rustls::crypto::ring::default_provider().install_default();
            // Completing a large multipart upload can take the server a while (it
            // assembles the parts): allow it rather than retry into a vanished upload.
            let options = object_store::ClientOptions::new().with_timeout(REQUEST_TIMEOUT);
            let mut b = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_client_options(options);
            let endpoint = std::env::var("AWS_ENDPOINT_URL_S3")
                .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
                .or_else(|_| std::env::var("AWS_ENDPOINT"))
                .unwrap_or_default();
            if endpoint.starts_with("http://") {
                b = b.with_allow_http(true);
            }
            if !endpoint.is_empty() {
                b = b.with_endpoint(endpoint);
            }
            let store = b.build().map_err(|e| bad(&e.to_string()))?;
            return Ok(Bucket {
                store: Arc::new(store),
                prefix: (!prefix.is_empty()).then(|| ObjPath::from(prefix)),
                url: url.to_string(),
            });
        }
        Err(bad("use s3://bucket/prefix or file:///dir"))
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn key(&self, key: &str) -> ObjPath {
        match &self.prefix {
            Some(p) => ObjPath::from(format!("{p}/{key}")),
            None => ObjPath::from(key),
        }
    }

    fn store_err(&self, op: &'static str, key: &str) -> impl FnOnce(object_store::Error) -> Error {
        let (url, key) = (self.url.clone(), key.to_string());
        move |source| match source {
            object_store::Error::NotFound { .. } => Error::NotFound { url, op, key },
            source => Error::Store {
                url,
                op,
                key,
                source: Box::new(source),
            },
        }
    }

    /// The key of blob `digest`.
    pub fn blob_key(digest: &str) -> String {
        format!("blobs/sha256/{digest}")
    }

    /// Whether `key` exists.
    pub async fn exists(&self, key: &str) -> Result<bool> {
        match self.store.head(&self.key(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.store_err("head", key)(e)),
        }
    }

    /// Stores `value` as JSON at `key` (replacing what is there).
    pub async fn put_json<T: Serialize>(&self, key: &str, value: &T) -> Result<()> {
        let body = serde_json::to_vec_pretty(value).map_err(|e| Error::BadManifest {
            url: self.url.clone(),
            key: key.to_string(),
            message: e.to_string(),
        })?;
        self.store
            .put(&self.key(key), PutPayload::from(body))
            .await
            .map_err(self.store_err("put", key))?;
        Ok(())
    }

    /// The JSON at `key`, or `None` when there is none.
    pub async fn get_json<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        let got = match self.store.get(&self.key(key)).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.store_err("get", key)(e)),
        };
        let bytes = got.bytes().await.map_err(self.store_err("get", key))?;
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::BadManifest {
                url: self.url.clone(),
                key: key.to_string(),
                message: e.to_string(),
            })
    }

    /// Deletes `key` (idempotent).
    pub async fn delete(&self, key: &str) -> Result<()> {
        match self.store.delete(&self.key(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.store_err("delete", key)(e)),
        }
    }

    /// Stores the file `path` as the blob `digest` (its SHA-256, which the caller
    /// computed while writing it) unless that blob is there already. Returns whether it
    /// uploaded.
    pub async fn put_blob(&self, digest: &str, path: &Path) -> Result<bool> {
        let key = Self::blob_key(digest);
        if self.exists(&key).await? {
            return Ok(false);
        }
        let mut f = tokio::fs::File::open(path)
            .await
            .map_err(io_err("open", path))?;
        let upload = self
            .store
            .put_multipart(&self.key(&key))
            .await
            .map_err(self.store_err("put", &key))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut buf = vec![0u8; 1 << 20];
        let mut hash = Sha256::new();
        loop {
            let n = match f.read(&mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(io_err("read", path)(e));
                }
            };
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            if let Err(e) = w.wait_for_capacity(4).await {
                return Err(self.store_err("put", &key)(e));
            }
            w.write(&buf[..n]);
        }
        let actual = hex(&hash.finalize());
        if actual != digest {
            // The file changed since its digest was taken: never store it under a name
            // that does not say what it holds.
            let _ = w.abort().await;
            return Err(Error::Corrupt {
                url: self.url.clone(),
                key,
                actual,
            });
        }
        if let Err(e) = w.finish().await {
            // A completion retried after a slow first answer finds the upload gone
            // although the object is complete: what counts is that the blob is there
            // (its content is what the digest says: nobody writes other content there).
            if self.exists(&key).await? {
                tracing::debug!(%key, "upload completion reported {e}, but the blob is there");
                return Ok(true);
            }
            return Err(self.store_err("put", &key)(e));
        }
        Ok(true)
    }

    /// Downloads blob `digest` into the new file `dest`, checking its content against
    /// the digest; on any error `dest` is removed. Returns its size.
    pub async fn get_blob(&self, digest: &str, dest: &Path) -> Result<u64> {
        let key = Self::blob_key(digest);
        if !valid_digest(digest) {
            return Err(Error::BadManifest {
                url: self.url.clone(),
                key,
                message: "a blob digest is not 64 hex digits".into(),
            });
        }
        let res = self.download(&key, digest, dest).await;
        if res.is_err() {
            let _ = tokio::fs::remove_file(dest).await;
        }
        res
    }

    async fn download(&self, key: &str, digest: &str, dest: &Path) -> Result<u64> {
        let got = self
            .store
            .get(&self.key(key))
            .await
            .map_err(self.store_err("get", key))?;
        let mut f = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)
            .await
            .map_err(io_err("create", dest))?;
        let mut hash = Sha256::new();
        let mut n = 0u64;
        let mut stream = got.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.store_err("get", key))?;
            hash.update(&chunk);
            n += chunk.len() as u64;
            f.write_all(&chunk).await.map_err(io_err("write", dest))?;
        }
        f.flush().await.map_err(io_err("write", dest))?;
        let actual = hex(&hash.finalize());
        if actual != digest {
            return Err(Error::Corrupt {
                url: self.url.clone(),
                key: key.to_string(),
                actual,
            });
        }
        Ok(n)
    }

    /// Overwrites the object at `key` with `bytes` (tests: damaging a blob on purpose).
    pub async fn put_raw(&self, key: &str, bytes: Vec<u8>) -> Result<()> {
        self.store
            .put(&self.key(key), PutPayload::from(bytes))
            .await
            .map_err(self.store_err("put", key))?;
        Ok(())
    }
}

/// A file being written whose SHA-256 is computed on the way (what [`Bucket::put_blob`]
/// wants).
pub struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: std::io::Write> HashingWriter<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }

    /// The digest and size of what was written, and the inner writer.
    pub fn finish(self) -> (String, u64, W) {
        (hex(&self.hash.finalize()), self.bytes, self.inner)
    }
}

impl<W: std::io::Write> std::io::Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn file_bucket_round_trip_and_corruption() -> anyhow_free::R {
        let dir = tempfile::tempdir()?;
        let url = format!("file://{}", dir.path().join("bucket").display());
        let b = Bucket::open(&url)?;
        let src = dir.path().join("blob");
        std::fs::write(&src, b"hello blob")?;
        let digest = hex(&Sha256::digest(b"hello blob"));
        assert!(b.put_blob(&digest, &src).await?, "first push uploads");
        assert!(!b.put_blob(&digest, &src).await?, "second push is a no-op");
        let out = dir.path().join("out");
        assert_eq!(b.get_blob(&digest, &out).await?, 10);
        assert_eq!(std::fs::read(&out)?, b"hello blob");
        // A wrong digest for a file is refused at upload.
        let wrong = "0".repeat(64);
        assert!(matches!(
            b.put_blob(&wrong, &src).await,
            Err(Error::Corrupt { .. })
        ));
        assert!(!b.exists(&Bucket::blob_key(&wrong)).await?);
        // A damaged blob is refused at download and leaves no file.
        b.put_raw(&Bucket::blob_key(&digest), b"hello blub".to_vec())
            .await?;
        let out2 = dir.path().join("out2");
        assert!(matches!(
            b.get_blob(&digest, &out2).await,
            Err(Error::Corrupt { .. })
        ));
        assert!(!out2.exists());
        // Manifests.
        b.put_json("templates/x.json", &vec![1, 2, 3]).await?;
        let v: Option<Vec<i32>> = b.get_json("templates/x.json").await?;
        assert_eq!(v, Some(vec![1, 2, 3]));
        let none: Option<Vec<i32>> = b.get_json("templates/y.json").await?;
        assert!(none.is_none());
        Ok(())
    }

    #[test]
    fn urls() {
        assert!(Bucket::open("http://x").is_err());
        assert!(Bucket::open("file://relative").is_err());
        assert!(Bucket::open("s3://").is_err());
    }

    mod anyhow_free {
        pub type R = std::result::Result<(), Box<dyn std::error::Error>>;
    }
}
