//! The handler build pipeline: a Rust handler crate → an eBPF object file.
//!
//! The `bpfel-unknown-none` target needs rust-src, which stable toolchains here lack, so the
//! pipeline goes through the host target (DESIGN.md section 3):
//! 1. `cargo build --release --target <host>` of the crate as a `staticlib` with
//!    `RUSTFLAGS=-C linker-plugin-lto`, so every crate's code is LLVM bitcode (the explicit
//!    `--target` keeps those flags off build scripts and proc macros);
//! 2. handler symbols are read from the archive index: unmangled symbols defined by the crate's
//!    own members;
//! 3. `bpf-linker --target bpfel --cpu v3` (or `v4`) links the bitcode into eBPF, exporting
//!    those symbols;
//! 4. the output is rejected if it has undefined symbols (bpf-linker only warns when a dependency
//!    lacks bitcode).
//!
//! The object is written only when every step passed (a failed build leaves no object behind).
//! This crate runs processes and knows nothing of NAAM's engines, so build scripts can depend on
//! it ([`embed`]); `naam_runtime::pipeline` adds the load check (ELF, relocations, verifier input).

use std::path::{Path, PathBuf};
use std::process::Command;

use object::read::archive::ArchiveFile;
use object::{Object, ObjectSymbol, SymbolSection};

pub mod build_info;
pub mod embed;

/// Environment variable naming the bpf-linker binary to use.
pub const BPF_LINKER_ENV: &str = "NAAM_BPF_LINKER";

/// Options for [`build_object`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BuildOptions {
    /// Directory of the handler crate (holding its `Cargo.toml`).
    pub crate_dir: PathBuf,
    /// Output object path; default `<target-dir>/naam/<lib>.o`.
    pub out: Option<PathBuf>,
    /// Cargo target directory; default `<crate_dir>/target`.
    pub target_dir: Option<PathBuf>,
    /// bpf-linker binary; default `$NAAM_BPF_LINKER` or `bpf-linker` on `PATH`.
    pub bpf_linker: PathBuf,
    /// Cargo binary; default `$CARGO` or `cargo`.
    pub cargo: PathBuf,
    /// eBPF instruction set LLVM targets.
    pub cpu: BpfCpu,
}

/// The eBPF instruction set version LLVM's BPF backend emits (`bpf-linker --cpu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BpfCpu {
    /// ISA v3 (the default: what every eBPF runtime, the Linux kernel's included, accepts).
    #[default]
    V3,
    /// ISA v4: adds sign-extending loads and moves, signed division, `bswap` and `ja32`
    /// (both NAAM engines implement it; denser code for some handlers).
    V4,
}

impl BpfCpu {
    /// The name bpf-linker takes.
    pub fn name(self) -> &'static str {
        match self {
            BpfCpu::V3 => "v3",
            BpfCpu::V4 => "v4",
        }
    }
}

impl std::str::FromStr for BpfCpu {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v3" => Ok(BpfCpu::V3),
            "v4" => Ok(BpfCpu::V4),
            other => Err(format!("unknown eBPF cpu `{other}` (v3, v4)")),
        }
    }
}

impl BuildOptions {
    /// Defaults for the crate in `crate_dir`.
    pub fn new(crate_dir: impl Into<PathBuf>) -> BuildOptions {
        BuildOptions {
            crate_dir: crate_dir.into(),
            out: None,
            target_dir: None,
            bpf_linker: std::env::var_os(BPF_LINKER_ENV)
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("bpf-linker")),
            cargo: std::env::var_os("CARGO")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("cargo")),
            cpu: BpfCpu::default(),
        }
    }
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// bpf-linker is not installed.
    #[error("bpf-linker not found (tried `{0}`): run scripts/setup.sh to install it, or set {BPF_LINKER_ENV}")]
    MissingBpfLinker(String),
    /// No `Cargo.toml` in the directory.
    #[error("{0} has no Cargo.toml: `naam build` takes the directory of a handler crate")]
    NoManifest(PathBuf),
    /// The crate has no staticlib target.
    #[error("crate `{0}` does not build a staticlib: set `crate-type = [\"staticlib\"]` in its [lib] section")]
    NotStaticlib(String),
    /// A tool failed.
    #[error("{tool} failed ({status}):\n{stderr}")]
    Tool {
        /// Command name.
        tool: String,
        /// Exit status.
        status: String,
        /// Captured standard error.
        stderr: String,
    },
    /// No handler symbols in the archive.
    #[error("no handlers in `{0}`: declare them with naam_ebpf::handler!")]
    NoHandlers(String),
    /// The linked object refers to symbols nobody defines.
    #[error("the eBPF object has undefined symbols: {}. A dependency without bitcode, or a call into \
             std/compiler_builtins that was not inlined; handlers may call only helpers and their own code", .0.join(", "))]
    Undefined(Vec<String>),
    /// Functions need a larger stack frame than eBPF's 512 bytes (NAAM's frame too).
    #[error("{} need more than 512 bytes of stack, eBPF's frame and NAAM's: keep large buffers \
             in a region (a descriptor), the reply or the state words, not in locals", .functions.join(", "))]
    StackTooLarge {
        /// The functions LLVM named (handlers or functions they call).
        functions: Vec<String>,
    },
    /// The linked object is not a readable ELF file.
    #[error("bpf-linker wrote an object that is not readable ELF: {0}")]
    Malformed(String),
    /// File system or process error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BuildError {
    let context = context.into();
    move |source| BuildError::Io { context, source }
}

