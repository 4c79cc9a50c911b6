//! `cycle`: create + `Process.Start` of `true` through envd + `DELETE`, all timed, with
//! the median of each phase; and `exec`: `Process.Start` of `true` in one running sandbox
//! (what `commands.run("true")` sends) on a kept-alive connection.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Ctx;
use super::api::{drive, note_errors, true_cmd};
use super::report::{Row, ms, pct};

pub(super) async fn measure_cycle(
    cx: &Ctx,
    template: &str,
    conc: usize,
    total: usize,
    pace: Duration,
) -> Row {
    let (t, internet) = (template.to_string(), cx.internet);
    // Each successful cycle's three phases, for the breakdown columns.
    let phases = Arc::new(std::sync::Mutex::new([Vec::new(), Vec::new(), Vec::new()]));
    let ph = phases.clone();
    let (samples, errors, msgs) = drive(&cx.api, conc, total, move |api, mut c| {
        let (t, ph) = (t.clone(), ph.clone());
        async move {
            let (cmd, args) = true_cmd(&t);
            let t0 = Instant::now();
            let r = async {
                let s = api.create(&mut c, &t, internet).await?;
                let t1 = Instant::now();
                let ran = api.run(&mut c, &s, cmd, &args).await;
                let t2 = Instant::now();
                let killed = api.kill(&mut c, &s.id).await;
                let t3 = Instant::now();
                ran?;
                killed?;
                if let Ok(mut p) = ph.lock() {
                    p[0].push(t1 - t0);
                    p[1].push(t2 - t1);
                    p[2].push(t3 - t2);
                }
                Ok(t0.elapsed())
            }
            .await;
            tokio::time::sleep(pace).await;
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    let mut row = Row {
        samples,
        errors,
        ..Row::new("cycle", conc)
    };
    if !pace.is_zero() {
        row = row.with("pace_ms", pace.as_millis() as u64);
    }
    let mut phases = phases.lock().map(|p| p.clone()).unwrap_or_default();
    for (name, v) in ["create", "run", "kill"].iter().zip(phases.iter_mut()) {
        v.sort();
        row = row.with(&format!("{name}_p50_ms"), ms(pct(v, 0.5)));
    }
    row.with("template", template)
        .with("pool", cx.pool.as_str())
        .with("internet", internet)
}

pub(super) async fn measure_exec(cx: &Ctx, template: &str, conc: usize) -> anyhow::Result<Row> {
    let mut c = cx.api.conn();
    let s = cx.api.create(&mut c, template, cx.internet).await?;
    let (cmd, args) = true_cmd(template);
    let shown = format!("{cmd} {}", args.join(" "));
    let sb = s.clone();
    let (samples, errors, msgs) = drive(&cx.api, conc, cx.iterations, move |api, mut c| {
        let (sb, args) = (sb.clone(), args.clone());
        async move {
            let t0 = Instant::now();
            let r = api.run(&mut c, &sb, cmd, &args).await.map(|_| t0.elapsed());
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    cx.api.kill(&mut c, &s.id).await?;
    Ok(Row {
        samples,
        errors,
        ..Row::new("exec", conc)
    }
    .with("template", template)
    .with("cmd", shown))
}
