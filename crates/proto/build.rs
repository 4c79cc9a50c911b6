//! Compiles our .proto files with `protox` (pure Rust, no system `protoc`), generates
//! prost message types, and proto3-JSON serde impls with pbjson (camelCase output, both
//! spellings accepted, enums by name, int64 as strings, bytes as base64).
use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/process/process.proto",
        "proto/filesystem/filesystem.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let out = PathBuf::from(env::var("OUT_DIR")?);
    let descriptors = protox::compile(files, ["proto"])?;
    let set_path = out.join("descriptors.bin");
    std::fs::write(&set_path, prost::Message::encode_to_vec(&descriptors))?;

    let mut cfg = prost_build::Config::new();
    cfg.file_descriptor_set_path(&set_path)
        .skip_protoc_run()
        .compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types");
    cfg.compile_protos(&files, &["proto"])?;

    let set = std::fs::read(&set_path)?;
    pbjson_build::Builder::new()
        .register_descriptors(&set)?
        // Connect-go's JSON codec discards unknown fields; so do we (forward compatible
        // with newer SDKs that add fields).
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    Ok(())
}
