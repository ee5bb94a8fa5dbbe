//! Records the git commit the binaries are built from (`--version`).

fn main() {
    naam_pipeline::build_info::emit_git_commit();
}
