//! `cubicle bench egress`: the egress layer in a private lab of network namespaces (no
//! server; see `cubicle_egress::lab`): one connection's throughput through the proxy and
//! direct, new connections with an HTTP request each way, policy application.

use serde_json::json;

use super::BenchArgs;

/// Runs the measure and prints its rows (a table, or one JSON object with `--json`).
pub(super) fn measure_egress(args: &BenchArgs) -> anyhow::Result<()> {
    let bytes: u64 = 1 << 30;
    let requests = args.iterations.max(20);
    let r = cubicle_egress::lab::bench(bytes, requests)?;
    let rows = [
        (
            "egress proxy, 1 connection (Gbit/s)",
            format!("{:.2}", r.proxied_gbit_s),
        ),
        (
            "direct, 1 connection (Gbit/s)",
            format!("{:.2}", r.direct_gbit_s),
        ),
        (
            "new connection + request via proxy p50/p99 (µs)",
            format!("{} / {}", r.proxied_request_us.0, r.proxied_request_us.1),
        ),
        (
            "new connection + request direct p50/p99 (µs)",
            format!("{} / {}", r.direct_request_us.0, r.direct_request_us.1),
        ),
        (
            "added per new connection p50 (µs)",
            format!(
                "{}",
                r.proxied_request_us.0 as i64 - r.direct_request_us.0 as i64
            ),
        ),
        (
            "apply a policy to a new sandbox p50/p99 (µs)",
            format!("{} / {}", r.apply_policy_us.0, r.apply_policy_us.1),
        ),
        (
            "replace a running sandbox's policy p50/p99 (µs)",
            format!("{} / {}", r.update_policy_us.0, r.update_policy_us.1),
        ),
        (
            "remove a policy (sandbox death) p50/p99 (µs)",
            format!("{} / {}", r.clear_policy_us.0, r.clear_policy_us.1),
        ),
    ];
    if args.json {
        println!(
            "{}",
            json!({
                "measure": "egress", "bytes": r.bytes,
                "proxiedGbitS": r.proxied_gbit_s, "directGbitS": r.direct_gbit_s,
                "proxiedRequestUs": [r.proxied_request_us.0, r.proxied_request_us.1],
                "directRequestUs": [r.direct_request_us.0, r.direct_request_us.1],
                "applyPolicyUs": [r.apply_policy_us.0, r.apply_policy_us.1],
                "updatePolicyUs": [r.update_policy_us.0, r.update_policy_us.1],
                "clearPolicyUs": [r.clear_policy_us.0, r.clear_policy_us.1],
            })
        );
    } else {
        println!(
            "egress (private lab, {} MiB streamed, {requests} requests each way)",
            r.bytes >> 20,
        );
        for (k, v) in rows {
            println!("  {k:<52} {v}");
        }
    }
    Ok(())
}
