//! The destination path of a multipart upload part.
//!
//! The SDKs put the **full destination path** in the part's `filename` parameter
//! (`form-data; name="file"; filename="/home/user/a.txt"`), encoded the way HTML5 forms
//! encode names: httpx writes `"` as `%22`, control characters as `%XX` and `\` as `\\`;
//! undici writes `"`, CR and LF as `%22`, `%0D`, `%0A`. We parse the header ourselves
//! (quoted-string with `\\`/`\"` escapes, or a bare token), undo exactly those
//! percent-escapes (`%22` and `%00`–`%1F`; a literal `%` is never escaped by these
//! encoders, so other `%XX` stay as they are), and fall back to RFC 5987 `filename*`.

/// The decoded `filename` of a `Content-Disposition` header value, if any.
pub(crate) fn filename(content_disposition: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(content_disposition).ok()?;
    let params = parse_params(text);
    if let Some((_, v)) = params.iter().find(|(k, _)| k == "filename") {
        return Some(html5_decode(v));
    }
    let (_, ext) = params.iter().find(|(k, _)| k == "filename*")?;
    decode_ext_value(ext)
}

/// `type; k=v; k="quoted"` → `[(k lowercased, v unescaped)]`.
fn parse_params(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    // Skip the disposition type.
    let mut i = match text.find(';') {
        Some(p) => p + 1,
        None => return out,
    };
    while i < bytes.len() {
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t' || bytes[i] == b';') {
            i += 1;
        }
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && bytes[i] != b';' {
            i += 1;
        }
        let key = text[key_start..i].trim().to_ascii_lowercase();
        if i >= bytes.len() || bytes[i] == b';' {
            continue;
        }
        i += 1; // '='
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t') {
            i += 1;
        }
        let mut value = String::new();
        if i < bytes.len() && bytes[i] == b'"' {
            i += 1;
            let mut chars = text[i..].char_indices();
            let mut end = text.len();
            while let Some((off, c)) = chars.next() {
                match c {
                    '\\' => match text[i + off + 1..].chars().next() {
                        Some(n @ ('\\' | '"')) => {
                            value.push(n);
                            chars.next();
                        }
                        _ => value.push('\\'),
                    },
                    '"' => {
                        end = i + off + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            i = end;
        } else {
            let start = i;
            while i < bytes.len() && bytes[i] != b';' {
                i += 1;
            }
            value = text[start..i].trim().to_string();
        }
        if !key.is_empty() {
            out.push((key, value));
        }
    }
    out
}

/// Undoes the HTML5 form encoding of a file name: `%22` → `"`, `%00`–`%1F` → controls.
pub(crate) fn html5_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
            && (h * 16 + l == 0x22 || h * 16 + l < 0x20)
        {
            out.push(h * 16 + l);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    // Only ASCII bytes were substituted, so the result is still UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

/// RFC 5987 `UTF-8''percent%20encoded`.
fn decode_ext_value(v: &str) -> Option<String> {
    let mut parts = v.splitn(3, '\'');
    let charset = parts.next()?;
    let _lang = parts.next()?;
    let value = parts.next()?;
    if !charset.eq_ignore_ascii_case("utf-8") {
        return None;
    }
    percent_encoding::percent_decode_str(value)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_paths_and_escapes() {
        assert_eq!(
            filename(br#"form-data; name="file"; filename="/home/user/a.txt""#).as_deref(),
            Some("/home/user/a.txt")
        );
        // httpx: quote, newline and backslash.
        assert_eq!(
            filename(br#"form-data; name="file"; filename="/tmp/a%22b%0Ac\\d.txt""#).as_deref(),
            Some("/tmp/a\"b\nc\\d.txt")
        );
        // undici leaves a lone backslash alone; a literal %41 stays.
        assert_eq!(
            filename(br#"form-data; name="file"; filename="/tmp/x\y%41%0D""#).as_deref(),
            Some("/tmp/x\\y%41\r")
        );
        // Semicolons and "filename" inside the quoted value.
        assert_eq!(
            filename(br#"form-data; name="file"; filename="/tmp/a; filename=b""#).as_deref(),
            Some("/tmp/a; filename=b")
        );
        assert_eq!(
            filename(br#"form-data; filename=/tmp/bare; name=file"#).as_deref(),
            Some("/tmp/bare")
        );
        assert_eq!(
            filename("form-data; name=\"file\"; filename*=UTF-8''%E4%BD%A0%20x".as_bytes())
                .as_deref(),
            Some("你 x")
        );
        assert_eq!(filename(br#"form-data; name="file""#), None);
        assert_eq!(
            filename(br#"form-data; name="file"; filename="/unterminated"#).as_deref(),
            Some("/unterminated")
        );
        assert_eq!(filename(b"form-data; filename=\"\xff\""), None);
        assert_eq!(html5_decode("%2"), "%2");
        assert_eq!(html5_decode("a%"), "a%");
        assert_eq!(html5_decode("%00"), "\0");
    }

    /// Random headers built from the characters that matter never panic or hang.
    #[test]
    fn never_panics() {
        let alphabet = [
            " ", ";", "=", "\"", "\\", "a", "%", "2", "f", "filename", "name", "你", "*", "'",
        ];
        for _ in 0..20_000 {
            let n = rand::random_range(0..24);
            let s: String = (0..n)
                .map(|_| alphabet[rand::random_range(0..alphabet.len())])
                .collect();
            let _ = filename(format!("form-data;{s}").as_bytes());
            let _ = html5_decode(&s);
        }
    }
}
