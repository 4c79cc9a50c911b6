//! Process facts from /proc and pidfds: start times (to tell a live init from a reused
//! pid after a node restart) and whether a process that is not our child is alive.

/// Start time (clock ticks since boot, field 22 of `/proc/PID/stat`) of `pid`.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may contain spaces and parens: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); field 22 is index 19 in rest.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// True if `pid` exists, is not a zombie, and (when given) started at `start`.
pub fn is_alive(pid: i32, start: Option<u64>) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 1..].split_whitespace();
    if matches!(fields.next(), Some("Z") | Some("X") | None) {
        return false;
    }
    match start {
        Some(s) => start_time(pid) == Some(s),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_with_its_start_time() {
        let me = std::process::id() as i32;
        let st = start_time(me).unwrap();
        assert!(is_alive(me, Some(st)));
        assert!(!is_alive(me, Some(st + 1)));
        assert!(!is_alive(i32::MAX, None));
    }
}
