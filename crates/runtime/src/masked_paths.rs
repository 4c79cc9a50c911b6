//! Security policy: which kernel interfaces a sandbox must not see or change.
//!
//! A sandbox gets a fresh procfs (its own pid namespace) and a read-only sysfs, but both
//! still expose host-wide kernel state. This file is the complete list of what is hidden
//! or frozen; `rootfs.rs` applies it after mounting /proc and /sys and before
//! `pivot_root`. Paths that do not exist on a given kernel are skipped.

/// Files hidden by bind-mounting `/dev/null` over them: reads return nothing, writes are
/// discarded (a read-only mount does not stop writes to a device node, but they reach
/// /dev/null, never the masked file).
pub const MASKED_FILES: &[&str] = &[
    "/proc/kcore", // physical memory of the host
    "/proc/kmsg",  // kernel log (host-wide)
    "/proc/keys",  // keyrings visible to the caller
    "/proc/key-users",
    "/proc/timer_list",    // host timers, leaks pointers and host task names
    "/proc/sched_debug",   // host scheduler state, all host tasks
    "/proc/sysrq-trigger", // reboot / crash the host
    "/proc/latency_stats",
    "/proc/kallsyms", // kernel symbol addresses (KASLR)
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/kpagecgroup",
    "/proc/pagetypeinfo",
    "/proc/vmallocinfo",
    "/proc/config.gz",
];

/// Directories hidden by mounting an empty read-only tmpfs over them.
pub const MASKED_DIRS: &[&str] = &[
    "/proc/acpi",
    "/proc/scsi",
    "/proc/asound",
    "/proc/driver",
    "/proc/tty/driver",
    "/sys/firmware",                 // ACPI tables, EFI variables, DMI
    "/sys/devices/virtual/powercap", // RAPL energy counters (side channel)
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
    "/sys/kernel/security",
];

/// Subtrees made read-only (bind-mounted onto themselves, then remounted read-only).
/// `/sys` as a whole is already mounted read-only.
pub const READONLY_PATHS: &[&str] = &[
    "/proc/sys", // sysctls (network ones are per-netns but stay frozen too)
    "/proc/irq",
    "/proc/bus",
    "/proc/fs",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_paths_are_listed() {
        for p in [
            "/proc/kcore",
            "/proc/sysrq-trigger",
            "/proc/keys",
            "/proc/timer_list",
            "/proc/sched_debug",
            "/proc/kmsg",
        ] {
            assert!(MASKED_FILES.contains(&p), "{p}");
        }
        for p in ["/proc/acpi", "/proc/scsi"] {
            assert!(MASKED_DIRS.contains(&p), "{p}");
        }
        for p in ["/proc/sys", "/proc/irq", "/proc/bus", "/proc/fs"] {
            assert!(READONLY_PATHS.contains(&p), "{p}");
        }
    }

    #[test]
    fn all_absolute_under_proc_or_sys() {
        for p in MASKED_FILES.iter().chain(MASKED_DIRS).chain(READONLY_PATHS) {
            assert!(p.starts_with("/proc/") || p.starts_with("/sys/"), "{p}");
        }
    }
}
