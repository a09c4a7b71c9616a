//! The `herald` command line: one binary, one subcommand per job.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use crate::api::{SigningScheme, crdgen};
use crate::signing::{DEFAULT_TOLERANCE, Signer, unix_now};

#[derive(Parser, Debug)]
#[command(
    name = "herald",
    version,
    about = "Delivers signed webhooks from Kubernetes"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print every CustomResourceDefinition as YAML (what crds/ holds).
    Crds,
    /// Print the signature headers herald would send for a body, one `Name: value` a line.
    Sign(SignArgs),
    /// Check a received request's signature headers; exit 0 when valid, 1 with the reason.
    Verify(VerifyArgs),
    /// Run herald: the delivery engine and the ingest API.
    Run(Box<crate::run::RunArgs>),
    /// A small receiver for trying herald out: verifies each delivery and prints it.
    Receive(crate::run::ReceiveArgs),
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum SchemeArg {
    StandardWebhooks,
    Stripe,
}

impl From<SchemeArg> for SigningScheme {
    fn from(value: SchemeArg) -> Self {
        match value {
            SchemeArg::StandardWebhooks => SigningScheme::StandardWebhooks,
            SchemeArg::Stripe => SigningScheme::Stripe,
        }
    }
}

#[derive(clap::Args, Debug)]
struct SchemeArgs {
    /// Signature scheme.
    #[arg(long, value_enum, default_value = "standard-webhooks")]
    scheme: SchemeArg,
    /// Signing secret; repeat it while rotating (each secret adds a signature).
    #[arg(
        long = "secret",
        required = true,
        env = "HERALD_SECRET",
        hide_env_values = true
    )]
    secrets: Vec<String>,
    /// Header name of the stripe scheme.
    #[arg(long, default_value = crate::signing::stripe::DEFAULT_HEADER)]
    signature_header: String,
    /// The request body, or - for standard input.
    #[arg(long)]
    body_file: PathBuf,
}

impl SchemeArgs {
    fn signer(&self) -> anyhow::Result<Signer> {
        Ok(Signer::new(
            self.scheme.into(),
            &self.secrets,
            Some(&self.signature_header),
        )?)
    }

    fn body(&self) -> anyhow::Result<Vec<u8>> {
        let mut body = Vec::new();
        if self.body_file.as_os_str() == "-" {
            std::io::stdin().read_to_end(&mut body)?;
        } else {
            body = std::fs::read(&self.body_file)
                .with_context(|| format!("reading {}", self.body_file.display()))?;
        }
        Ok(body)
    }
}

#[derive(clap::Args, Debug)]
struct SignArgs {
    #[command(flatten)]
    scheme: SchemeArgs,
    /// The event id (webhook-id).
    #[arg(long)]
    id: String,
    /// Unix time in seconds; now when omitted.
    #[arg(long)]
    timestamp: Option<i64>,
}

#[derive(clap::Args, Debug)]
struct VerifyArgs {
    #[command(flatten)]
    scheme: SchemeArgs,
    /// A received header as `Name: value`; repeat for each.
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// The verifier's clock as Unix seconds; the system clock when omitted.
    #[arg(long)]
    now: Option<i64>,
    /// Largest accepted distance between the signature's timestamp and now, in seconds.
    #[arg(long, default_value_t = DEFAULT_TOLERANCE.as_secs())]
    tolerance: u64,
}

fn parse_header(raw: &str) -> Result<(String, String), String> {
    let (name, value) = raw
        .split_once(':')
        .ok_or_else(|| format!("{raw:?} is not of the form 'Name: value'"))?;
    Ok((name.trim().to_string(), value.trim().to_string()))
}

impl Cli {
    pub fn run(self) -> ExitCode {
        let result = match self.command {
            Command::Crds => crds(),
            Command::Sign(args) => sign(args),
            Command::Verify(args) => return verify(args),
            Command::Run(args) => crate::run::run(*args),
            Command::Receive(args) => crate::run::receive(args),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("herald: {error:#}");
                ExitCode::FAILURE
            }
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

fn verify(args: VerifyArgs) -> ExitCode {
    let outcome = (|| -> anyhow::Result<()> {
        let signer = args.scheme.signer()?;
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

/// `--store` / `HERALD_STORE`: a `postgres://` (or `postgresql://`) URL. It may carry a
/// password, so it shows (Display and Debug alike) with the password replaced; only
/// [`StoreUrl::expose`] gives the URL itself, to connect with.
#[derive(Clone)]
pub struct StoreUrl(String);

impl StoreUrl {
    pub(crate) fn parse(raw: &str) -> Result<Self, String> {
        let parsed = url::Url::parse(raw).map_err(|e| format!("not a URL ({e})"))?;
        match parsed.scheme() {
            "postgres" | "postgresql" => Ok(Self(raw.to_string())),
            other => Err(format!(
                "unsupported store {other:?}: give a postgres:// URL, or leave --store out for the embedded store in --data-dir"
            )),
        }
    }

    /// The URL with its password, to connect with; never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::store::postgres::redact_url(&self.0))
    }
}

impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreUrl({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_url_never_shows_its_password() {
        let url = StoreUrl::parse("postgres://herald:hunter2@db:5432/herald").unwrap();
        assert_eq!(url.expose(), "postgres://herald:hunter2@db:5432/herald");
        for shown in [url.to_string(), format!("{url:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("db:5432/herald"), "{shown}");
        }
        let err = StoreUrl::parse("mysql://u:secretpw@db/x").unwrap_err();
        assert!(!err.contains("secretpw"), "{err}");
        assert!(StoreUrl::parse("not a url").is_err());
    }

    #[test]
    fn store_flag_and_environment_select_postgres() {
        let cli = Cli::try_parse_from([
            "herald",
            "run",
            "--store",
            "postgresql://h:pw@127.0.0.1/herald",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(
            args.store().map(StoreUrl::expose),
            Some("postgresql://h:pw@127.0.0.1/herald")
        );
        assert!(!format!("{args:?}").contains(":pw@"));
        assert!(Cli::try_parse_from(["herald", "run", "--store", "sqlite:///x"]).is_err());
    }
}
