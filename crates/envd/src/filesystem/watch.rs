//! Directory watches on inotify: the `WatchDir` stream and the polling watchers
//! (`CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`) of the sync Python SDK.
//!
//! Every watch owns one inotify instance; dropping the [`DirWatcher`] closes it. A
//! `WatchDir` response body owns its watcher directly (no background task), so a client
//! that goes away frees the instance as soon as hyper drops the body.
//!
//! Event mapping (the semantics of upstream envd, which uses fsnotify):
//!
//! | inotify                     | event            |
//! |-----------------------------|------------------|
//! | `IN_CREATE`, `IN_MOVED_TO`  | `CREATE`         |
//! | `IN_MOVED_FROM`             | `RENAME` (old name; the new name gets `CREATE`) |
//! | `IN_ATTRIB`                 | `CHMOD`          |
//! | `IN_MODIFY`                 | `WRITE` (not `IN_CLOSE_WRITE`: no duplicates) |
//! | `IN_DELETE`                 | `REMOVE`         |
//!
//! One inotify event with several of these bits gives one event per bit, in the order
//! CREATE, RENAME, CHMOD, WRITE, REMOVE. `name` is relative to the watched directory.
//! Events about the watched directory itself (`IN_DELETE_SELF` → REMOVE, `IN_MOVE_SELF`
//! → RENAME, `IN_ATTRIB` → CHMOD) are named `.`; the same self-events of watched
//! subdirectories are dropped because their parent already reports them.
//!
//! Recursive watches add a watch for every subdirectory (never following symlinks) and
//! for every directory created or moved in later. A newly *created* directory is scanned
//! right after its watch is added and a CREATE is emitted for everything already in it,
//! so `mkdir -p a/b/c` is reported completely (at the price of a possible duplicate
//! CREATE when a child appears between the watch and the scan). A directory moved out of
//! the tree has its watches removed.
//!
//! With `includeEntry`, CREATE/WRITE/CHMOD events carry the entry's `EntryInfo` when it
//! still exists.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    ffi::OsString,
    io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use cubicle_proto::filesystem::{
    EventType, FilesystemEvent, WatchDirResponse,
    watch_dir_response::{Event as WatchEvent, KeepAlive, StartEvent},
};
use futures_util::{Stream, StreamExt};
use inotify::{EventMask, EventStream, Inotify, WatchDescriptor, WatchMask, Watches};

use super::entry::EntryBuilder;
use crate::connect::{Code, ConnectError};

/// Events a polling watcher keeps between two polls; older ones are dropped beyond it.
pub const MAX_BUFFERED_EVENTS: usize = 10_000;
/// Polling watchers that may exist at once.
pub const MAX_POLLING_WATCHERS: usize = 128;
/// Watches (directories) one recursive watcher may hold.
pub const MAX_WATCHES_PER_WATCHER: usize = 100_000;

/// Filesystem magic numbers (linux/magic.h) of network filesystems and FUSE, which
/// upstream refuses to watch unless `allowNetworkMounts` (events there are unreliable).
const NETWORK_FS_MAGICS: &[i64] = &[
    0x6969,      // NFS
    0xFF53_4D42, // CIFS
    0x517B,      // SMB
    0xFE53_4D42, // SMB2
    0x6573_5546, // FUSE (sshfs, s3fs, …)
];

/// What the client asked to watch.
#[derive(Debug, Clone, Copy, Default)]
pub struct WatchOptions {
    pub recursive: bool,
    pub include_entry: bool,
    pub allow_network_mounts: bool,
}

const BASE_MASK: WatchMask = WatchMask::CREATE
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::DELETE)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::MODIFY)
    .union(WatchMask::ATTRIB);

/// Whether `path` lies on a network filesystem (or FUSE).
pub fn is_network_mount(path: &Path) -> io::Result<bool> {
    let magic = cubicle_syscalls::fs::fs_type(path)?;
    Ok(NETWORK_FS_MAGICS.contains(&magic))
}

