//! How list commands print: `--format table` (aligned columns, for people) or
//! `--format json` (for scripts; `--json` is kept as its short form). Every command that
//! lists something flattens [`FormatArg`].

use clap::{Args, ValueEnum};

/// Output format of a list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns with a header line.
    #[default]
    Table,
    /// JSON (the server's fields, unchanged where there is a server).
    Json,
}

/// `--format table|json` (and `--json`).
#[derive(Args, Debug, Clone, Default)]
pub struct FormatArg {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Same as `--format json`.
    #[arg(long)]
    pub json: bool,
}

impl FormatArg {
    /// Whether JSON was asked for.
    pub fn is_json(&self) -> bool {
        self.json || self.format == Format::Json
    }
}

/// Rows as aligned columns (two spaces apart; the last column is not padded).
pub fn table<const N: usize>(
    header: [&str; N],
    rows: impl IntoIterator<Item = [String; N]>,
) -> String {
    let mut all = vec![header.map(str::to_string)];
    all.extend(rows);
    let mut widths = [0usize; N];
    for r in &all {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &all {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i + 1 == N {
                line.push_str(c);
            } else {
                let pad = widths[i] - c.chars().count();
                line.push_str(c);
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Pretty JSON with a trailing newline.
pub fn json<T: serde::Serialize>(v: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(v)? + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_json_is_chosen_either_way() {
        let t = table(
            ["A", "LONG"],
            [
                ["xyz".to_string(), "1".to_string()],
                ["q".into(), "".into()],
            ],
        );
        assert_eq!(t, "A    LONG\nxyz  1\nq\n");
        let f = FormatArg {
            format: Format::Table,
            json: true,
        };
        assert!(f.is_json());
        assert!(
            FormatArg {
                format: Format::Json,
                json: false
            }
            .is_json()
        );
        assert!(!FormatArg::default().is_json());
    }
}
