//! Link options of the `cubicle` binary.
//!
//! Compact relative relocations (DT_RELR, glibc ≥ 2.36, binutils ≥ 2.38): the binary
//! is position-independent and holds about 50,000 pointers to itself, which the dynamic
//! loader fixes up at every start. As RELA entries that is 1.2 MB to page in and walk at
//! every start — and the node starts this binary again for every sandbox (the sandbox
//! helper, `runtime/src/helper.rs`). As RELR the same fixes take a few kilobytes.
fn main() {
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
}