/// Checks that `path` can be watched: an existing directory (symlinks followed), not on
/// a network filesystem unless allowed.
pub fn validate_watch_path(path: &Path, allow_network_mounts: bool) -> Result<(), ConnectError> {
    let meta = std::fs::metadata(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => {
            ConnectError::not_found(format!("path '{}' does not exist", path.display()))
        }
        _ => super::ops::io_error(&e, &format!("stat '{}'", path.display())),
    })?;
    if !meta.is_dir() {
        return Err(ConnectError::invalid_argument(format!(
            "path '{}' is not a directory",
            path.display()
        )));
    }
    if !allow_network_mounts
        && is_network_mount(path)
            .map_err(|e| super::ops::io_error(&e, &format!("statfs '{}'", path.display())))?
    {
        return Err(ConnectError::invalid_argument(format!(
            "cannot watch '{}': it is on a network filesystem (set allowNetworkMounts to try anyway)",
            path.display()
        )));
    }
    Ok(())
}

/// One watch: an inotify instance and the directories it covers.
pub struct DirWatcher {
    root: PathBuf,
    opts: WatchOptions,
    stream: EventStream<Vec<u8>>,
    watches: Watches,
    /// Watch descriptor id → (descriptor, directory relative to the root).
    dirs: HashMap<i32, (WatchDescriptor, PathBuf)>,
    root_wd: i32,
    pending: VecDeque<FilesystemEvent>,
    builder: EntryBuilder,
}

fn inotify_error(e: &io::Error, what: &str) -> ConnectError {
    match e.raw_os_error() {
        Some(libc::EMFILE) | Some(libc::ENFILE) => ConnectError::new(
            Code::ResourceExhausted,
            format!("{what}: too many inotify instances ({e}); stop other watchers"),
        ),
        Some(libc::ENOSPC) => ConnectError::new(
            Code::ResourceExhausted,
            format!("{what}: the inotify watch limit is reached ({e})"),
        ),
        _ => super::ops::io_error(e, what),
    }
}

impl DirWatcher {
    /// Starts watching `root` (already validated). Must run inside the tokio runtime
    /// (it may be a blocking-pool thread: a recursive start walks the tree).
    pub fn new(root: PathBuf, opts: WatchOptions) -> Result<Self, ConnectError> {
        let inotify = Inotify::init().map_err(|e| inotify_error(&e, "creating a watcher"))?;
        let watches = inotify.watches();
        let stream = inotify
            .into_event_stream(vec![0u8; 16 * 1024])
            .map_err(|e| inotify_error(&e, "creating a watcher"))?;
        let mut w = DirWatcher {
            root,
            opts,
            stream,
            watches,
            dirs: HashMap::new(),
            root_wd: -1,
            pending: VecDeque::new(),
            builder: EntryBuilder::default(),
        };
        // The root may be a symlink to a directory: follow it (only the root).
        let wd = w
            .watches
            .add(&w.root, BASE_MASK | WatchMask::ONLYDIR)
            .map_err(|e| inotify_error(&e, &format!("watching '{}'", w.root.display())))?;
        w.root_wd = wd.get_watch_descriptor_id();
        w.dirs.insert(w.root_wd, (wd, PathBuf::new()));
        if opts.recursive {
            w.add_subdirs(Path::new(""), false)?;
        }
        Ok(w)
    }

    /// Number of directories currently watched.
    pub fn watched_dirs(&self) -> usize {
        self.dirs.len()
    }

