//! Writes the JIT's code for one handler to a file, for `objdump -D -b binary -mi386:x86-64`:
//! `cargo run --release -p naam-vm --example disasm -- OBJ HANDLER OUT [aarch64]`.
fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 3 {
        eprintln!("usage: disasm OBJ HANDLER OUT [aarch64]");
        std::process::exit(2);
    }
    let obj = naam_vm::load(&std::fs::read(&a[0]).expect("object")).expect("loads");
    let p = obj.get(&a[1]).expect("handler");
    let exe = naam_vm::Executable::build(
        p,
        &naam_vm::ExecOptions::engine(naam_proto::EngineKind::Interp),
    )
    .expect("builds");
    let target = if a.get(3).map(String::as_str) == Some("aarch64") {
        naam_vm::jit::Target::Aarch64
    } else {
        naam_vm::jit::Target::Host
    };
    let c = exe.compile_for(target).expect("compiles");
    std::fs::write(&a[2], &c.code).expect("writes");
    println!(
        "{} bytes, entry at {:#x}, {} functions, {:?}",
        c.code.len(),
        c.entry,
        c.functions,
        c.compile_time
    );
}
