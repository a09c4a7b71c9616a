use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    herald::cli::Cli::parse().run()
}
