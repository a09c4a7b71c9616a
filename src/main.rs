use std::process::ExitCode;

use clap::Parser;

// mimalloc: gives freed memory back to the system (glibc's arenas kept ~435 MB after
// reading 100,000 subscriptions that need ~150 MB), and is fast under many threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    herald::cli::Cli::parse().run()
}
