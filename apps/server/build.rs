//! Builds the XDP eSwitch (`smartnic/eswitch-xdp`) to eBPF into `$OUT_DIR/naam-eswitch.o`, which
//! naam-server embeds: attaching it needs no toolchain where the server runs. Also records the
//! git commit for `--version`.

fn main() {
    naam_pipeline::build_info::emit_git_commit();
    let crate_dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../smartnic/eswitch-xdp");
    if let Err(e) = naam_pipeline::embed::object_for_build_script(&crate_dir, "naam-eswitch") {
        panic!("building {} to eBPF: {e}", crate_dir.display());
    }
}
