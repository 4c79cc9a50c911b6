//! A 256 MiB upload and download through the router to a real envd, with the test
//! process's memory (client + router) sampled: bodies must stream, not accumulate.
//! Alone in its own test binary so that no other test skews the RSS measurement.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use common::*;
use cubicle_router::RouterConfig;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;

const TOTAL: usize = 256 << 20;
const CHUNK: usize = 64 << 10;
/// The router may hold a few socket buffers' worth, never the file.
const MAX_GROWTH: u64 = 48 << 20;

fn pattern() -> Bytes {
    Bytes::from((0..CHUNK).map(|i| (i % 251) as u8).collect::<Vec<_>>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_and_download_256_mib_with_bounded_memory() {
    let envd = Envd::start("tok-big");
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbbig",
        &envd.socket,
        std::process::id(),
        Some(&envd.token),
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let path = envd.files_dir().join("big.bin");
    let url = format!(
        "/files?path={}",
        percent_encoding::utf8_percent_encode(
            path.to_str().unwrap(),
            percent_encoding::NON_ALPHANUMERIC
        )
    );
    let r = route("sbbig", 49983);

    // Warm up the router and allocator, then take the baseline.
    let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 204);
    let baseline = rss_bytes();
    let sampler = RssSampler::start();

    // Upload: chunked, generated on the fly (each chunk is a refcount of one buffer).
    let chunk = pattern();
    let stream = futures_util::stream::iter(
        std::iter::repeat_n(chunk.clone(), TOTAL / CHUNK)
            .map(|b| Ok::<_, std::io::Error>(Frame::data(b))),
    );
    let mut h = hdrs(&r);
    h.extend([
        ("X-Access-Token", envd.token.as_str()),
        ("Content-Type", "application/octet-stream"),
    ]);
    let t0 = Instant::now();
    let resp = send(
        addr,
        request("POST", &url, &h, BodyExt::boxed(StreamBody::new(stream))),
    )
    .await;
    assert_eq!(resp.status(), 200, "{}", body_text(resp).await);
    let _ = body_bytes(resp).await;
    let up = t0.elapsed();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), TOTAL as u64);

    // Download: count and check every byte as it streams.
    let h = [
        ("X-Access-Token", envd.token.as_str()),
        (r[0].0.as_str(), r[0].1.as_str()),
        (r[1].0.as_str(), r[1].1.as_str()),
    ];
    let t0 = Instant::now();
    let resp = send(addr, request("GET", &url, &h, empty())).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut offset = 0usize;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            for (i, b) in data.iter().enumerate() {
                let o = offset + i;
                if *b != ((o % CHUNK) % 251) as u8 {
                    panic!("byte {o} differs");
                }
            }
            offset += data.len();
        }
    }
    let down = t0.elapsed();
    assert_eq!(offset, TOTAL);

    let peak = sampler.stop();
    let growth = peak.saturating_sub(baseline);
    eprintln!(
        "256 MiB upload {:.2}s ({:.0} MiB/s), download {:.2}s ({:.0} MiB/s); RSS baseline {} MiB, peak {} MiB, growth {} MiB",
        up.as_secs_f64(),
        256.0 / up.as_secs_f64(),
        down.as_secs_f64(),
        256.0 / down.as_secs_f64(),
        baseline >> 20,
        peak >> 20,
        growth >> 20
    );
    assert!(
        growth < MAX_GROWTH,
        "memory grew by {} MiB while streaming 256 MiB",
        growth >> 20
    );
    let _ = std::fs::remove_file(&path);
}
