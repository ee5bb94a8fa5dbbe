//! Building eBPF objects from a build script, so binaries carry their handlers.
//!
//! A crate whose binaries need handler objects (MICA's, the B-tree's, the examples, the XDP
//! eSwitch) calls [`object_for_build_script`] from its `build.rs` and includes the result with
//! `include_bytes!(concat!(env!("OUT_DIR"), "/<name>.o"))`. The toolchain is then needed only
//! where the binaries are built; a copied binary runs anywhere and verifies what it carries when
//! it starts.

use std::path::{Path, PathBuf};

use crate::{build_object, BuildError, BuildOptions};

/// Builds the crate in `crate_dir` into `$OUT_DIR/<name>.o` and prints the `cargo:` lines a build
/// script needs: rerun when any source the object was built from changes (cargo's dep-info
/// lists them, path dependencies included), or when `NAAM_BPF_LINKER` does; bpf-linker's warnings
/// as cargo warnings. Fails with the build's error; a build script should panic with it so cargo
/// shows the message.
pub fn object_for_build_script(crate_dir: &Path, name: &str) -> Result<PathBuf, BuildError> {
    let out_dir = std::env::var_os("OUT_DIR")
        .map(PathBuf::from)
        .ok_or_else(|| BuildError::Io {
            context: "reading OUT_DIR (object_for_build_script runs only in build scripts)".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
    println!("cargo:rerun-if-env-changed={}", crate::BPF_LINKER_ENV);
    println!(
        "cargo:rerun-if-changed={}",
        crate_dir.join("Cargo.toml").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        crate_dir.join("Cargo.lock").display()
    );
    let mut opts = BuildOptions::new(crate_dir);
    // Inside OUT_DIR: cargo owns that directory, and nested builds stay incremental per profile.
    opts.target_dir = Some(out_dir.join("handler-target"));
    opts.out = Some(out_dir.join(format!("{name}.o")));
    let built = build_object(&opts)?;
    for source in &built.sources {
        println!("cargo:rerun-if-changed={}", source.display());
    }
    for warning in &built.linker_warnings {
        println!("cargo:warning=bpf-linker ({name}): {warning}");
    }
    Ok(built.object)
}

/// The files listed after the first `:` of a Makefile-style dep-info file (`\ ` escapes a
/// space in a path).
pub fn dep_info_sources(dep_info: &str) -> Vec<PathBuf> {
    let Some(first) = dep_info.lines().find(|l| !l.trim().is_empty()) else {
        return Vec::new();
    };
    // The target path may itself contain escaped spaces, never an unescaped `: `.
    let Some(split) = first
        .find(": ")
        .or_else(|| first.strip_suffix(':').map(|t| t.len()))
    else {
        return Vec::new();
    };
    let deps = &first[(split + 1).min(first.len())..];
    let mut sources = Vec::new();
    let mut current = String::new();
    let mut chars = deps.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                current.push(' ');
                chars.next();
            }
            c if c.is_whitespace() => {
                if !current.is_empty() {
                    sources.push(PathBuf::from(std::mem::take(&mut current)));
                }
            }
            c => current.push(c),
        }
    }
    if !current.is_empty() {
        sources.push(PathBuf::from(current));
    }
    sources
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dep_info_lists_sources_with_escaped_spaces() {
        let text = "/t/lib x.a: /src/a.rs /my\\ dir/b.rs\n\n/src/a.rs:\n";
        assert_eq!(
            dep_info_sources(text),
            vec![PathBuf::from("/src/a.rs"), PathBuf::from("/my dir/b.rs")]
        );
        assert!(dep_info_sources("").is_empty());
        assert!(dep_info_sources("/t/lib.a:").is_empty());
    }
}
