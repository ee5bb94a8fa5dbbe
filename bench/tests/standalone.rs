//! The binaries are self-contained: copied into an empty directory and run with `env -i` and a
//! `PATH` holding only them (no cargo, no bpf-linker, no source tree), they run their jobs from
//! the handler objects they carry, and write nothing into the working directory that was not
//! asked for. CI builds the release binaries first (`scripts/test.sh`) and tests those; elsewhere
//! the test falls back to the binaries beside this test and says so.

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BINARIES: [&str; 4] = ["naam", "naam-bench", "naam-server", "naam-nic"];

/// The directory holding the binaries under test: `target/release` when they are all there,
/// else (not in CI) the profile this test was built with.
fn binaries() -> PathBuf {
    let here = Path::new(env!("CARGO_BIN_EXE_naam-bench"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let release = here.parent().expect("target dir").join("release");
    let complete = |dir: &Path| BINARIES.iter().all(|b| dir.join(b).is_file());
    if complete(&release) {
        return release;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI tests the release binaries, but {} lacks some of {BINARIES:?} \
         (scripts/test.sh builds them with `cargo build --release --bins`)",
        release.display()
    );
    assert!(
        complete(&here),
        "{} lacks some of {BINARIES:?}: run `cargo build --bins`",
        here.display()
    );
    eprintln!(
        "NOTE: no release binaries in {}; testing the {} ones",
        release.display(),
        here.display()
    );
    here
}

/// An empty working directory and a directory of copied binaries.
struct Sandbox {
    root: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Sandbox {
        let root = tempfile::tempdir().expect("tempdir");
        let from = binaries();
        std::fs::create_dir(root.path().join("bin")).expect("bin dir");
        std::fs::create_dir(root.path().join("work")).expect("work dir");
        for b in BINARIES {
            std::fs::copy(from.join(b), root.path().join("bin").join(b)).expect("copy binary");
        }
        Sandbox { root }
    }

    fn work(&self) -> PathBuf {
        self.root.path().join("work")
    }

    /// `env -i PATH=<bin> <program> args...` in the working directory.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("/usr/bin/env");
        c.arg("-i")
            .arg(format!("PATH={}", self.root.path().join("bin").display()))
            .arg(program)
            .args(args)
            .current_dir(self.work());
        c
    }

    fn run(&self, program: &str, args: &[&str]) -> Output {
        let out = self.command(program, args).output().expect("env runs");
        assert!(
            out.status.success(),
            "{program} {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// The names in the working directory.
    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.work())
            .expect("read work dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

/// Kills the server when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn copied_binaries_run_their_jobs_without_a_toolchain_or_a_source_tree() {
    let sandbox = Sandbox::new();

    // The main job and the B-tree, in process: nothing is written.
    let out = sandbox.run("naam-bench", &["ycsb", "--records", "200", "--ops", "500"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("read"));
    sandbox.run(
        "naam-bench",
        &[
            "ycsb",
            "--app",
            "btree",
            "--workload",
            "e",
            "--records",
            "200",
            "--ops",
            "200",
        ],
    );
    sandbox.run(
        "naam",
        &[
            "demo",
            "--seconds",
            "0.4",
            "--congestion-start",
            "0.1",
            "--congestion-end",
            "0.2",
        ],
    );
    assert_eq!(
        sandbox.entries(),
        Vec::<String>::new(),
        "wrote without being asked"
    );

    // Asked for: an experiment's output directory.
    sandbox.run(
        "naam-bench",
        &["experiment", "engines", "--ops", "1000", "--out", "charts"],
    );
    assert_eq!(sandbox.entries(), ["charts"]);

    // A deployment: a key, a config, naam-server serving MICA from the object it carries, and a
    // YCSB client against it.
    sandbox.run("naam-server", &["keygen", "--out", "keys/mica.key"]);
    let addr = {
        let probe = UdpSocket::bind("127.0.0.1:0").expect("free port");
        probe.local_addr().expect("addr")
    };
    std::fs::write(
        sandbox.work().join("naam-server.toml"),
        format!(
            "listen = \"{addr}\"\nshm_dir = \"shm\"\n\n[[app]]\nkind = \"mica\"\nid = 1\n\
             credential = \"keys/mica.key\"\nitems = 2000\n"
        ),
    )
    .expect("config");
    let server = Killed(
        sandbox
            .command("naam-server", &["--config", "naam-server.toml"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("naam-server starts"),
    );
    let server_arg = addr.to_string();
    let args = [
        "ycsb",
        "--fabric",
        "udp",
        "--server",
        &server_arg,
        "--keys",
        "keys",
        "--placement",
        "host",
        "--records",
        "200",
        "--ops",
        "500",
    ];
    // The server loads and verifies its handlers first: retry until it answers.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = sandbox
            .command("naam-bench", &args)
            .output()
            .expect("env runs");
        if out.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ycsb against the copied naam-server: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    drop(server);
    assert_eq!(
        sandbox.entries(),
        ["charts", "keys", "naam-server.toml", "shm"]
    );
}