fn run(cmd: &mut Command, tool: &str) -> Result<std::process::Output, BuildError> {
    let out = cmd.output().map_err(io(format!("running {tool}")))?;
    if !out.status.success() {
        return Err(BuildError::Tool {
            tool: tool.to_string(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(out)
}

/// Runs bpf-linker. LLVM repeats a diagnostic for every pass that meets it; a failure's
/// standard error keeps each distinct line once, and LLVM's stack-limit error (whose advice is
/// about kernel maps) becomes [`BuildError::StackTooLarge`].
fn run_linker(cmd: &mut Command) -> Result<std::process::Output, BuildError> {
    match run(cmd, "bpf-linker") {
        Err(BuildError::Tool {
            tool,
            status,
            stderr,
        }) => {
            let mut lines: Vec<&str> = Vec::new();
            let mut functions: Vec<String> = Vec::new();
            for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
                if line.contains("stack limit is exceeded") {
                    let function = line
                        .split("in function ")
                        .nth(1)
                        .and_then(|rest| rest.split_whitespace().next())
                        .unwrap_or("a function");
                    if !functions.iter().any(|f| f == function) {
                        functions.push(function.to_string());
                    }
                } else if !lines.contains(&line) {
                    lines.push(line);
                }
            }
            if !functions.is_empty() {
                return Err(BuildError::StackTooLarge { functions });
            }
            Err(BuildError::Tool {
                tool,
                status,
                stderr: lines.join("\n"),
            })
        }
        other => other,
    }
}

/// Checks that bpf-linker runs; returns its version line.
pub fn bpf_linker_version(bpf_linker: &Path) -> Result<String, BuildError> {
    match Command::new(bpf_linker).arg("--version").output() {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
        _ => Err(BuildError::MissingBpfLinker(
            bpf_linker.display().to_string(),
        )),
    }
}

fn host_triple(cargo: &Path) -> Result<String, BuildError> {
    // rustc sits beside cargo in a rustup toolchain; fall back to PATH.
    let rustc = std::env::var_os("RUSTC")
        .map(PathBuf::from)
        .unwrap_or_else(|| cargo.with_file_name("rustc"));
    let rustc = if rustc.exists() {
        rustc
    } else {
        PathBuf::from("rustc")
    };
    let out = run(Command::new(&rustc).arg("-vV"), "rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or_else(|| BuildError::Tool {
            tool: "rustc -vV".into(),
            status: "ok".into(),
            stderr: "no `host:` line".into(),
        })
}

/// Name of the crate's staticlib target, from `cargo metadata`.
fn staticlib_name(opts: &BuildOptions, manifest: &Path) -> Result<String, BuildError> {
    let out = run(
        Command::new(&opts.cargo)
            .args([
                "metadata",
                "--no-deps",
                "--format-version",
                "1",
                "--manifest-path",
            ])
            .arg(manifest),
        "cargo metadata",
    )?;
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| BuildError::Tool {
            tool: "cargo metadata".into(),
            status: "ok".into(),
            stderr: e.to_string(),
        })?;
    let package = &meta["packages"][0];
    let pkg_name = package["name"].as_str().unwrap_or("?").to_string();
    package["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| {
            t["crate_types"]
                .as_array()
                .is_some_and(|k| k.iter().any(|x| x == "staticlib"))
        })
        .and_then(|t| t["name"].as_str())
        .map(|n| n.replace('-', "_"))
        .ok_or(BuildError::NotStaticlib(pkg_name))
}

