//! The agent's log: text lines (the default) or JSON lines (`--log-format json`),
//! filtered by a tracing `EnvFilter` that can be replaced at run time (the admin
//! endpoint's `/logging`) through `tracing-subscriber`'s reload layer.

use std::{collections::HashSet, fmt};

use tracing_subscriber::{
    EnvFilter, Registry,
    filter::{LevelFilter, ParseError},
    layer::SubscriberExt,
    reload,
    util::{SubscriberInitExt, TryInitError},
};

use crate::error::Chain;

/// How log lines are written (to standard error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `tracing-subscriber`'s human-readable lines: time, level, target, message,
    /// `key=value` fields.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, and `fields`
    /// (with `message`).
    Json,
}

/// Why the global subscriber could not be installed ([`init`]). The message is
/// the cause's and the cause's own causes, `: `-separated.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The filter does not parse.
    #[error("{}", Chain(error))]
    Filter {
        /// The filter: `RUST_LOG` when set, else the one given.
        filter: String,
        /// `EnvFilter`'s error.
        error: ParseError,
    },
    /// A global subscriber is installed already.
    #[error("{}", Chain(error))]
    Install {
        /// `tracing-subscriber`'s error.
        error: TryInitError,
    },
}

/// Why a filter given at run time was refused; the filter in force stays.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// Nothing was given.
    #[error(
        "no filter given: give a level (error, warn, info, debug, trace, off) or target=level directives, comma-separated"
    )]
    Empty,
    /// A directive is neither a level nor `target=level`.
    #[error(
        "{0:?} is neither a level (error, warn, info, debug, trace, off) nor a target=level directive"
    )]
    Directive(String),
    /// `EnvFilter` refused the filter.
    #[error("invalid filter {filter:?}: {source}")]
    Parse {
        /// The filter given.
        filter: String,
        /// The parser's error.
        source: tracing_subscriber::filter::ParseError,
    },
    /// The subscriber is gone (not expected while the agent runs).
    #[error("the log filter cannot be changed: {0}")]
    Reload(#[from] reload::Error),
}

/// Checks a filter given at run time: comma-separated directives, each a level
/// or `target[span{field}]=level` (a bare target, which `EnvFilter` would take as
/// "everything of that target", is refused as the likely typo it is), then parsed
/// by `EnvFilter`.
///
/// # Errors
/// [`FilterError`] saying which directive is wrong.
pub fn parse_filter(filter: &str) -> Result<EnvFilter, FilterError> {
    let filter = filter.trim();
    if filter.is_empty() {
        return Err(FilterError::Empty);
    }
    for directive in filter.split(',').map(str::trim) {
        let level = directive
            .rsplit_once('=')
            .map_or(
                directive,
                |(target, level)| {
                    if target.is_empty() { "" } else { level }
                },
            );
        if level.parse::<LevelFilter>().is_err() {
            return Err(FilterError::Directive(directive.to_string()));
        }
    }
    EnvFilter::builder()
        .parse(filter)
        .map_err(|source| FilterError::Parse {
            filter: filter.to_string(),
            source,
        })
}

/// The handle on the log filter in force.
#[derive(Clone)]
pub struct LogControl {
    handle: reload::Handle<EnvFilter, Registry>,
}

impl fmt::Debug for LogControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogControl")
            .field("filter", &self.current())
            .finish()
    }
}

impl LogControl {
    /// The filter in force, in `EnvFilter` syntax.
    pub fn current(&self) -> String {
        self.handle
            .with_current(ToString::to_string)
            .unwrap_or_else(|e| format!("(unavailable: {e})"))
    }

    /// Puts `filter` in force (see [`parse_filter`]); returns it as now in force.
    ///
    /// # Errors
    /// [`FilterError`]; the filter in force then stays.
    pub fn set(&self, filter: &str) -> Result<String, FilterError> {
        let parsed = parse_filter(filter)?;
        self.handle.reload(parsed)?;
        Ok(self.current())
    }
}

/// Installs the global subscriber: `format` lines on standard error, filtered by
/// `RUST_LOG` when set, else by `filter`.
///
/// # Errors
/// An invalid filter ([`InitError::Filter`]), or a subscriber already installed
/// ([`InitError::Install`]).
pub fn init(filter: &str, format: LogFormat) -> Result<LogControl, InitError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => env,
        _ => filter.to_string(),
    };
    let filter = match EnvFilter::builder().parse(&filter) {
        Ok(parsed) => parsed,
        Err(error) => return Err(InitError::Filter { filter, error }),
    };
    let (filter, handle) = reload::Layer::new(filter);
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    }
    .map_err(|error| InitError::Install { error })?;
    Ok(LogControl { handle })
}

/// How a [`HeldMessages`] message is logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// `tracing::warn!`.
    Warn,
    /// `tracing::error!`.
    Error,
}

