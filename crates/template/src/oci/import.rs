//! Import an image from local files: an OCI image layout (a directory with `oci-layout`
//! and `index.json`, as `skopeo copy … oci:DIR` or `umoci` write it), a `docker save`
//! archive, or either one packed as a tar file. Layers go into the layer store like pulled
//! ones (diff ids checked).

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{Image, ImageConfig, hex_digest, store_layer_blob};
use crate::TemplateStore;
use crate::error::{Error, Result};

fn broken(m: impl Into<String>) -> Error {
    Error::BrokenImage(m.into())
}

fn read_json(path: &Path) -> Result<Value> {
    let data = fs::read(path).map_err(|e| Error::io("read", path, e))?;
    serde_json::from_slice(&data).map_err(|e| broken(format!("{}: {e}", path.display())))
}

/// A blob of an OCI layout by digest.
fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf> {
    let p = dir.join("blobs/sha256").join(hex_digest(digest)?);
    if p.is_file() {
        Ok(p)
    } else {
        Err(broken(format!(
            "blob {digest} missing from {}",
            dir.display()
        )))
    }
}

/// A path named inside an archive's manifest, kept inside `dir`.
fn inside(dir: &Path, rel: &str) -> Result<PathBuf> {
    let rel = Path::new(rel);
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(broken(format!(
            "path '{}' leaves the archive",
            rel.display()
        )));
    }
    Ok(dir.join(rel))
}

/// Pick the manifest descriptor of an index: the one named `want` (annotation
/// `org.opencontainers.image.ref.name`), else linux/amd64, else the only one.
fn pick<'a>(manifests: &'a [Value], want: Option<&str>) -> Result<&'a Value> {
    let name = |m: &Value| {
        m.pointer("/annotations/org.opencontainers.image.ref.name")
            .and_then(Value::as_str)
            .map(String::from)
    };
    if let Some(w) = want {
        return manifests
            .iter()
            .find(|m| name(m).as_deref() == Some(w))
            .ok_or_else(|| {
                let names: Vec<_> = manifests.iter().filter_map(name).collect();
                broken(format!(
                    "no image named '{w}' in the layout (it has: {})",
                    names.join(", ")
                ))
            });
    }
    let amd64 = manifests.iter().find(|m| {
        m.pointer("/platform/architecture").and_then(Value::as_str) == Some("amd64")
            && m.pointer("/platform/os").and_then(Value::as_str) == Some("linux")
    });
    match (amd64, manifests) {
        (Some(m), _) => Ok(m),
        (None, [one]) => Ok(one),
        (None, []) => Err(broken("the image index lists no manifest")),
        (None, _) => Err(broken(
            "the layout holds several images: name one (cubicle template import PATH --ref NAME)",
        )),
    }
}

/// Import from an OCI layout directory.
fn from_oci_layout(
    store: &TemplateStore,
    dir: &Path,
    want: Option<&str>,
    label: &str,
) -> Result<Image> {
    let mut desc = {
        let index = read_json(&dir.join("index.json"))?;
        let manifests = index
            .get("manifests")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        pick(&manifests, want)?.clone()
    };
    // Nested indexes (a multi-platform image): follow to a platform manifest.
    for _ in 0..4 {
        let media = desc.get("mediaType").and_then(Value::as_str).unwrap_or("");
        if !media.contains("index") && !media.contains("manifest.list") {
            break;
        }
        let digest = desc.get("digest").and_then(Value::as_str).unwrap_or("");
        let inner = read_json(&blob_path(dir, digest)?)?;
        let manifests = inner
            .get("manifests")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        desc = pick(&manifests, None)?.clone();
    }
    let digest = desc
        .get("digest")
        .and_then(Value::as_str)
        .ok_or_else(|| broken("manifest descriptor without a digest"))?;
    let manifest = read_json(&blob_path(dir, digest)?)?;
    let config_digest = manifest
        .pointer("/config/digest")
        .and_then(Value::as_str)
        .ok_or_else(|| broken("manifest without a config"))?;
    let config_bytes =
        fs::read(blob_path(dir, config_digest)?).map_err(|e| Error::io("read", dir, e))?;
    let config = ImageConfig::parse(&config_bytes)?;
    let layer_digests: Vec<String> = manifest
        .get("layers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|l| l.get("digest").and_then(Value::as_str).map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if layer_digests.len() != config.diff_ids.len() {
        return Err(broken(format!(
            "the manifest has {} layers, the config {}",
            layer_digests.len(),
            config.diff_ids.len()
        )));
    }
    for (d, diff_id) in layer_digests.iter().zip(&config.diff_ids) {
        let f = fs::File::open(blob_path(dir, d)?).map_err(|e| Error::io("open", dir, e))?;
        store_layer_blob(
            store.layers(),
            f,
            diff_id,
            &format!("import {label} layer {d}"),
        )?;
    }
    Ok(Image {
        reference: label.to_string(),
        layers: config.diff_ids.clone(),
        config,
    })
}

