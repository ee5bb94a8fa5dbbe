//! The operating system's randomness, for the protocol core: naam-proto draws every nonce,
//! session id and key from the [`Entropy`] its driver passes, and the deployment's drivers
//! (naam-server, naam-nic, the clients) pass this one. A simulation passes
//! [`Entropy::seeded`] instead.

use naam_proto::entropy::{Entropy, EntropyError, EntropySource};

/// `getrandom`: the kernel's CSPRNG.
struct Os;

impl EntropySource for Os {
    fn fill(&self, out: &mut [u8]) -> Result<(), EntropyError> {
        getrandom::fill(out).map_err(|e| EntropyError(format!("the operating system's: {e}")))
    }

    fn describe(&self) -> String {
        "os".into()
    }
}

/// The operating system's random source (one shared handle).
pub fn os() -> Entropy {
    static OS: std::sync::OnceLock<Entropy> = std::sync::OnceLock::new();
    OS.get_or_init(|| Entropy::new(Os)).clone()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_os_source_gives_fresh_bytes() {
        let a = super::os().array::<32>().unwrap();
        let b = super::os().array::<32>().unwrap();
        assert_ne!(a, b);
        assert_eq!(format!("{:?}", super::os()), "Entropy(os)");
    }
}
