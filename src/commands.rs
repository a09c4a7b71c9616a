//! What each subcommand does: the offline tools (`crds`, `openapi`, `sign`, `verify`, `public-key`) here, the
//! server (`run`) and the trial receiver (`receive`) in [`crate::run`], the kubectl plugin
//! (`kubectl`) in [`crate::kubectl_plugin`].

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use crate::api::crdgen;
use crate::cli::{Cli, Command, PublicKeyArgs, SignArgs, VerifyArgs};
use crate::signing::unix_now;

/// Runs the subcommand `cli` names.
pub fn execute(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Crds => crds(),
        Command::Openapi => std::io::stdout()
            .write_all(crate::ingest::openapi::document().as_bytes())
            .map_err(Into::into),
        Command::Sign(args) => sign(args),
        Command::Verify(args) => return verify(args),
        Command::PublicKey(args) => public_key(args),
        Command::Run(args) => crate::run::run(*args),
        Command::Receive(args) => crate::run::receive(args),
        Command::Kubectl(command) => return crate::kubectl_plugin::execute(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("herald: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn crds() -> anyhow::Result<()> {
    std::io::stdout().write_all(crdgen::render_all()?.as_bytes())?;
    Ok(())
}

fn sign(args: SignArgs) -> anyhow::Result<()> {
    let signer = args.scheme.signer()?;
    let body = args.scheme.body()?;
    let timestamp = args.timestamp.unwrap_or_else(unix_now);
    let mut out = std::io::stdout().lock();
    for (name, value) in signer.sign(&args.id, timestamp, &body) {
        writeln!(out, "{name}: {value}")?;
    }
    Ok(())
}

fn public_key(args: PublicKeyArgs) -> anyhow::Result<()> {
    let signer = crate::signing::Signer::new(
        crate::api::SigningScheme::StandardWebhooks,
        &[args.secret.as_str()],
        None,
    )?;
    match signer.public_keys().as_slice() {
        [key] => println!("{key}"),
        _ => anyhow::bail!("--secret is not an ed25519 private key (whsk_...)"),
    }
    Ok(())
}

fn verify(args: VerifyArgs) -> ExitCode {
    let outcome = (|| -> anyhow::Result<()> {
        let signer = args.scheme.verifier()?;
        let body = args.scheme.body()?;
        let headers = args.headers.iter().map(|(n, v)| (n.as_str(), v.as_str()));
        signer.verify(
            headers,
            &body,
            args.now.unwrap_or_else(unix_now),
            Duration::from_secs(args.tolerance),
        )?;
        Ok(())
    })();
    match outcome {
        Ok(()) => {
            println!("valid");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("invalid: {error:#}");
            ExitCode::FAILURE
        }
    }
}