    /// The next event. Cancel-safe (usable in `select!`).
    pub async fn next_event(&mut self) -> Result<FilesystemEvent, ConnectError> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Ok(ev);
            }
            match self.stream.next().await {
                Some(Ok(raw)) => self.handle(raw.wd, raw.mask, raw.name),
                Some(Err(e)) => {
                    return Err(ConnectError::internal(format!("reading watch events: {e}")));
                }
                None => return Err(ConnectError::internal("the watch ended unexpectedly")),
            }
        }
    }

    fn push(&mut self, rel: &Path, ty: EventType) {
        let name = if rel.as_os_str().is_empty() {
            ".".to_string()
        } else {
            rel.to_string_lossy().into_owned()
        };
        let entry = if self.opts.include_entry
            && matches!(ty, EventType::Create | EventType::Write | EventType::Chmod)
        {
            let full = self.root.join(rel);
            self.builder.build(&full, &full).ok()
        } else {
            None
        };
        self.pending.push_back(FilesystemEvent {
            name,
            r#type: ty as i32,
            entry,
        });
    }

    fn handle(&mut self, wd: WatchDescriptor, mask: EventMask, name: Option<OsString>) {
        if mask.contains(EventMask::Q_OVERFLOW) {
            tracing::warn!(root = %self.root.display(), "inotify queue overflow: events were lost");
            return;
        }
        let id = wd.get_watch_descriptor_id();
        if mask.contains(EventMask::IGNORED) {
            self.dirs.remove(&id);
            return;
        }
        let Some(dir_rel) = self.dirs.get(&id).map(|(_, p)| p.clone()) else {
            return;
        };
        let Some(name) = name else {
            // An event about a watched directory itself.
            if id != self.root_wd {
                return; // its parent reports it
            }
            let rel = PathBuf::new();
            if mask.contains(EventMask::MOVE_SELF) {
                self.push(&rel, EventType::Rename);
            }
            if mask.contains(EventMask::ATTRIB) {
                self.push(&rel, EventType::Chmod);
            }
            if mask.contains(EventMask::DELETE_SELF) {
                self.push(&rel, EventType::Remove);
            }
            return;
        };
        let rel = dir_rel.join(&name);
        if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
            self.push(&rel, EventType::Create);
        }
        if mask.contains(EventMask::MOVED_FROM) {
            self.push(&rel, EventType::Rename);
        }
        if mask.contains(EventMask::ATTRIB) {
            self.push(&rel, EventType::Chmod);
        }
        if mask.contains(EventMask::MODIFY) {
            self.push(&rel, EventType::Write);
        }
        if mask.contains(EventMask::DELETE) {
            self.push(&rel, EventType::Remove);
        }
        if self.opts.recursive && mask.contains(EventMask::ISDIR) {
            if mask.contains(EventMask::MOVED_FROM) {
                self.forget_tree(&rel);
            }
            if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
                let created = mask.contains(EventMask::CREATE);
                if self.add_dir(&rel)
                    && let Err(e) = self.add_subdirs(&rel, created)
                {
                    tracing::warn!(error = %e, "extending a recursive watch");
                }
            }
        }
    }

    /// Adds a watch for the subdirectory `rel` (not following symlinks). False when it
    /// could not be watched (gone already, limit reached).
    fn add_dir(&mut self, rel: &Path) -> bool {
        if self.dirs.len() >= MAX_WATCHES_PER_WATCHER {
            tracing::warn!(root = %self.root.display(), "recursive watch limit reached");
            return false;
        }
        let full = self.root.join(rel);
        match self.watches.add(
            &full,
            BASE_MASK | WatchMask::ONLYDIR | WatchMask::DONT_FOLLOW,
        ) {
            Ok(wd) => {
                self.dirs
                    .insert(wd.get_watch_descriptor_id(), (wd, rel.to_path_buf()));
                true
            }
            Err(e) => {
                tracing::debug!(path = %full.display(), error = %e, "cannot watch directory");
                false
            }
        }
    }

    /// Watches every directory below `rel` (already watched itself); with `announce`,
    /// emits CREATE for everything found (a just-created directory).
    fn add_subdirs(&mut self, rel: &Path, announce: bool) -> Result<(), ConnectError> {
        let mut seen: HashSet<(u64, u64)> = HashSet::new();
        let mut stack = vec![rel.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let full = self.root.join(&dir);
            if let Ok(m) = std::fs::metadata(&full)
                && !seen.insert((m.dev(), m.ino()))
            {
                continue;
            }
            let Ok(rd) = std::fs::read_dir(&full) else {
                continue;
            };
            let mut names: Vec<OsString> =
                rd.filter_map(|c| c.ok().map(|c| c.file_name())).collect();
            names.sort();
            let mut subdirs = Vec::new();
            for n in names {
                let child = dir.join(&n);
                if announce {
                    self.push(&child, EventType::Create);
                }
                let Ok(m) = std::fs::symlink_metadata(self.root.join(&child)) else {
                    continue;
                };
                if m.is_dir() {
                    if self.dirs.len() >= MAX_WATCHES_PER_WATCHER {
                        return Err(ConnectError::new(
                            Code::ResourceExhausted,
                            format!(
                                "more than {MAX_WATCHES_PER_WATCHER} directories below '{}'",
                                self.root.display()
                            ),
                        ));
                    }
                    let path = self.root.join(&child);
                    match self.watches.add(
                        &path,
                        BASE_MASK | WatchMask::ONLYDIR | WatchMask::DONT_FOLLOW,
                    ) {
                        Ok(wd) => {
                            self.dirs
                                .insert(wd.get_watch_descriptor_id(), (wd, child.clone()));
                            subdirs.push(child);
                        }
                        Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                            return Err(inotify_error(
                                &e,
                                &format!("watching '{}'", path.display()),
                            ));
                        }
                        Err(_) => continue, // vanished meanwhile
                    }
                }
            }
            // Depth-first, in name order.
            stack.extend(subdirs.into_iter().rev());
        }
        Ok(())
    }

    /// Drops the watches of `rel` and everything below it (moved out of place).
    fn forget_tree(&mut self, rel: &Path) {
        let ids: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(id, (_, p))| **id != self.root_wd && p.starts_with(rel))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some((wd, _)) = self.dirs.remove(&id) {
                let _ = self.watches.remove(wd);
            }
        }
    }
}

