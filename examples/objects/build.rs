//! Builds `examples/handlers` to eBPF into `$OUT_DIR/examples.o` for the library to embed.

fn main() {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../handlers");
    if let Err(e) = naam_pipeline::embed::object_for_build_script(&crate_dir, "examples") {
        panic!("building {} to eBPF: {e}", crate_dir.display());
    }
}
