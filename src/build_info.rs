//! What the binary was built from.

/// The git commit of the build, when built from a git checkout.
pub fn commit() -> Option<&'static str> {
    option_env!("TRELLIS_GIT_COMMIT")
}
