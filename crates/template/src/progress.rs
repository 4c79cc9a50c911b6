//! Progress reporting for template builds: an indicatif bar on a terminal, log lines
//! otherwise (indicatif hides itself when stderr is not a TTY).

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A build's progress: numbered stages plus the latest output line as the message.
pub struct Progress {
    bar: Option<ProgressBar>,
    name: String,
}

impl Progress {
    /// A bar for template `name` (hidden when `enabled` is false).
    pub fn new(enabled: bool, name: &str) -> Self {
        let bar = enabled.then(|| {
            let b = ProgressBar::new(1);
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} {prefix}: {wide_msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            b.set_style(style);
            b.set_prefix(format!("building {name}"));
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Progress {
            bar,
            name: name.to_string(),
        }
    }

    /// Announce the total number of stages.
    pub fn stages(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.set_length(n);
        }
    }

    /// Start the next stage.
    pub fn stage(&self, msg: &str) {
        tracing::info!(template = %self.name, "{msg}");
        if let Some(b) = &self.bar {
            b.inc(1);
            b.set_message(msg.to_string());
        }
    }

    /// Show an output line of the current stage.
    pub fn line(&self, line: &str) {
        tracing::debug!(template = %self.name, "{line}");
        if let Some(b) = &self.bar {
            let l: String = line.chars().take(100).collect();
            b.set_message(l);
        }
    }

    /// Finish the bar with a final message.
    pub fn finish(&self, msg: &str) {
        tracing::info!(template = %self.name, "{msg}");
        if let Some(b) = &self.bar {
            b.finish_and_clear();
            eprintln!("{msg}");
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = &self.bar
            && !b.is_finished()
        {
            b.abandon();
        }
    }
}