/// The `WatchDir` response stream: `start`, then filesystem events and keepalives, until
/// the deadline (`deadline_exceeded`) or an error.
pub fn watch_stream(
    watcher: DirWatcher,
    keepalive: Duration,
    deadline: Option<Duration>,
) -> impl Stream<Item = Result<WatchDirResponse, ConnectError>> + Send + 'static {
    struct State {
        watcher: DirWatcher,
        started: bool,
        done: bool,
        keepalive: Duration,
        tick: Pin<Box<tokio::time::Sleep>>,
        deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    }
    let state = State {
        watcher,
        started: false,
        done: false,
        keepalive,
        tick: Box::pin(tokio::time::sleep(keepalive)),
        deadline: deadline.map(|d| Box::pin(tokio::time::sleep(d))),
    };
    let msg = |e: WatchEvent| WatchDirResponse { event: Some(e) };
    futures_util::stream::unfold(state, move |mut st| async move {
        if st.done {
            return None;
        }
        if !st.started {
            st.started = true;
            let next = tokio::time::Instant::now() + st.keepalive;
            st.tick.as_mut().reset(next);
            return Some((Ok(msg(WatchEvent::Start(StartEvent {}))), st));
        }
        let State {
            watcher,
            tick,
            deadline,
            keepalive,
            ..
        } = &mut st;
        let expired = async {
            match deadline.as_mut() {
                Some(d) => d.as_mut().await,
                None => std::future::pending().await,
            }
        };
        let out = tokio::select! {
            ev = watcher.next_event() => match ev {
                Ok(ev) => {
                    tick.as_mut().reset(tokio::time::Instant::now() + *keepalive);
                    Ok(msg(WatchEvent::Filesystem(ev)))
                }
                Err(e) => Err(e),
            },
            _ = tick.as_mut() => {
                tick.as_mut().reset(tokio::time::Instant::now() + *keepalive);
                Ok(msg(WatchEvent::Keepalive(KeepAlive {})))
            }
            _ = expired => Err(ConnectError::new(Code::DeadlineExceeded, "the watch reached its deadline")),
        };
        if out.is_err() {
            st.done = true;
        }
        Some((out, st))
    })
}

/// Events of a polling watcher, filled by its task.
#[derive(Default)]
struct Buffer {
    events: VecDeque<FilesystemEvent>,
    dropped: u64,
    error: Option<ConnectError>,
}