/// Messages about a condition that holds over time (two pods claiming one
/// address, a policy enforced only in part, policies unknown while a file is
/// broken), found anew each time the state behind them is rebuilt. Each is
/// logged when it first appears and not again while every rebuild finds it; once
/// a rebuild no longer finds it, its return is logged again.
#[derive(Debug, Default)]
pub struct HeldMessages {
    /// The messages of the last rebuild.
    held: HashSet<String>,
}

impl HeldMessages {
    /// Takes the messages of a rebuild, all of those that hold now, and returns
    /// the ones the last rebuild did not have (to be logged), in their order.
    pub fn update(&mut self, messages: Vec<(Severity, String)>) -> Vec<(Severity, String)> {
        let mut held = HashSet::with_capacity(messages.len());
        let mut fresh = Vec::new();
        for (severity, message) in messages {
            if !self.held.contains(&message) && !held.contains(&message) {
                fresh.push((severity, message.clone()));
            }
            held.insert(message);
        }
        self.held = held;
        fresh
    }

    /// [`HeldMessages::update`], logging what is new.
    pub fn log(&mut self, messages: Vec<(Severity, String)>) {
        for (severity, message) in self.update(messages) {
            match severity {
                Severity::Warn => tracing::warn!("{message}"),
                Severity::Error => tracing::error!("{message}"),
            }
        }
    }
}

/// Warnings given at most [`RateLimited::BURST`] times a second; the next one
/// given counts those left out.
#[derive(Default)]
pub struct RateLimited {
    /// Start of the current second, warnings given in it, occurrences left out.
    state: std::sync::Mutex<(Option<std::time::Instant>, u32, u64)>,
}

impl RateLimited {
    /// Warnings given per second.
    pub const BURST: u32 = 10;

    /// Counts one occurrence; logs `message(n)`, `n` being this occurrence and those
    /// left out before it, unless this second's warnings are used up.
    pub fn warn(&self, message: impl FnOnce(u64) -> String) {
        let mut state = self.state.lock().expect("rate limiter lock");
        let now = std::time::Instant::now();
        if state
            .0
            .is_none_or(|start| now.duration_since(start) >= std::time::Duration::from_secs(1))
        {
            state.0 = Some(now);
            state.1 = 0;
        }
        state.2 += 1;
        if state.1 < Self::BURST {
            state.1 += 1;
            tracing::warn!("{}", message(state.2));
            state.2 = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A filter that does not parse: its message is the parser's error and its
    /// causes, as `anyhow`'s `{:#}` printed it.
    #[test]
    fn an_init_filter_error_is_the_parsers_chain() {
        for filter in ["info,podlink=loud", "=info"] {
            let parse = || EnvFilter::builder().parse(filter).unwrap_err();
            let error = InitError::Filter {
                filter: filter.to_string(),
                error: parse(),
            };
            assert_eq!(
                error.to_string(),
                format!("{:#}", anyhow::Error::new(parse()))
            );
        }
    }

    #[test]
    fn levels_and_target_directives_parse() {
        for ok in [
            "debug",
            "INFO",
            "info,podlink_agent=debug",
            "podlink_agent::proxy=trace",
            "access=off, warn",
        ] {
            parse_filter(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }

    #[test]
    fn garbage_is_refused_with_the_directive() {
        assert!(matches!(parse_filter(" "), Err(FilterError::Empty)));
        for (bad, named) in [
            ("loud", "loud"),
            ("info,podlink_agent=loud", "podlink_agent=loud"),
            ("=debug", "=debug"),
            ("podlink_agent", "podlink_agent"),
        ] {
            let e = parse_filter(bad).unwrap_err();
            assert!(e.to_string().contains(named), "{bad}: {e}");
        }
    }

    #[test]
    fn held_messages_are_logged_once_while_they_hold() {
        use Severity::{Error, Warn};
        let mut held = HeldMessages::default();
        let round = |items: &[(Severity, &str)]| {
            items
                .iter()
                .map(|(s, m)| (*s, m.to_string()))
                .collect::<Vec<_>>()
        };
        let conflict = (Warn, "pods a, b all claim address 10.0.0.1");
        let broken = (Error, "policies.yaml is broken");
        assert_eq!(
            held.update(round(&[conflict, broken])),
            round(&[conflict, broken])
        );
        // Every rebuild finds both: nothing new.
        assert_eq!(held.update(round(&[broken, conflict])), vec![]);
        // The conflict ends, a message repeated in one rebuild is new once.
        let other = (Warn, "pod shop/web is defined 2 times");
        assert_eq!(held.update(round(&[broken, other, other])), round(&[other]));
        // The conflict returns: logged again.
        assert_eq!(
            held.update(round(&[conflict, broken, other])),
            round(&[conflict])
        );
        assert_eq!(held.update(vec![]), vec![]);
        assert_eq!(held.update(round(&[broken])), round(&[broken]));
    }
}
