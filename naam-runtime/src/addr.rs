//! Addresses as people write them on command lines and in configs: `10.77.0.1:7000`,
//! `[::1]:7000`, or a host name and port (`localhost:7000`), resolved once, when read.

use std::net::{SocketAddr, ToSocketAddrs};

/// Reads `text` as a socket address: an IP address and port, or a host name and port resolved
/// now (its first address, IPv4 first, as a client would try it). The error says what was
/// wrong, for clap and config messages.
pub fn parse(text: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(format!(
            "{text:?} is not HOST:PORT (an address or a host name, then a port)"
        ));
    };
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(format!(
            "{text:?} is not HOST:PORT (an address or a host name, then a port)"
        ));
    }
    let found: Vec<SocketAddr> = text
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?
        .collect();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| found.first())
        .copied()
        .ok_or_else(|| format!("{host:?} resolves to no address"))
}

/// [`parse`] for serde: `#[serde(deserialize_with = "naam_runtime::addr::deserialize")]`.
pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let text = <String as serde::Deserialize>::deserialize(d)?;
    parse(&text).map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_host_names_are_read_and_nonsense_is_named() {
        assert_eq!(
            parse("10.77.0.1:7000"),
            Ok("10.77.0.1:7000".parse().unwrap())
        );
        assert_eq!(parse("[::1]:7000"), Ok("[::1]:7000".parse().unwrap()));
        let local = parse("localhost:7000").expect("localhost resolves");
        assert!(local.ip().is_loopback() && local.port() == 7000, "{local}");
        for bad in [
            "7000",
            "localhost",
            ":7000",
            "localhost:port",
            "localhost:70000",
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains("HOST:PORT"), "{bad}: {e}");
        }
    }
}
