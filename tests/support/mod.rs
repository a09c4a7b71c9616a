//! Shared helpers for the integration tests; each test binary uses a part of them.
#![allow(dead_code)]

pub mod control_plane;
pub mod herald;
pub mod operator;
pub mod receiver;
pub mod tls;