/// Import from an extracted `docker save` archive (`manifest.json`).
fn from_docker_save(
    store: &TemplateStore,
    dir: &Path,
    want: Option<&str>,
    label: &str,
) -> Result<Image> {
    let m = read_json(&dir.join("manifest.json"))?;
    let entries = m.as_array().cloned().unwrap_or_default();
    let tags = |e: &Value| -> Vec<String> {
        e.get("RepoTags")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    let entry = match want {
        Some(w) => entries
            .iter()
            .find(|e| tags(e).iter().any(|t| t == w))
            .ok_or_else(|| broken(format!("no image tagged '{w}' in the archive")))?,
        None => match entries.as_slice() {
            [one] => one,
            [] => return Err(broken("manifest.json lists no image")),
            _ => {
                return Err(broken(
                    "the archive holds several images: name one (cubicle template import PATH --ref REPO:TAG)",
                ));
            }
        },
    };
    let config_rel = entry
        .get("Config")
        .and_then(Value::as_str)
        .ok_or_else(|| broken("manifest.json entry without Config"))?;
    let config_bytes = fs::read(inside(dir, config_rel)?).map_err(|e| Error::io("read", dir, e))?;
    let config = ImageConfig::parse(&config_bytes)?;
    let layers: Vec<String> = entry
        .get("Layers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    if layers.len() != config.diff_ids.len() {
        return Err(broken(format!(
            "manifest.json lists {} layers, the config {}",
            layers.len(),
            config.diff_ids.len()
        )));
    }
    for (rel, diff_id) in layers.iter().zip(&config.diff_ids) {
        let f = fs::File::open(inside(dir, rel)?).map_err(|e| Error::io("open", dir, e))?;
        store_layer_blob(
            store.layers(),
            f,
            diff_id,
            &format!("import {label} layer {rel}"),
        )?;
    }
    Ok(Image {
        reference: label.to_string(),
        layers: config.diff_ids.clone(),
        config,
    })
}

/// Import the image at `path` (directory or tar file). `want` names one image when the
/// layout or archive holds several. Blocking.
pub fn import(store: &TemplateStore, path: &Path, want: Option<&str>) -> Result<Image> {
    let label = path.display().to_string();
    let meta = fs::metadata(path).map_err(|e| Error::io("stat", path, e))?;
    if meta.is_dir() {
        return from_dir(store, path, want, &label);
    }
    // A tar file: unpack it next to the layers (same filesystem, removed afterwards).
    let scratch = store.layers().staging()?;
    let f = fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(f));
    archive
        .unpack(scratch.path())
        .map_err(|e| broken(format!("{label} is not a readable tar archive: {e}")))?;
    let r = from_dir(store, scratch.path(), want, &label);
    drop(scratch);
    r
}

fn from_dir(store: &TemplateStore, dir: &Path, want: Option<&str>, label: &str) -> Result<Image> {
    if dir.join("index.json").is_file() {
        from_oci_layout(store, dir, want, label)
    } else if dir.join("manifest.json").is_file() {
        from_docker_save(store, dir, want, label)
    } else {
        Err(broken(format!(
            "{label} is neither an OCI layout (index.json) nor a docker save archive (manifest.json)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsutil;
    use sha2::{Digest, Sha256};

    fn put_blob(dir: &Path, data: &[u8]) -> String {
        let h = crate::layer::hex(&Sha256::digest(data));
        fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        fs::write(dir.join("blobs/sha256").join(&h), data).unwrap();
        format!("sha256:{h}")
    }

    #[test]
    fn imports_an_oci_layout_and_refuses_a_broken_one() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: unpacking sets owners and needs root");
            return;
        }
        let root = std::env::temp_dir().join(format!("cubicle-import-{}", std::process::id()));
        let _ = fsutil::remove_tree(&root);
        let (state, layout) = (root.join("state"), root.join("layout"));
        fs::create_dir_all(&layout).unwrap();
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o755);
        b.append_data(&mut h, "bin/hello", &b"hi\n"[..]).unwrap();
        let layer = b.into_inner().unwrap();
        let diff = crate::layer::hex(&Sha256::digest(&layer));
        let layer_d = put_blob(&layout, &layer);
        let config = format!(
            r#"{{"config":{{"Env":["PATH=/bin"]}},"rootfs":{{"type":"layers","diff_ids":["sha256:{diff}"]}}}}"#
        );
        let config_d = put_blob(&layout, config.as_bytes());
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"digest":"{config_d}","size":1}},"layers":[{{"digest":"{layer_d}","size":1}}]}}"#
        );
        let manifest_d = put_blob(&layout, manifest.as_bytes());
        fs::write(
            layout.join("oci-layout"),
            r#"{"imageLayoutVersion":"1.0.0"}"#,
        )
        .unwrap();
        fs::write(
            layout.join("index.json"),
            format!(r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{manifest_d}","size":1,"annotations":{{"org.opencontainers.image.ref.name":"v1"}}}}]}}"#),
        )
        .unwrap();
        let store = TemplateStore::open(&state).unwrap();
        let img = import(&store, &layout, None).unwrap();
        assert_eq!(img.layers, vec![diff.clone()]);
        assert_eq!(img.config.env["PATH"], "/bin");
        assert!(store.layers().path(&diff).join("bin/hello").is_file());
        assert!(import(&store, &layout, Some("v2")).is_err());
        // A layer whose content does not match the config's diff id.
        fs::write(layout.join("blobs/sha256").join(&layer_d[7..]), b"garbage").unwrap();
        store.layers().remove(&diff).unwrap();
        let e = import(&store, &layout, None).unwrap_err();
        assert!(matches!(e, Error::BrokenImage(_)), "{e}");
        fsutil::remove_tree(&root).unwrap();
    }
}