/// Unmangled symbols defined by the crate's own members of the archive: its handlers.
pub fn handler_symbols(archive: &[u8], lib_name: &str) -> Result<Vec<String>, String> {
    let ar = ArchiveFile::parse(archive).map_err(|e| e.to_string())?;
    let prefix = format!("{lib_name}-");
    let mut own_members = Vec::new();
    for member in ar.members() {
        let member = member.map_err(|e| e.to_string())?;
        if String::from_utf8_lossy(member.name()).starts_with(&prefix) {
            own_members.push(member.file_range().0);
        }
    }
    let mut names = Vec::new();
    let Some(symbols) = ar.symbols().map_err(|e| e.to_string())? else {
        return Err("the archive has no symbol index".into());
    };
    for sym in symbols {
        let sym = sym.map_err(|e| e.to_string())?;
        let name = String::from_utf8_lossy(sym.name()).into_owned();
        let member = ar.member(sym.offset()).map_err(|e| e.to_string())?;
        let mangled = name.starts_with("_R") || name.starts_with("_ZN") || name.starts_with("__");
        if !mangled && own_members.contains(&member.file_range().0) && !names.contains(&name) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Symbols an eBPF object uses without defining.
pub fn undefined_symbols(object_bytes: &[u8]) -> Result<Vec<String>, BuildError> {
    let file =
        object::File::parse(object_bytes).map_err(|e| BuildError::Malformed(e.to_string()))?;
    Ok(file
        .symbols()
        .filter(|s| s.section() == SymbolSection::Undefined)
        .filter_map(|s| s.name().ok().map(str::to_string))
        .filter(|n| !n.is_empty())
        .collect())
}

/// An eBPF object built by [`build_object`], not loaded as NAAM handlers.
#[derive(Debug)]
pub struct RawObject {
    /// Where it was written.
    pub object: PathBuf,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// bpf-linker's warnings, each distinct line once.
    pub linker_warnings: Vec<String>,
    /// The source files the object was built from (cargo's dep-info, path dependencies
    /// included): what a build script must watch.
    pub sources: Vec<PathBuf>,
}

/// Builds any `no_std` staticlib crate to an eBPF object by the same route as handlers, exporting
/// every unmangled symbol it defines, without loading it as handlers (the XDP eSwitch, which
/// the kernel loads). Fails on undefined symbols.
pub fn build_object(opts: &BuildOptions) -> Result<RawObject, BuildError> {
    bpf_linker_version(&opts.bpf_linker)?;
    let manifest = opts.crate_dir.join("Cargo.toml");
    if !manifest.is_file() {
        return Err(BuildError::NoManifest(opts.crate_dir.clone()));
    }
    let lib = staticlib_name(opts, &manifest)?;
    let triple = host_triple(&opts.cargo)?;
    let target_dir = opts
        .target_dir
        .clone()
        .unwrap_or_else(|| opts.crate_dir.join("target"));
    let mut cargo = Command::new(&opts.cargo);
    cargo
        .args([
            "build",
            "--release",
            "--lib",
            "--target",
            &triple,
            "--manifest-path",
        ])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target_dir)
        // eBPF cannot unwind: abort on panic whatever the crate's profile says (without this a
        // crate lacking `panic = "abort"` fails with advice about nightly's build-std).
        .args(["--config", "profile.release.panic=\"abort\""])
        .env("RUSTFLAGS", "-C linker-plugin-lto")
        // Flags inherited from an outer cargo (tests, coverage) must not leak into handlers.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTC_WRAPPER");
    run(&mut cargo, "cargo build (handler staticlib)")?;
    let archive_path = target_dir
        .join(&triple)
        .join("release")
        .join(format!("lib{lib}.a"));
    let archive =
        std::fs::read(&archive_path).map_err(io(format!("reading {}", archive_path.display())))?;
    let exports = handler_symbols(&archive, &lib).map_err(|e| BuildError::Tool {
        tool: "archive index".into(),
        status: "ok".into(),
        stderr: e,
    })?;
    if exports.is_empty() {
        return Err(BuildError::NoHandlers(lib));
    }
    let out = opts
        .out
        .clone()
        .unwrap_or_else(|| target_dir.join("naam").join(format!("{lib}.o")));
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    }
    // Link beside the output and rename only when every check passed: a failed build must not
    // leave an object a later step (or a user) could mistake for a good one.
    let linking = out.with_extension("o.partial");
    let result = link_and_check(opts, &exports, &archive_path, &linking);
    let (bytes, linker_warnings) = match result {
        Ok(done) => done,
        Err(e) => {
            let _ = std::fs::remove_file(&linking);
            return Err(e);
        }
    };
    std::fs::rename(&linking, &out).map_err(io(format!("writing {}", out.display())))?;
    let sources = std::fs::read_to_string(archive_path.with_extension("d"))
        .map(|text| embed::dep_info_sources(&text))
        .unwrap_or_default();
    Ok(RawObject {
        object: out,
        bytes,
        linker_warnings,
        sources,
    })
}

/// Runs bpf-linker into `linking` and rejects objects with undefined symbols; returns the bytes
/// and bpf-linker's warnings, each distinct line once (it repeats its advice per function).
fn link_and_check(
    opts: &BuildOptions,
    exports: &[String],
    archive_path: &Path,
    linking: &Path,
) -> Result<(Vec<u8>, Vec<String>), BuildError> {
    let linked = run_linker(
        Command::new(&opts.bpf_linker)
            .args([
                "--target",
                "bpfel",
                "--cpu",
                opts.cpu.name(),
                "--cpu-features=+allows-misaligned-mem-access",
                "-O3",
                "--llvm-args=-profile-guided-section-prefix=false",
                "--export",
                &exports.join(","),
                "-o",
            ])
            .arg(linking)
            .arg(archive_path),
    )?;
    let mut linker_warnings: Vec<String> = Vec::new();
    for line in String::from_utf8_lossy(&linked.stderr).lines() {
        if !line.trim().is_empty() && !linker_warnings.iter().any(|seen| seen == line) {
            linker_warnings.push(line.to_string());
        }
    }
    let bytes = std::fs::read(linking).map_err(io(format!("reading {}", linking.display())))?;
    let undefined = undefined_symbols(&bytes)?;
    if !undefined.is_empty() {
        return Err(BuildError::Undefined(undefined));
    }
    Ok((bytes, linker_warnings))
}
