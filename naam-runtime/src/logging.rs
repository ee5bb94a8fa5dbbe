//! Logs of every NAAM binary: `tracing` events on stderr. `RUST_LOG` (tracing's filter syntax,
//! `naam_runtime=debug,warn`) wins; without it `-v` raises and `-q` lowers the binary's
//! default level one step each, and the version line names the git commit built.

use tracing::level_filters::LevelFilter;

/// `-v` / `-q` for a binary's command line (with feature `cli`, a clap argument group: flatten
/// it into the top-level arguments).
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[derive(Debug, Clone, Copy, Default)]
pub struct Verbosity {
    /// More log output (repeat for more: -vv); RUST_LOG overrides.
    #[cfg_attr(feature = "cli", arg(short, long, action = clap::ArgAction::Count, global = true))]
    pub verbose: u8,
    /// Less log output (repeat for none: -qq); RUST_LOG overrides.
    #[cfg_attr(
        feature = "cli",
        arg(short, long, action = clap::ArgAction::Count, global = true, conflicts_with = "verbose")
    )]
    pub quiet: u8,
}

impl Verbosity {
    /// The level these flags give a binary whose default is `default`.
    pub fn level(&self, default: LevelFilter) -> LevelFilter {
        const LADDER: [LevelFilter; 6] = [
            LevelFilter::OFF,
            LevelFilter::ERROR,
            LevelFilter::WARN,
            LevelFilter::INFO,
            LevelFilter::DEBUG,
            LevelFilter::TRACE,
        ];
        let at = LADDER.iter().position(|l| *l == default).unwrap_or(2) as i32;
        let step = i32::from(self.verbose) - i32::from(self.quiet);
        LADDER[(at + step).clamp(0, LADDER.len() as i32 - 1) as usize]
    }
}

/// Starts logging to stderr: `RUST_LOG` if set (an invalid one is reported and ignored), else
/// `verbosity` over `default`. Events carry their target (the module) and level; a server's
/// default is `info`, a command's `warn`.
pub fn init(verbosity: Verbosity, default: LevelFilter) {
    use tracing_subscriber::EnvFilter;
    let level = verbosity.level(default);
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(with_default(&spec, level))
        {
            Ok(f) => (f, None),
            Err(e) => (
                EnvFilter::new(level.to_string()),
                Some(format!("{spec}: {e}")),
            ),
        },
        _ => (EnvFilter::new(level.to_string()), None),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    if let Some(why) = bad {
        tracing::warn!("RUST_LOG ignored: {why}");
    }
}

/// `spec` with `level` in front unless it names a level for every target itself: directives
/// for some modules (`naam_runtime=debug`) then raise those and leave the rest at the
/// binary's level, instead of silencing everything else (tracing's rule without a default).
fn with_default(spec: &str, level: LevelFilter) -> String {
    let has_default = spec
        .split(',')
        .map(str::trim)
        .any(|d| !d.is_empty() && !d.contains('=') && !d.contains('[') && !d.contains(':'));
    if has_default {
        spec.to_string()
    } else {
        format!("{level},{spec}")
    }
}

/// `<version> (<commit>)`: what `--version` prints after the binary's name.
#[macro_export]
macro_rules! version_line {
    () => {
        concat!(
            env!("CARGO_PKG_VERSION"),
            " (git ",
            env!("NAAM_GIT_COMMIT"),
            ")"
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_for_some_modules_keeps_the_rest_at_the_default() {
        assert_eq!(
            with_default("naam_runtime=debug", LevelFilter::INFO),
            "info,naam_runtime=debug"
        );
        assert_eq!(with_default("debug", LevelFilter::INFO), "debug");
        assert_eq!(
            with_default("warn,naam_proto=trace", LevelFilter::INFO),
            "warn,naam_proto=trace"
        );
    }

    #[test]
    fn flags_move_the_level_one_step_each_within_bounds() {
        let v = |verbose, quiet| Verbosity { verbose, quiet };
        assert_eq!(v(0, 0).level(LevelFilter::WARN), LevelFilter::WARN);
        assert_eq!(v(1, 0).level(LevelFilter::WARN), LevelFilter::INFO);
        assert_eq!(v(2, 0).level(LevelFilter::WARN), LevelFilter::DEBUG);
        assert_eq!(v(9, 0).level(LevelFilter::WARN), LevelFilter::TRACE);
        assert_eq!(v(0, 1).level(LevelFilter::INFO), LevelFilter::WARN);
        assert_eq!(v(0, 9).level(LevelFilter::INFO), LevelFilter::OFF);
    }
}
