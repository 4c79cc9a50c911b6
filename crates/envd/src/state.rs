//! What envd knows about its sandbox: settings from the command line, and what the node
//! told it through `POST /init` (global env vars, access token, default user/workdir).

use std::{collections::HashMap, path::PathBuf, sync::RwLock};

use crate::users::{self, User};

/// The version we report (and implement) — every feature gate of the SDKs up to 0.6.4 is
/// implemented; see shared/spec/e2b-compat.md §3.7.
pub const ENVD_VERSION: &str = "0.6.13";

/// Settings fixed at start-up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Development mode: envd runs directly on a host (no `/run/e2b` files).
    pub dev: bool,
    /// Default user when `/init` names none.
    pub default_user: Option<String>,
    /// Default working directory when `/init` names none.
    pub default_workdir: Option<PathBuf>,
    /// Access token given on the command line (normally it comes through `/init`).
    pub access_token: Option<String>,
}

/// Settings that `/init` may change at run time.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub env_vars: HashMap<String, String>,
    pub access_token: Option<String>,
    pub default_user: Option<String>,
    pub default_workdir: Option<PathBuf>,
}

/// Shared context of every service.
#[derive(Debug)]
pub struct Context {
    pub config: Config,
    settings: RwLock<Settings>,
}

impl Context {
    pub fn new(config: Config) -> Self {
        let settings = Settings {
            env_vars: HashMap::new(),
            access_token: config.access_token.clone().filter(|t| !t.is_empty()),
            default_user: config.default_user.clone(),
            default_workdir: config.default_workdir.clone(),
        };
        Self {
            config,
            settings: RwLock::new(settings),
        }
    }

    /// A copy of the current settings.
    pub fn settings(&self) -> Settings {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Applies a change to the settings.
    pub fn update(&self, f: impl FnOnce(&mut Settings)) {
        let mut guard = self.settings.write().unwrap_or_else(|e| e.into_inner());
        f(&mut guard);
    }

    /// The access token every request must carry, if one is set.
    pub fn access_token(&self) -> Option<String> {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .access_token
            .clone()
    }

    /// The sandbox-global environment (create-time env vars).
    pub fn env_vars(&self) -> HashMap<String, String> {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .env_vars
            .clone()
    }

    /// The default working directory, if configured.
    pub fn default_workdir(&self) -> Option<PathBuf> {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .default_workdir
            .clone()
    }

    /// The default user: the configured one (normally `user`), else in development mode
    /// the user envd runs as, else `root`.
    pub fn default_user(&self) -> Option<User> {
        let name = self
            .settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .default_user
            .clone();
        match name {
            Some(n) => users::by_name(&n),
            None if self.config.dev => Some(users::current()),
            None => users::by_name("user").or_else(|| users::by_name("root")),
        }
    }
}
