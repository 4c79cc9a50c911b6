//! The web dashboard: static files embedded in the binary (`crates/api/dashboard/`),
//! served at `/dashboard/` without a key. The page asks for an API key and then talks
//! to this same server as any client does: the REST API with `X-API-KEY` (sandboxes,
//! logs, metrics, templates, keys, the operator's view of [`crate::operator`]) and
//! envd's Connect API through the data plane (`E2b-Sandbox-Id`, `X-Access-Token`) for
//! its terminal. Nothing here reads or grants anything by itself.
//!
//! The page is plain ES modules (`app.js`); the terminal is xterm.js, vendored from npm
//! by `scripts/build-dashboard.sh` into `dashboard/vendor/` and committed, so a build
//! needs neither Node.js nor the network.

use std::sync::Arc;

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

use crate::error::ApiError;
use crate::service::ControlPlane;

/// Where the dashboard lives.
pub const PREFIX: &str = "/dashboard/";

/// One embedded file.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

macro_rules! asset {
    ($path:literal, $ct:literal) => {
        Asset {
            path: $path,
            content_type: $ct,
            body: include_bytes!(concat!("../dashboard/", $path)),
        }
    };
}

const ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("app.js", "text/javascript; charset=utf-8"),
    asset!("connect.js", "text/javascript; charset=utf-8"),
    asset!("chart.js", "text/javascript; charset=utf-8"),
    asset!("app.css", "text/css; charset=utf-8"),
    asset!("vendor/xterm.mjs", "text/javascript; charset=utf-8"),
    asset!("vendor/addon-fit.mjs", "text/javascript; charset=utf-8"),
    asset!("vendor/xterm.css", "text/css; charset=utf-8"),
    asset!("vendor/LICENSES.txt", "text/plain; charset=utf-8"),
];

/// The page may load only its own files and talk only to this server; xterm.js styles
/// its rows inline.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
                   img-src 'self' data:; font-src 'self'; connect-src 'self'; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `/`, `/dashboard` and `/dashboard/…` (no key needed: the files hold no data).
pub fn routes() -> Router<Arc<ControlPlane>> {
    Router::new()
        .route("/", get(|| async { Redirect::to(PREFIX) }))
        .route("/dashboard", get(|| async { Redirect::to(PREFIX) }))
        .route("/dashboard/", get(|| async { serve("index.html") }))
        .route(
            "/dashboard/{*path}",
            get(|Path(path): Path<String>| async move { serve(&path) }),
        )
}

fn serve(path: &str) -> Response {
    let Some(a) = ASSETS.iter().find(|a| a.path == path) else {
        return ApiError::NotFound(format!("no such dashboard file: {path}")).into_response();
    };
    let mut resp = (StatusCode::OK, a.body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(a.content_type),
    );
    // Revalidate every time: a new binary serves new files under the same names.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_asset_is_embedded_and_typed() {
        for a in ASSETS {
            assert!(!a.body.is_empty(), "{} is empty", a.path);
            let r = serve(a.path);
            assert_eq!(r.status(), StatusCode::OK);
            assert_eq!(r.headers()[header::CONTENT_TYPE], a.content_type);
            assert!(r.headers().contains_key(header::CONTENT_SECURITY_POLICY));
        }
        assert_eq!(serve("../Cargo.toml").status(), StatusCode::NOT_FOUND);
        assert_eq!(serve("").status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn the_page_loads_only_embedded_files() {
        // Every module and stylesheet index.html and the modules name must be served.
        let mut names = Vec::new();
        for a in ASSETS
            .iter()
            .filter(|a| a.path.ends_with(".html") || a.path.ends_with(".js"))
        {
            let text = std::str::from_utf8(a.body).unwrap();
            for quote in ['"', '\''] {
                for part in text.split(quote) {
                    let is_local = part.starts_with("./") || part.starts_with("vendor/");
                    let ext = [".js", ".mjs", ".css"].iter().any(|e| part.ends_with(e));
                    if is_local && ext && !part.contains(' ') {
                        names.push(part.trim_start_matches("./").to_string());
                    }
                }
            }
        }
        assert!(names.iter().any(|n| n == "vendor/xterm.mjs"), "{names:?}");
        for n in names {
            assert!(
                ASSETS.iter().any(|a| a.path == n),
                "{n} is referenced but not embedded"
            );
        }
    }
}
