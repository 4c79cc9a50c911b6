//! The templates [`TemplateStore::get`](crate::TemplateStore::get) read last, kept while
//! their `template.json` is unchanged.
//!
//! Every create reads its template (twice: the API checks it exists, the node plans the
//! sandbox), and a warm claim is about a millisecond of CPU in all: parsing the same
//! file each time was a visible share of it. A file counts as unchanged while its
//! device, inode, size, modification and change times are: the store rewrites a
//! template's config only by renaming a new file over it (a new inode), and an edit in
//! place changes its times.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

use crate::Template;

/// What identifies one version of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    pub(crate) fn of(m: &std::fs::Metadata) -> FileStamp {
        FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// Template name → the template read from the config file of that stamp.
#[derive(Debug, Default)]
pub(crate) struct ConfigCache {
    kept: Mutex<HashMap<String, (FileStamp, Template)>>,
}

impl ConfigCache {
    /// The template kept for `name` if it was read from the file version `stamp`.
    pub(crate) fn get(&self, name: &str, stamp: FileStamp) -> Option<Template> {
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.get(name)
            .filter(|(s, _)| *s == stamp)
            .map(|(_, t)| t.clone())
    }

    /// Keeps `template`, read from the file version `stamp`.
    pub(crate) fn put(&self, name: &str, stamp: FileStamp, template: &Template) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.insert(name.to_string(), (stamp, template.clone()));
    }

    /// Forgets `name` (its config is gone).
    pub(crate) fn forget(&self, name: &str) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.remove(name);
    }
}
