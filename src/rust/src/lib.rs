//! The C interfaces shardserve's C++ calls: the Jinja engine's (`shardserve_jinja`, see
//! include/shardserve_jinja.h in its crate's header comment) and llguidance's own (its `ffi`
//! module: tokenizers, grammar matchers, token masks; header llguidance.h).
pub use llguidance::ffi::*;
pub use shardserve_jinja::*;
