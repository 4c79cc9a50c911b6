//! Dockerfiles → build steps, the way E2B's SDK converts them (`from_dockerfile`):
//! the steps begin with `USER root` and `WORKDIR /` (Dockerfile semantics), `COPY` and
//! `ADD` (local files) become COPY steps (one per source), `ENV` and `ARG` (with a value)
//! become ENV steps, `RUN`, `WORKDIR` and `USER` stay, `CMD`/`ENTRYPOINT` become the start
//! command, and `USER user` / `WORKDIR /home/user` are appended unless the file sets them.
//!
//! Supported: `FROM` (one stage), `RUN`, `COPY`/`ADD` (`--chown`, `--chmod`), `ENV`, `ARG`,
//! `WORKDIR`, `USER`, `CMD`, `ENTRYPOINT`, shell and JSON (exec) forms, line continuations,
//! comments, `${VAR}`/`$VAR`/`${VAR:-default}` substitution from `ARG`/`ENV` in the
//! instructions Docker substitutes in. Ignored with a warning: `EXPOSE`, `LABEL`,
//! `MAINTAINER`, `STOPSIGNAL`, `VOLUME`, `HEALTHCHECK`. Refused with a message that says
//! so: multi-stage builds (a second `FROM`, `COPY --from`), `ADD` of a URL, heredocs,
//! `SHELL`, `ONBUILD`, `RUN --mount`, anything else.

use std::collections::BTreeMap;

use super::Step;

/// A parsed Dockerfile.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Dockerfile {
    /// The `FROM` image.
    pub from: String,
    /// The steps.
    pub steps: Vec<Step>,
    /// `CMD`/`ENTRYPOINT` as one shell command.
    pub start_cmd: Option<String>,
    /// Lines the parser skipped, with why.
    pub warnings: Vec<String>,
}

/// A COPY step's source, as the CLI must upload it: (step index, source, destination).
impl Dockerfile {
    /// `(index into steps, src)` of every COPY step.
    pub fn copy_sources(&self) -> Vec<(usize, String)> {
        self.steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == "COPY")
            .filter_map(|(i, s)| s.args.first().map(|a| (i, a.clone())))
            .collect()
    }
}

fn step(kind: &str, args: Vec<String>) -> Step {
    Step {
        kind: kind.into(),
        args,
        force: false,
        files_hash: None,
    }
}

/// Join continuation lines and drop comments: `(line number, instruction text)`.
fn logical_lines(text: &str, escape: char) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut start = 0;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end();
        if cur.is_empty() {
            let t = line.trim_start();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            start = i + 1;
        } else if line.trim_start().starts_with('#') {
            continue; // comment lines inside a continuation are skipped, as Docker does
        }
        if let Some(body) = line.strip_suffix(escape) {
            cur.push_str(body);
            cur.push(' ');
        } else {
            cur.push_str(line);
            out.push((start, std::mem::take(&mut cur)));
        }
    }
    if !cur.trim().is_empty() {
        out.push((start, cur));
    }
    out
}

/// `["a", "b"]` (exec form) → the words; `None` for shell form.
fn json_words(rest: &str) -> Option<Vec<String>> {
    let t = rest.trim();
    if !t.starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<String>>(t).ok()
}

