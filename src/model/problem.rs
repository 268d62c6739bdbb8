//! `Problem`: one thing wrong with one key of the configuration. Every component checks its
//! own settings and returns these; `config` gathers them into one error.

use std::fmt;

/// One problem with a key of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key, e.g. `resources[1].label_selector`.
    pub key: String,
    pub message: String,
    pub fix: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {} (fix: {})", self.key, self.message, self.fix)
    }
}

impl Problem {
    /// A problem with `key`: what is wrong (`message`) and how to fix it (`fix`).
    pub fn new(key: impl Into<String>, message: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { key: key.into(), message: message.into(), fix: fix.into() }
    }

    /// The same problem with `prefix.` before its key (a component's section).
    pub fn within(mut self, prefix: &str) -> Self {
        self.key = format!("{prefix}.{}", self.key);
        self
    }
}
