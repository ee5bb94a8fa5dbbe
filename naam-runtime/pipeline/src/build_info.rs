//! What a binary says of its own build (`--version`), computed by build scripts.

use std::path::Path;
use std::process::Command;

/// Sets `NAAM_GIT_COMMIT` for the crate being built: the checkout's commit (12 hex digits,
/// `-dirty` when tracked files differ from it), or `unknown` outside a git checkout; and asks
/// cargo to run the build script again when the checkout moves to another commit.
pub fn emit_git_commit() {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(&dir)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).map(|c| {
        let dirty =
            git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        if dirty {
            format!("{c}-dirty")
        } else {
            c
        }
    });
    println!(
        "cargo:rustc-env=NAAM_GIT_COMMIT={}",
        commit.as_deref().unwrap_or("unknown")
    );
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let git_dir = Path::new(&git_dir);
        println!("cargo:rerun-if-changed={}", git_dir.join("HEAD").display());
        if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!(
                "cargo:rerun-if-changed={}",
                git_dir.join(reference).display()
            );
        }
    }
    println!("cargo:rerun-if-env-changed=NAAM_GIT_COMMIT");
}
