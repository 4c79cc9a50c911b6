//! Sandbox ids (`i` + 20 random lowercase alphanumerics, like E2B) and access tokens.

use rand::Rng;

const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// `n` random characters of `[a-z0-9]`.
pub fn random_suffix(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// A new sandbox id: `i` + 20 random lowercase alphanumerics.
pub fn new_sandbox_id() -> String {
    format!("i{}", random_suffix(20))
}

/// A new envd access token (32 random alphanumerics).
pub fn new_access_token() -> String {
    random_suffix(32)
}

/// Whether `id` is a valid sandbox id (`^[a-z0-9]{1,32}$`: it names cgroups and
/// directories).
pub fn is_valid_sandbox_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 32
        && id
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_valid_and_distinct() {
        let a = new_sandbox_id();
        let b = new_sandbox_id();
        assert_eq!(a.len(), 21);
        assert!(a.starts_with('i'));
        assert!(is_valid_sandbox_id(&a));
        assert_ne!(a, b);
        assert!(!is_valid_sandbox_id("I-x"));
        assert!(!is_valid_sandbox_id(""));
        assert!(!is_valid_sandbox_id("../a"));
    }
}
