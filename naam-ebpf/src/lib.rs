//! # naam-ebpf
//!
//! The `no_std` SDK for NAAM handlers, and the single home of the ABI that handlers and the
//! runtime share ([`abi`]). A handler is a Rust function compiled to eBPF by `naam build`; the
//! same bytecode runs on a client, on SmartNIC cores or on server host cores.
//!
//! ```ignore
//! #![no_std]
//! use naam_ebpf::{handler, Return};
//!
//! handler! {
//!     /// Replies with the first word of segment 0 plus the first argument word.
//!     fn add(ctx) {
//!         let x = ctx.segment(0)?.read_u64(0)?;
//!         ctx.reply_u64(x.wrapping_add(ctx.arg_u64(0)?))?;
//!         Ok(Return::Done)
//!     }
//! }
//! ```
//!
//! Handler crates enable the `handler` feature, which installs a panic handler that calls the
//! `abort` helper (a panic becomes a clean abort error, never undefined behaviour).
//!
//! Rules for handler code, enforced by the build pipeline and the verifier: no loops whose trip
//! count is unknown at compile time (unroll them, or split the work into `Continue` steps), no
//! mutable globals, no calls into code without bitcode (`memcpy` of a variable length: use
//! [`copy`] instead).
#![no_std]
#![deny(missing_docs)]

pub mod abi;
pub mod eswitch;
pub mod hash;
mod sdk;

pub use abi::{Context, Descriptor, Return, Segment, WriteOp};
pub use sdk::*;

#[cfg(feature = "handler")]
#[panic_handler]
fn on_panic(_info: &core::panic::PanicInfo) -> ! {
    abort(abi::abort_code::PANIC)
}

/// Memory builtins for handler code. LLVM emits calls to these for copies and fills it does not
/// expand inline; compiler_builtins carries no bitcode, so without them the object would have
/// undefined symbols. Each one is a bounded, checked runtime helper; a refused range aborts.
#[cfg(feature = "handler")]
mod builtins {
    use crate::abi::{abort_code, helper};

    fn check(r: u64) {
        if r == helper::ERR_FAULT {
            crate::abort(abort_code::MEMORY_BUILTIN)
        }
    }

    /// `memcpy` through the bounded copy helper.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
        check(crate::sdk::raw_copy(dst as u64, src as u64, n as u64));
        dst
    }

    /// `memmove`: the copy helper handles overlapping ranges.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
        check(crate::sdk::raw_copy(dst as u64, src as u64, n as u64));
        dst
    }

    /// `memset` through the bounded fill helper.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
        check(crate::sdk::raw_fill(dst as u64, c as u8, n as u64));
        dst
    }

    /// `memcmp` through the bounded compare helper.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
        let r = crate::sdk::raw_compare(a as u64, b as u64, n as u64);
        check(r);
        match r {
            helper::CMP_LESS => -1,
            helper::CMP_GREATER => 1,
            _ => 0,
        }
    }

    /// `bcmp`: zero when equal.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
        unsafe { memcmp(a, b, n) }
    }
}
