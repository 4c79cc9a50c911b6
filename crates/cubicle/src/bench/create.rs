//! `create`: `POST /v2/sandboxes` → 201 (the sandbox is ready when the answer comes);
//! the kill afterwards is not timed. c=1: a closed loop, optionally paced; c>1: bursts of
//! c simultaneous creates, all killed, then a pause for teardowns and pool refills.

use std::time::{Duration, Instant};

use super::Ctx;
use super::api::{drive, note_errors};
use super::report::Row;

pub(super) async fn measure_create(cx: &Ctx, template: &str, conc: usize, pace: Duration) -> Row {
    let internet = cx.internet;
    let mut row = Row::new("create", conc);
    if conc <= 1 {
        let t = template.to_string();
        let (samples, errors, msgs) = drive(&cx.api, 1, cx.iterations, move |api, mut c| {
            let t = t.clone();
            async move {
                let t0 = Instant::now();
                let r = api.create(&mut c, &t, internet).await;
                let d = t0.elapsed();
                let r = match r {
                    Ok(s) => api.kill(&mut c, &s.id).await.map(|_| d),
                    Err(e) => Err(e),
                };
                // Untimed think time (an agent works between creates; a pool refills).
                tokio::time::sleep(pace).await;
                (c, r)
            }
        })
        .await;
        note_errors(&msgs);
        row.samples = samples;
        row.errors = errors;
        if !pace.is_zero() {
            row = row.with("pace_ms", pace.as_millis() as u64);
        }
    } else {
        // Bursts: `conc` creates at once (timed), then all killed (untimed), then a pause
        // for teardowns (and pool refills) to settle before the next burst.
        let busy_before = cubicle_node::host::cpu_busy_seconds();
        let rounds = cx.iterations.div_ceil(conc);
        for _ in 0..rounds {
            let mut tasks = Vec::new();
            for _ in 0..conc {
                let (api, t) = (cx.api.clone(), template.to_string());
                tasks.push(tokio::spawn(async move {
                    let mut c = api.conn();
                    let t0 = Instant::now();
                    let r = api.create(&mut c, &t, internet).await;
                    (t0.elapsed(), r)
                }));
            }
            let mut made = Vec::new();
            for t in tasks {
                match t.await {
                    Ok((d, Ok(s))) => {
                        row.samples.push(d);
                        made.push(s);
                    }
                    Ok((_, Err(e))) => {
                        if row.errors == 0 {
                            eprintln!("cubicle bench: {e:#}");
                        }
                        row.errors += 1;
                    }
                    Err(_) => row.errors += 1,
                }
            }
            let mut c = cx.api.conn();
            for s in made {
                let _ = cx.api.kill(&mut c, &s.id).await;
            }
            tokio::time::sleep(Duration::from_millis(conc as u64 * 100)).await;
        }
        // What a sandbox costs the machine: every burst's creates, kills, teardowns (and
        // refills) ended within its pause, so the busy time over the row, per sandbox
        // made, is the CPU of one made and removed (plus the bench's client and whatever
        // else ran on the machine: meaningful with the server on the same machine).
        if let (Some(a), Some(b)) = (busy_before, cubicle_node::host::cpu_busy_seconds())
            && !row.samples.is_empty()
        {
            let per = (b - a).max(0.0) * 1e3 / row.samples.len() as f64;
            row = row.with("host_cpu_ms_per_sandbox", (per * 100.0).round() / 100.0);
        }
    }
    row.with("template", template)
        .with("pool", cx.pool.as_str())
        .with("internet", internet)
}
