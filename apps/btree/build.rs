//! Builds the handler crate in `handlers/` to eBPF and leaves it in `$OUT_DIR/btree.o`, which the
//! library embeds: binaries then carry the handlers and need no toolchain where they run.

fn main() {
    // The client library alone (no `host` feature) needs no handler object.
    #[cfg(feature = "host")]
    build();
}

#[cfg(feature = "host")]
fn build() {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("handlers");
    if let Err(e) = naam_pipeline::embed::object_for_build_script(&crate_dir, "btree") {
        panic!("building {} to eBPF: {e}", crate_dir.display());
    }
}
