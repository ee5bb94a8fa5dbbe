//! Records the git commit for `naam-resp --version`.

fn main() {
    naam_pipeline::build_info::emit_git_commit();
}