/// Exec-form words as one shell command line.
fn join_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            if !w.is_empty()
                && w.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b))
            {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Docker's variable substitution: `$X`, `${X}`, `${X:-default}`, `${X:+alt}`; `\$` is a
/// literal dollar.
fn substitute(s: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let cs: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c == '\\' && cs.get(i + 1) == Some(&'$') {
            out.push('$');
            i += 2;
            continue;
        }
        if c != '$' {
            out.push(c);
            i += 1;
            continue;
        }
        if cs.get(i + 1) == Some(&'{')
            && let Some(end) = cs[i + 2..].iter().position(|c| *c == '}')
        {
            {
                let inner: String = cs[i + 2..i + 2 + end].iter().collect();
                let val = if let Some((name, def)) = inner.split_once(":-") {
                    vars.get(name)
                        .filter(|v| !v.is_empty())
                        .cloned()
                        .unwrap_or_else(|| def.to_string())
                } else if let Some((name, alt)) = inner.split_once(":+") {
                    if vars.get(name).is_some_and(|v| !v.is_empty()) {
                        alt.to_string()
                    } else {
                        String::new()
                    }
                } else {
                    vars.get(&inner).cloned().unwrap_or_default()
                };
                out.push_str(&val);
                i += 3 + end;
                continue;
            }
        }
        let name: String = cs[i + 1..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
            .collect();
        if name.is_empty() {
            out.push('$');
            i += 1;
        } else {
            out.push_str(vars.get(&name).map(String::as_str).unwrap_or(""));
            i += 1 + name.chars().count();
        }
    }
    out
}

/// Split a shell-form argument list on whitespace, honouring double and single quotes.
fn words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '"' | '\'') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                    any = true;
                }
            }
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// Parse `text`. `build_args` override `ARG` defaults.
pub fn parse(text: &str, build_args: &BTreeMap<String, String>) -> Result<Dockerfile, String> {
    let escape = text
        .lines()
        .take_while(|l| l.trim_start().starts_with('#'))
        .find_map(|l| {
            let d = l.trim_start().trim_start_matches('#').trim();
            d.strip_prefix("escape=")
                .map(|e| e.trim().chars().next().unwrap_or('\\'))
        })
        .unwrap_or('\\');
    let mut df = Dockerfile::default();
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut set_user = false;
    let mut set_workdir = false;
    let mut entrypoint: Option<String> = None;
    let mut cmd: Option<String> = None;
    for (n, line) in logical_lines(text, escape) {
        let line = line.trim();
        let (instr, rest) = match line.split_once(char::is_whitespace) {
            Some((i, r)) => (i.to_ascii_uppercase(), r.trim().to_string()),
            None => (line.to_ascii_uppercase(), String::new()),
        };
        let at = |m: String| format!("Dockerfile line {n}: {m}");
        if rest.contains("<<") && matches!(instr.as_str(), "RUN" | "COPY" | "ADD") {
            let looks_heredoc = rest
                .split_whitespace()
                .any(|w| w.starts_with("<<") && w.len() > 2 && !w.starts_with("<<<"));
            if looks_heredoc {
                return Err(at(format!("heredocs ({instr} <<EOF) are not supported")));
            }
        }
        match instr.as_str() {
            "FROM" => {
                if !df.from.is_empty() {
                    return Err(at(
                        "multi-stage builds (a second FROM) are not supported: build one stage"
                            .into(),
                    ));
                }
                let w = words(&substitute(&rest, &vars));
                let image = w
                    .iter()
                    .find(|w| !w.starts_with("--"))
                    .ok_or_else(|| at("FROM needs an image".into()))?;
                if w.iter().any(|x| x.starts_with("--platform")) {
                    df.warnings
                        .push(at("FROM --platform ignored (linux/amd64 is used)".into()));
                }
                df.from = image.clone();
                df.steps.push(step("USER", vec!["root".into()]));
                df.steps.push(step("WORKDIR", vec!["/".into()]));
            }
            _ if df.from.is_empty() && instr != "ARG" => {
                return Err(at(format!("{instr} before FROM")));
            }
            "ARG" => {
                for w in words(&rest) {
                    let (k, v) = match w.split_once('=') {
                        Some((k, v)) => (k.to_string(), Some(v.to_string())),
                        None => (w.clone(), None),
                    };
                    let v = build_args.get(&k).cloned().or(v);
                    match v {
                        Some(v) => {
                            let v = substitute(&v, &vars);
                            vars.insert(k.clone(), v.clone());
                            if !df.from.is_empty() {
                                df.steps.push(step("ENV", vec![k, v]));
                            }
                        }
                        None => df.warnings.push(at(format!(
                            "ARG {k} has no value (pass --build-arg {k}=…): unset"
                        ))),
                    }
                }
            }
            "RUN" => {
                if rest.starts_with("--mount")
                    || rest.starts_with("--network")
                    || rest.starts_with("--security")
                {
                    return Err(at(
                        "RUN flags (--mount, --network, --security) are not supported".into(),
                    ));
                }
                let c = match json_words(&rest) {
                    Some(w) => join_words(&w),
                    None => rest.clone(),
                };
                if c.is_empty() {
                    return Err(at("RUN needs a command".into()));
                }
                df.steps.push(step("RUN", vec![c]));
            }
            "COPY" | "ADD" => {
                let mut ws = match json_words(&rest) {
                    Some(w) => w,
                    None => words(&rest),
                };
                let mut owner = String::new();
                let mut mode = String::new();
                while ws.first().is_some_and(|w| w.starts_with("--")) {
                    let flag = ws.remove(0);
                    let (k, v) = flag.split_once('=').unwrap_or((flag.as_str(), ""));
                    match k {
                        "--chown" => owner = substitute(v, &vars),
                        "--chmod" => {
                            let m = u32::from_str_radix(v, 8)
                                .map_err(|_| at(format!("--chmod={v} is not an octal mode")))?;
                            mode = format!("{m:04o}");
                        }
                        "--from" => {
                            return Err(at(
                                "COPY --from (multi-stage builds) is not supported".into()
                            ));
                        }
                        "--link" | "--parents" => {
                            df.warnings.push(at(format!("{k} ignored")));
                        }
                        other => return Err(at(format!("{instr} {other} is not supported"))),
                    }
                }
                if ws.len() < 2 {
                    return Err(at(format!("{instr} needs a source and a destination")));
                }
                let dest = substitute(&ws.pop().unwrap_or_default(), &vars);
                for src in ws {
                    let src = substitute(&src, &vars);
                    if instr == "ADD" && (src.contains("://") || src.starts_with("git@")) {
                        return Err(at(format!("ADD {src}: only local files can be added")));
                    }
                    df.steps.push(step(
                        "COPY",
                        vec![src, dest.clone(), owner.clone(), mode.clone()],
                    ));
                }
            }
            "ENV" => {
                let sub = substitute(&rest, &vars);
                let ws = words(&sub);
                let pairs: Vec<(String, String)> = if ws.first().is_some_and(|w| w.contains('=')) {
                    ws.iter()
                        .map(|w| match w.split_once('=') {
                            Some((k, v)) => Ok((k.to_string(), v.to_string())),
                            None => Err(at(format!("ENV {w}: expected KEY=VALUE"))),
                        })
                        .collect::<Result<_, _>>()?
                } else {
                    // Legacy `ENV KEY value with spaces`.
                    let (k, v) = sub
                        .split_once(char::is_whitespace)
                        .ok_or_else(|| at("ENV needs KEY=VALUE".into()))?;
                    vec![(k.to_string(), v.trim().to_string())]
                };
                let mut args = Vec::new();
                for (k, v) in pairs {
                    vars.insert(k.clone(), v.clone());
                    args.push(k);
                    args.push(v);
                }
                df.steps.push(step("ENV", args));
            }
            "WORKDIR" => {
                let p = substitute(&rest, &vars);
                if p.is_empty() {
                    return Err(at("WORKDIR needs a path".into()));
                }
                set_workdir = true;
                df.steps.push(step("WORKDIR", vec![p]));
            }
            "USER" => {
                let u = substitute(&rest, &vars);
                if u.is_empty() {
                    return Err(at("USER needs a user".into()));
                }
                set_user = true;
                df.steps.push(step("USER", vec![u]));
            }
            "CMD" | "ENTRYPOINT" => {
                let c = match json_words(&rest) {
                    Some(w) => join_words(&w),
                    None => rest.clone(),
                };
                if instr == "CMD" {
                    cmd = Some(c);
                } else {
                    entrypoint = Some(c);
                }
            }
            "EXPOSE" | "LABEL" | "MAINTAINER" | "STOPSIGNAL" | "VOLUME" | "HEALTHCHECK" => {
                df.warnings.push(at(format!("{instr} ignored")));
            }
            "SHELL" | "ONBUILD" => {
                return Err(at(format!("{instr} is not supported")));
            }
            other => return Err(at(format!("unknown instruction {other}"))),
        }
    }
    if df.from.is_empty() {
        return Err("Dockerfile has no FROM".into());
    }
    df.start_cmd = match (entrypoint, cmd) {
        (Some(e), Some(c)) => Some(format!("{e} {c}")),
        (Some(e), None) => Some(e),
        (None, Some(c)) => Some(c),
        (None, None) => None,
    };
    if !set_user {
        df.steps.push(step("USER", vec!["user".into()]));
    }
    if !set_workdir {
        df.steps.push(step("WORKDIR", vec!["/home/user".into()]));
    }
    Ok(df)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(df: &Dockerfile) -> Vec<String> {
        df.steps
            .iter()
            .map(|s| format!("{} {}", s.kind, s.args.join("|")))
            .collect()
    }

    #[test]
    fn converts_like_the_sdk() {
        let text = "# syntax=docker/dockerfile:1\nARG V=3\nFROM python:${V}-slim\n\
            ENV A=1 B=\"two words\"\nENV C legacy value\nRUN apt-get update && \\\n    apt-get install -y curl\n\
            COPY --chown=user:user --chmod=755 a.txt b/ /app/\nADD c.txt /app/c.txt\nWORKDIR /app\n\
            RUN [\"echo\", \"hi there\"]\nEXPOSE 8000\nCMD [\"python\", \"-m\", \"http.server\"]\n";
        let df = parse(text, &BTreeMap::new()).unwrap();
        assert_eq!(df.from, "python:3-slim");
        assert_eq!(
            kinds(&df),
            vec![
                "USER root",
                "WORKDIR /",
                "ENV A|1|B|two words",
                "ENV C|legacy value",
                "RUN apt-get update &&      apt-get install -y curl",
                "COPY a.txt|/app/|user:user|0755",
                "COPY b/|/app/|user:user|0755",
                "COPY c.txt|/app/c.txt||",
                "WORKDIR /app",
                "RUN echo 'hi there'",
                "USER user",
            ]
        );
        assert_eq!(df.start_cmd.as_deref(), Some("python -m http.server"));
        assert_eq!(df.warnings.len(), 1);
        assert_eq!(df.copy_sources().len(), 3);
    }

    #[test]
    fn build_args_and_substitution() {
        let mut args = BTreeMap::new();
        args.insert("TAG".to_string(), "2".to_string());
        let df = parse(
            "ARG TAG=1\nFROM img:$TAG\nARG DIR=/srv\nWORKDIR ${DIR:-/x}/app\n",
            &args,
        )
        .unwrap();
        assert_eq!(df.from, "img:2");
        assert!(kinds(&df).contains(&"WORKDIR /srv/app".to_string()));
        assert!(!kinds(&df).contains(&"WORKDIR /home/user".to_string()));
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        for (text, want) in [
            ("FROM a AS b\nFROM c\n", "multi-stage"),
            ("FROM a\nCOPY --from=b /x /y\n", "--from"),
            ("FROM a\nADD https://x/y.tgz /y\n", "only local files"),
            ("FROM a\nRUN <<EOF\necho\nEOF\n", "heredocs"),
            ("FROM a\nSHELL [\"/bin/bash\", \"-c\"]\n", "SHELL"),
            ("FROM a\nFROBNICATE x\n", "unknown instruction"),
            ("RUN x\n", "before FROM"),
            ("", "no FROM"),
            ("FROM a\nRUN --mount=type=cache,target=/x true\n", "--mount"),
        ] {
            let e = parse(text, &BTreeMap::new()).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
