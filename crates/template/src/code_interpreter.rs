//! The `code-interpreter-v1` template (the E2B code-interpreter SDK's default): the
//! `base` template plus a Python virtualenv with Jupyter kernels and the data stack, and
//! `cubicle-interpreter` (E2B's port-49999 code-interpreter API) as its start command.
//!
//! Steps: copy `base`'s rootfs (`cp -a --reflink=auto`), `apt-get install` [`APT_PACKAGES`]
//! (R with IRkernel, whose kernelspec lands in `/usr/share/jupyter/kernels/ir`, and
//! Debian's JDK for Java), `python3 -m venv` at [`VENV`] and `pip install`
//! [`PIP_PACKAGES`] inside a private chroot (Debian's mirror and PyPI must be reachable),
//! register the kernels (`bash_kernel`; ipykernel as `python3-ipykernel`; `jjava` installs
//! its own spec into the venv, its jar included, so nothing is fetched at run time), install
//! Cubicle's own Python kernel ([`KERNEL_PY`], `cubicle_kernel` in the venv's
//! site-packages) as the `python3` kernelspec, `npm install -g deno`
//! (JavaScript/TypeScript via `deno jupyter --kernel`), and copy the statically
//! linked `cubicle-interpreter` binary into `/usr/local/bin`.
//!
//! The start command runs the interpreter as root (E2B's kernels run as root: a context
//! may use any `cwd`), and the template is poolable with any env vars (`late_env`: the
//! interpreter takes them from envd). The binary is copied at
//! build time, so after changing the interpreter rebuild the template
//! (`cubicle template build code-interpreter-v1 --force`). The binary is found like
//! envd: `$CUBICLE_INTERPRETER_BIN`, else next to the running executable or in the
//! static-target dir of a cargo build (`scripts/build-envd.sh` builds both).
//! Readiness: [`READY_PORT`] must answer `GET /health` (see `TemplateConfig::ready_port`).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Progress, TemplateConfig};
use crate::error::{Error, IoContext, Result};

/// Template name.
pub const NAME: &str = "code-interpreter-v1";
/// The interpreter's binary name.
pub const BIN_NAME: &str = "cubicle-interpreter";
/// Where the Python environment lives inside the rootfs.
pub const VENV: &str = "/opt/cubicle/venv";
/// Where the node bind-mounts the host's current interpreter binary (read-only) in
/// sandboxes of this template, so a cached template never runs a stale interpreter; the
/// copy in `/usr/local/bin` (made at build time) is the fallback.
pub const MOUNT_POINT: &str = "/run/cubicle/interpreter";
/// Builder tag of templates made here (`TemplateConfig::builder`).
pub const BUILDER: &str = "code-interpreter/5";
/// Cubicle's Python kernel (one file, pyzmq + IPython's `InteractiveShell`, see
/// docs/interpreter.md): module `cubicle_kernel` in the venv, kernelspec `python3`.
pub const KERNEL_PY: &str = include_str!("../../interpreter/python/cubicle_kernel.py");
/// Kernelspec name of ipykernel, kept installed as the fallback Python kernel
/// (`cubicle-interpreter --kernel python3-ipykernel` selects it).
pub const IPYKERNEL_SPEC: &str = "python3-ipykernel";
/// The interpreter's port (E2B's).
pub const READY_PORT: u16 = 49999;
/// Deno (npm package `deno`), whose `deno jupyter --kernel` runs JavaScript/TypeScript.
pub const DENO_VERSION: &str = "2.9.6";
/// Python packages installed into the venv (kept small: CI builds this from scratch).
/// pandas and matplotlib stay on the series E2B's image pins (2.2, 3.10): code written
/// for E2B (e.g. `boxplot(labels=…)`, removed in matplotlib 3.11) runs unchanged.
pub const PIP_PACKAGES: &[&str] = &[
    "ipykernel",
    "bash_kernel",
    "numpy",
    "pandas==2.2.*",
    "matplotlib==3.10.*",
    "pillow",
    "e2b-charts",
    "jjava",
];
/// Debian packages: R and its Jupyter kernel, and a JDK (with `jshell`) for jjava.
pub const APT_PACKAGES: &[&str] = &["r-base-core", "r-cran-irkernel", "default-jdk-headless"];

fn fail(message: impl Into<String>) -> Error {
    Error::TemplateBuild {
        name: NAME.into(),
        message: message.into(),
    }
}

