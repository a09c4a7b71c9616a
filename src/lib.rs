//! herald: a Kubernetes operator that delivers signed webhooks with retries, dead-lettering
//! and strict isolation between subscriptions and between tenants.
// No unsafe code, but for the one allowed by name: the allocator calls in standalone.rs.
#![deny(unsafe_code)]

pub mod aggregated;
pub mod api;
pub mod cli;
pub mod commands;
pub mod controller;
pub mod delivery;
pub mod ingest;
pub mod kubectl_plugin;
pub mod metrics;
pub mod run;
pub mod signing;
pub mod standalone;
pub mod store;
pub mod tls;