/// A watcher polled with `GetWatcherEvents`. Dropping it stops the watch.
pub struct PollingWatcher {
    buffer: Arc<Mutex<Buffer>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PollingWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PollingWatcher {
    /// Starts pumping `watcher`'s events into a bounded buffer.
    pub fn start(mut watcher: DirWatcher) -> Self {
        let buffer = Arc::new(Mutex::new(Buffer::default()));
        let buf = buffer.clone();
        let task = tokio::spawn(async move {
            loop {
                let ev = watcher.next_event().await;
                let mut b = buf.lock().unwrap_or_else(|e| e.into_inner());
                match ev {
                    Ok(ev) => {
                        if b.events.len() >= MAX_BUFFERED_EVENTS {
                            b.events.pop_front();
                            b.dropped += 1;
                            if b.dropped == 1 || b.dropped % 10_000 == 0 {
                                tracing::warn!(
                                    dropped = b.dropped,
                                    "watcher buffer full: dropping the oldest events"
                                );
                            }
                        }
                        b.events.push_back(ev);
                    }
                    Err(e) => {
                        b.error = Some(e);
                        return;
                    }
                }
            }
        });
        Self { buffer, task }
    }

    /// The events since the last call; the watch's error once it failed and every
    /// buffered event was delivered.
    pub fn take_events(&self) -> Result<Vec<FilesystemEvent>, ConnectError> {
        let mut b = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
        if b.events.is_empty()
            && let Some(e) = &b.error
        {
            return Err(e.clone());
        }
        Ok(b.events.drain(..).collect())
    }
}

/// The table of polling watchers.
#[derive(Default)]
pub struct WatcherTable {
    watchers: Mutex<HashMap<String, PollingWatcher>>,
}

impl WatcherTable {
    /// Registers a new polling watcher, returning its id.
    pub fn insert(&self, watcher: DirWatcher) -> Result<String, ConnectError> {
        let mut map = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_POLLING_WATCHERS {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("too many watchers ({MAX_POLLING_WATCHERS}); remove unused ones"),
            ));
        }
        let id = loop {
            let id = format!("w{:016x}", rand::random::<u64>());
            if !map.contains_key(&id) {
                break id;
            }
        };
        map.insert(id.clone(), PollingWatcher::start(watcher));
        Ok(id)
    }

    /// Events of watcher `id` since the last poll.
    pub fn events(&self, id: &str) -> Result<Vec<FilesystemEvent>, ConnectError> {
        let map = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id)
            .ok_or_else(|| ConnectError::not_found(format!("watcher '{id}' not found")))?
            .take_events()
    }

    /// Stops and forgets watcher `id`.
    pub fn remove(&self, id: &str) -> Result<(), ConnectError> {
        let removed = self
            .watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        match removed {
            Some(w) => {
                drop(w);
                Ok(())
            }
            None => Err(ConnectError::not_found(format!("watcher '{id}' not found"))),
        }
    }

    /// Number of live polling watchers.
    pub fn len(&self) -> usize {
        self.watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Whether there are no polling watchers.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp() -> super::super::test_util::TempDir {
        super::super::test_util::TempDir::new("watch")
    }

    /// Events until every `(name, type)` of `want` was seen (at most 10 s), then until
    /// 200 ms pass without one.
    async fn collect(w: &mut DirWatcher, want: &[(&str, EventType)]) -> Vec<FilesystemEvent> {
        let mut out: Vec<FilesystemEvent> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let all = want
                .iter()
                .all(|(n, t)| out.iter().any(|e| e.name == *n && e.r#type == *t as i32));
            let wait = if all {
                Duration::from_millis(200)
            } else {
                deadline.saturating_duration_since(tokio::time::Instant::now())
            };
            match tokio::time::timeout(wait, w.next_event()).await {
                Ok(Ok(ev)) => out.push(ev),
                _ => return out,
            }
        }
    }

    fn has(evs: &[FilesystemEvent], n: &str, t: EventType) -> bool {
        evs.iter().any(|e| e.name == n && e.r#type == t as i32)
    }

    #[tokio::test]
    async fn maps_events_recursively() {
        let d = tmp();
        std::fs::create_dir(d.join("pre")).unwrap();
        let opts = WatchOptions {
            recursive: true,
            include_entry: true,
            ..Default::default()
        };
        let mut w = DirWatcher::new(d.to_path_buf(), opts).unwrap();
        assert_eq!(w.watched_dirs(), 2);

        std::fs::write(d.join("pre/f"), b"x").unwrap();
        std::fs::create_dir_all(d.join("new/a/b")).unwrap();
        std::fs::write(d.join("new/a/b/g"), b"y").unwrap();
        std::fs::rename(d.join("pre/f"), d.join("f2")).unwrap();
        std::fs::remove_file(d.join("f2")).unwrap();
        use EventType::*;
        let want = [
            ("pre/f", Create),
            ("pre/f", Write),
            ("new", Create),
            ("new/a", Create),
            ("new/a/b", Create),
            ("new/a/b/g", Create),
            ("pre/f", Rename),
            ("f2", Create),
            ("f2", Remove),
        ];
        let evs = collect(&mut w, &want).await;
        for (n, t) in want {
            assert!(has(&evs, n, t), "{n} {t:?} missing: {evs:?}");
        }
        // No duplicate REMOVE for subdirectories (DELETE_SELF is dropped).
        std::fs::remove_dir_all(d.join("new")).unwrap();
        let evs = collect(&mut w, &[("new", Remove)]).await;
        let removes = evs
            .iter()
            .filter(|e| e.name == "new" && e.r#type == Remove as i32)
            .count();
        assert_eq!(removes, 1, "{evs:?}");
        assert_eq!(w.watched_dirs(), 2);
    }

    #[tokio::test]
    async fn non_recursive_ignores_subdirs_and_entries_only_for_create_write_chmod() {
        let d = tmp();
        std::fs::create_dir(d.join("sub")).unwrap();
        let opts = WatchOptions {
            include_entry: true,
            ..Default::default()
        };
        let mut w = DirWatcher::new(d.to_path_buf(), opts).unwrap();
        std::fs::write(d.join("sub/inner"), b"x").unwrap();
        std::fs::write(d.join("top"), b"x").unwrap();
        let mut got = collect(
            &mut w,
            &[("top", EventType::Create), ("top", EventType::Write)],
        )
        .await;
        assert!(got.iter().all(|e| !e.name.starts_with("sub/")), "{got:?}");
        let create = got
            .iter()
            .find(|e| e.name == "top" && e.r#type == EventType::Create as i32)
            .unwrap();
        assert_eq!(create.entry.as_ref().map(|e| e.name.as_str()), Some("top"));
        let write = got
            .iter()
            .find(|e| e.name == "top" && e.r#type == EventType::Write as i32)
            .unwrap();
        assert_eq!(write.entry.as_ref().map(|e| e.size), Some(1));
        std::fs::set_permissions(
            d.join("top"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        std::fs::remove_file(d.join("top")).unwrap();
        got = collect(
            &mut w,
            &[("top", EventType::Chmod), ("top", EventType::Remove)],
        )
        .await;
        // The entry is looked up when the event is read: gone by then, so no entry.
        let chmod = got
            .iter()
            .find(|e| e.name == "top" && e.r#type == EventType::Chmod as i32)
            .unwrap();
        assert!(chmod.entry.is_none());
        let remove = got
            .iter()
            .find(|e| e.name == "top" && e.r#type == EventType::Remove as i32)
            .unwrap();
        assert!(remove.entry.is_none());
    }

    #[tokio::test]
    async fn moved_directories_keep_correct_names() {
        use EventType::*;
        let d = tmp();
        let outside = tmp();
        std::fs::create_dir_all(d.join("sub/inner")).unwrap();
        let opts = WatchOptions {
            recursive: true,
            ..Default::default()
        };
        let mut w = DirWatcher::new(d.to_path_buf(), opts).unwrap();
        assert_eq!(w.watched_dirs(), 3);
        std::fs::rename(d.join("sub"), d.join("moved")).unwrap();
        let evs = collect(&mut w, &[("sub", Rename), ("moved", Create)]).await;
        assert!(
            has(&evs, "sub", Rename) && has(&evs, "moved", Create),
            "{evs:?}"
        );
        std::fs::write(d.join("moved/inner/f"), b"x").unwrap();
        let evs = collect(&mut w, &[("moved/inner/f", Create)]).await;
        assert!(has(&evs, "moved/inner/f", Create), "{evs:?}");
        assert!(evs.iter().all(|e| !e.name.starts_with("sub")), "{evs:?}");
        // Moved out of the tree: its watches go, and nothing below it is reported.
        std::fs::rename(d.join("moved"), outside.join("gone")).unwrap();
        let evs = collect(&mut w, &[("moved", Rename)]).await;
        assert!(has(&evs, "moved", Rename), "{evs:?}");
        std::fs::write(outside.join("gone/inner/g"), b"x").unwrap();
        std::fs::write(d.join("marker"), b"x").unwrap();
        let evs = collect(&mut w, &[("marker", Create)]).await;
        assert!(evs.iter().all(|e| e.name.starts_with("marker")), "{evs:?}");
        assert_eq!(w.watched_dirs(), 1);
    }

    #[test]
    fn validation() {
        let d = tmp();
        std::fs::write(d.join("f"), b"").unwrap();
        assert_eq!(
            validate_watch_path(&d.join("missing"), false)
                .unwrap_err()
                .code,
            Code::NotFound
        );
        assert_eq!(
            validate_watch_path(&d.join("f"), false).unwrap_err().code,
            Code::InvalidArgument
        );
        validate_watch_path(&d, false).unwrap();
        assert!(!is_network_mount(&d).unwrap());
    }
}
