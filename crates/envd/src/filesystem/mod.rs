//! `filesystem.Filesystem`: stat, list, make, move, remove, and watch directories.
//!
//! Every RPC acts as the Basic-auth user (else the default user) and resolves paths
//! with [`crate::paths::resolve`] (`~`, relative paths, lexical `..` cleaning, NUL
//! refused). Errors follow shared/spec/e2b-compat.md §3.5: missing → `not_found`,
//! wrong kind → `invalid_argument`, existing directory on MakeDir → `already_exists`,
//! symlink loop on ListDir → `failed_precondition`.
//!
//! * [`entry`]: the `EntryInfo` builder and the `user.e2b.*` metadata reader (also used
//!   by the `/files` endpoints: [`entry_info`], [`read_metadata`]).
//! * [`ops`]: the unary operations.
//! * [`watch`]: inotify watches, the `WatchDir` stream and the polling watchers.

pub mod entry;
pub mod ops;
pub mod watch;

use std::{path::PathBuf, sync::Arc};

use axum::{
    Router, body::Body, extract::State, http::HeaderMap, response::Response, routing::post,
};
use cubicle_proto::filesystem::{
    CreateWatcherRequest, CreateWatcherResponse, GetWatcherEventsRequest, GetWatcherEventsResponse,
    ListDirRequest, ListDirResponse, MakeDirRequest, MakeDirResponse, MoveRequest, MoveResponse,
    RemoveRequest, RemoveResponse, RemoveWatcherRequest, RemoveWatcherResponse, StatRequest,
    StatResponse, WatchDirRequest,
};

pub use entry::{entry_info, read_metadata};

use crate::{
    auth,
    connect::{self, ConnectError},
    paths,
    server::AppState,
    state::Context,
    users::User,
};
use watch::{DirWatcher, WatchOptions, WatcherTable};

/// Filesystem RPCs and the table of polling watchers.
pub struct FilesystemService {
    ctx: Arc<Context>,
    watchers: WatcherTable,
}

impl FilesystemService {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self {
            ctx,
            watchers: WatcherTable::default(),
        }
    }

    /// Number of live polling watchers (CreateWatcher minus RemoveWatcher).
    pub fn polling_watchers(&self) -> usize {
        self.watchers.len()
    }

    fn user(&self, headers: &HeaderMap) -> Result<User, ConnectError> {
        auth::acting_user(&self.ctx, headers)
    }

    fn resolve(&self, user: &User, path: &str) -> Result<PathBuf, ConnectError> {
        paths::resolve(&self.ctx, user, path)
    }
}

/// Routes of `filesystem.Filesystem`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .route("/filesystem.Filesystem/WatchDir", post(watch_dir))
        .route("/filesystem.Filesystem/CreateWatcher", post(create_watcher))
        .route(
            "/filesystem.Filesystem/GetWatcherEvents",
            post(get_watcher_events),
        )
        .route("/filesystem.Filesystem/RemoveWatcher", post(remove_watcher))
}

/// Runs blocking filesystem work off the async workers.
async fn blocking<T, F>(f: F) -> Result<T, ConnectError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ConnectError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ConnectError::internal(format!("filesystem task failed: {e}")))?
}

async fn stat(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: StatRequest = connect::read_unary(body).await?;
            let user = fs.user(&headers)?;
            let path = fs.resolve(&user, &req.path)?;
            let entry = blocking(move || ops::stat(&path)).await?;
            Ok(StatResponse { entry: Some(entry) })
        }
        .await,
    )
}

async fn make_dir(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: MakeDirRequest = connect::read_unary(body).await?;
            let user = fs.user(&headers)?;
            let path = fs.resolve(&user, &req.path)?;
            let entry = blocking(move || ops::make_dir(&path, &user)).await?;
            Ok(MakeDirResponse { entry: Some(entry) })
        }
        .await,
    )
}

async fn move_entry(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: MoveRequest = connect::read_unary(body).await?;
            let user = fs.user(&headers)?;
            let source = ops::resolve_nonempty(&fs.ctx, &user, &req.source, "source")?;
            let destination =
                ops::resolve_nonempty(&fs.ctx, &user, &req.destination, "destination")?;
            let entry = blocking(move || ops::move_entry(&source, &destination, &user)).await?;
            Ok(MoveResponse { entry: Some(entry) })
        }
        .await,
    )
}

async fn list_dir(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: ListDirRequest = connect::read_unary(body).await?;
            let user = fs.user(&headers)?;
            let path = fs.resolve(&user, &req.path)?;
            let entries = blocking(move || ops::list_dir(&path, req.depth)).await?;
            Ok(ListDirResponse { entries })
        }
        .await,
    )
}

async fn remove(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: RemoveRequest = connect::read_unary(body).await?;
            let user = fs.user(&headers)?;
            let path = ops::resolve_nonempty(&fs.ctx, &user, &req.path, "remove")?;
            blocking(move || ops::remove(&path)).await?;
            Ok(RemoveResponse {})
        }
        .await,
    )
}

/// Validates and starts a watch (shared by WatchDir and CreateWatcher).
async fn start_watch(
    fs: &FilesystemService,
    headers: &HeaderMap,
    path: &str,
    opts: WatchOptions,
) -> Result<DirWatcher, ConnectError> {
    let user = fs.user(headers)?;
    let path = fs.resolve(&user, path)?;
    blocking(move || {
        watch::validate_watch_path(&path, opts.allow_network_mounts)?;
        DirWatcher::new(path, opts)
    })
    .await
}

async fn watch_dir(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let started = async {
        let req: WatchDirRequest = connect::read_stream_request(body).await?;
        let opts = WatchOptions {
            recursive: req.recursive,
            include_entry: req.include_entry,
            allow_network_mounts: req.allow_network_mounts,
        };
        start_watch(&state.filesystem, &headers, &req.path, opts).await
    }
    .await;
    match started {
        Ok(watcher) => connect::stream_response(watch::watch_stream(
            watcher,
            connect::keepalive_interval(&headers),
            connect::timeout(&headers),
        )),
        Err(e) => connect::stream_error(e),
    }
}

async fn create_watcher(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: CreateWatcherRequest = connect::read_unary(body).await?;
            let opts = WatchOptions {
                recursive: req.recursive,
                include_entry: req.include_entry,
                allow_network_mounts: req.allow_network_mounts,
            };
            let watcher = start_watch(fs, &headers, &req.path, opts).await?;
            let watcher_id = fs.watchers.insert(watcher)?;
            Ok(CreateWatcherResponse { watcher_id })
        }
        .await,
    )
}

async fn get_watcher_events(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: GetWatcherEventsRequest = connect::read_unary(body).await?;
            fs.user(&headers)?;
            let events = fs.watchers.events(&req.watcher_id)?;
            Ok(GetWatcherEventsResponse { events })
        }
        .await,
    )
}

async fn remove_watcher(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    connect::unary(
        async {
            let fs = &state.filesystem;
            let req: RemoveWatcherRequest = connect::read_unary(body).await?;
            fs.user(&headers)?;
            fs.watchers.remove(&req.watcher_id)?;
            Ok(RemoveWatcherResponse {})
        }
        .await,
    )
}

#[cfg(test)]
mod test_util {
    //! A temporary directory removed on drop (also when a test fails).

    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> Self {
            let p = std::env::temp_dir().join(format!(
                "cubicle-envd-{tag}-{}-{}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl std::ops::Deref for TempDir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
