//! New sandbox ids (`i` + 20 random lowercase alphanumerics, like E2B; the rule every id
//! follows is [`SandboxId`](cubicle_runtime::SandboxId)) and access tokens.

use cubicle_runtime::SandboxId;
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
pub fn new_sandbox_id() -> SandboxId {
    // Always valid: 21 characters of [a-z0-9].
    SandboxId::parse(&format!("i{}", random_suffix(20))).unwrap_or_else(|_| unreachable!())
}

/// A new envd access token (32 random alphanumerics).
pub fn new_access_token() -> String {
    random_suffix(32)
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
        assert!(SandboxId::is_valid(&a));
        assert_ne!(a, b);
    }
}