/// Find the statically linked `cubicle-interpreter`.
pub fn find_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("CUBICLE_INTERPRETER_BIN").map(PathBuf::from) {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(fail(format!(
                "CUBICLE_INTERPRETER_BIN {} does not exist",
                p.display()
            )))
        };
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("current_exe", "/proc/self/exe", e))?;
    let mut candidates = Vec::new();
    let mut dir = exe.parent().map(Path::to_path_buf);
    for _ in 0..3 {
        let Some(d) = dir else { break };
        if let (Some(profile), Some(target)) = (d.file_name(), d.parent()) {
            candidates.push(
                target
                    .join("x86_64-unknown-linux-gnu")
                    .join(profile)
                    .join(BIN_NAME),
            );
        }
        candidates.push(d.join(BIN_NAME));
        dir = d.parent().map(Path::to_path_buf);
    }
    candidates.push(PathBuf::from("/usr/local/bin").join(BIN_NAME));
    candidates
        .iter()
        .find(|p| p.is_file() && crate::fsutil::is_static_elf(p))
        .cloned()
        .ok_or_else(|| {
            fail(format!(
                "cannot find a statically linked {BIN_NAME} (looked in {}); build it with scripts/build-envd.sh or set CUBICLE_INTERPRETER_BIN",
                candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// Build the rootfs into the (empty) directory `rootfs` from the base template's rootfs.
pub fn build(rootfs: &Path, base: &super::Template, p: &Progress) -> Result<TemplateConfig> {
    let bin = find_binary()?;
    p.stages(4);
    p.stage("copying the base template");
    let st = Command::new("cp")
        .args(["-a", "--reflink=auto", "-T"])
        .arg(&base.rootfs)
        .arg(rootfs)
        .status()
        .map_err(|e| fail(format!("cp: {e}")))?;
    if !st.success() {
        return Err(fail(format!("cp -a of the base rootfs failed ({st})")));
    }

    p.stage(&format!(
        "apt-get install {}; pip install {}",
        APT_PACKAGES.join(" "),
        PIP_PACKAGES.join(" ")
    ));
    let script = format!(
        "chroot \"$R\" apt-get update -q\n\
         DEBIAN_FRONTEND=noninteractive chroot \"$R\" apt-get install -y -q --no-install-recommends {apt}\n\
         chroot \"$R\" apt-get clean\n\
         rm -rf \"$R\"/var/lib/apt/lists/*\n\
         chroot \"$R\" python3 -m venv {VENV}\n\
         chroot \"$R\" {VENV}/bin/pip install --no-cache-dir --disable-pip-version-check -q {pkgs}\n\
         chroot \"$R\" {VENV}/bin/python -m ipykernel install --prefix {VENV} --name {IPYKERNEL_SPEC} >/dev/null\n\
         chroot \"$R\" {VENV}/bin/python -m bash_kernel.install --prefix {VENV} >/dev/null\n\
         chroot \"$R\" {VENV}/bin/python -c 'import matplotlib.pyplot, pandas, numpy, PIL.Image, e2b_charts'\n\
         test -f \"$R\"{VENV}/share/jupyter/kernels/java/kernel.json\n\
         test -f \"$R\"/usr/share/jupyter/kernels/ir/kernel.json\n\
         chroot \"$R\" Rscript -e 'library(IRkernel)'\n\
         chroot \"$R\" jshell --version\n\
         chroot \"$R\" npm install -g --no-audit --no-fund --loglevel=error deno@{DENO_VERSION}\n\
         D=$(cd \"$R\" && find usr/local/lib/node_modules -path '*@deno/linux-x64-glibc/deno' -type f | head -n1)\n\
         if [ -n \"$D\" ]; then ln -sf \"/$D\" \"$R/usr/local/bin/deno\"; fi\n\
         chroot \"$R\" /usr/local/bin/deno --version\n\
         rm -rf \"$R\"/root/.npm\n\
         rm -rf \"$R\"/root/.cache \"$R\"/tmp/*\n",
        // Quoted: version specifiers hold shell glob characters.
        pkgs = PIP_PACKAGES
            .iter()
            .map(|p| format!("'{p}'"))
            .collect::<Vec<_>>()
            .join(" "),
        apt = APT_PACKAGES.join(" ")
    );
    // The host's CA bundle (it may trust a TLS-intercepting egress proxy that the fresh
    // rootfs does not know), used for pip only and removed afterwards.
    let host_ca = Path::new("/etc/ssl/certs/ca-certificates.crt");
    let ca_in_root = rootfs.join("tmp/cubicle-host-ca.crt");
    let script = if host_ca.is_file() && fs::copy(host_ca, &ca_in_root).is_ok() {
        format!(
            "export PIP_CERT=/tmp/cubicle-host-ca.crt REQUESTS_CA_BUNDLE=/tmp/cubicle-host-ca.crt SSL_CERT_FILE=/tmp/cubicle-host-ca.crt NODE_EXTRA_CA_CERTS=/tmp/cubicle-host-ca.crt\n{script}"
        )
    } else {
        script
    };
    let r = super::base::in_private_chroot(rootfs, &script, "pip install", p);
    let _ = fs::remove_file(&ca_in_root);
    r.map_err(|e| match e {
        Error::TemplateBuild { message, .. } => fail(message),
        other => other,
    })?;

    install_kernel(rootfs)?;

    p.stage("installing cubicle-interpreter");
    let dest = rootfs.join("usr/local/bin").join(BIN_NAME);
    fs::copy(&bin, &dest).ctx("copy", &dest)?;
    fs::set_permissions(&dest, fs::Permissions::from_mode(0o755)).ctx("chmod", &dest)?;

    p.stage("writing config");
    let mut cfg = base.config.clone();
    cfg.name = NAME.into();
    cfg.builder = BUILDER.into();
    cfg.memory_mb = cfg.memory_mb.max(1024);
    // E2B's code-interpreter template sets its workdir: commands without a cwd start in
    // /home/user whoever runs them (relative paths still follow the user's home).
    cfg.default_workdir = Some("/home/user".into());
    let path =
        cfg.env.get("PATH").cloned().unwrap_or_else(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        });
    cfg.env.insert("PATH".into(), format!("{VENV}/bin:{path}"));
    cfg.start_command = Some(format!(
        "I={MOUNT_POINT}; [ -x $I ] || I=/usr/local/bin/{BIN_NAME}; exec $I --port {READY_PORT} --python {VENV}/bin/python --deno /usr/local/bin/deno >/tmp/cubicle-interpreter.log 2>&1"
    ));
    cfg.start_user = Some("root".into());
    cfg.late_env = true;
    cfg.ready_port = Some(READY_PORT);
    Ok(cfg)
}

/// Install [`KERNEL_PY`] into the venv's site-packages and register it as the `python3`
/// kernelspec (ipykernel's is [`IPYKERNEL_SPEC`]; the interpreter takes the first spec of a
/// language in name order, so `python3` wins).
fn install_kernel(rootfs: &Path) -> Result<()> {
    let lib = rootfs.join(VENV.trim_start_matches('/')).join("lib");
    let site = fs::read_dir(&lib)
        .ctx("read_dir", &lib)?
        .flatten()
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.is_dir())
        .ok_or_else(|| fail(format!("no site-packages under {}", lib.display())))?;
    let module = site.join("cubicle_kernel.py");
    fs::write(&module, KERNEL_PY).ctx("write", &module)?;
    let spec_dir = rootfs
        .join(VENV.trim_start_matches('/'))
        .join("share/jupyter/kernels/python3");
    fs::create_dir_all(&spec_dir).ctx("mkdir", &spec_dir)?;
    let spec = serde_json::json!({
        "argv": [format!("{VENV}/bin/python"), "-m", "cubicle_kernel", "-f", "{connection_file}"],
        "display_name": "Python 3 (cubicle_kernel)",
        "language": "python",
        "interrupt_mode": "signal",
    });
    let path = spec_dir.join("kernel.json");
    fs::write(&path, format!("{spec:#}\n")).ctx("write", &path)?;
    Ok(())
}

/// The bind mount (host binary → [`MOUNT_POINT`], read-only) for a sandbox of a template
/// built here; `None` for other templates or when no static binary is found (the
/// template's own copy is used then).
pub fn bind_for(config: &TemplateConfig) -> Option<(PathBuf, PathBuf, bool)> {
    if !config.builder.starts_with("code-interpreter/") {
        return None;
    }
    match find_binary() {
        Ok(p) => Some((p, PathBuf::from(MOUNT_POINT), true)),
        Err(e) => {
            tracing::warn!("using the template's own cubicle-interpreter: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_only_for_code_interpreter_templates() {
        let base = TemplateConfig::with_defaults("base", "base/1");
        assert_eq!(bind_for(&base), None);
        let mut ci = TemplateConfig::with_defaults(NAME, BUILDER);
        ci.builder = BUILDER.into();
        if let Some((src, dst, ro)) = bind_for(&ci) {
            assert_eq!(dst, PathBuf::from(MOUNT_POINT));
            assert!(ro && crate::fsutil::is_static_elf(&src));
        }
    }
}
