//! TLS material from PEM files: extra CA certificates herald trusts for receivers
//! (`--egress-ca-file`), and the ingest API's certificate and key (`--tls-cert-file`,
//! `--tls-key-file`), reloaded when the files change. Every error names the file it is
//! about and never quotes a file's content: a key file's bytes are key material.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// A PEM parse error in words, without the bytes it was about.
fn pem_problem(error: &pem::Error) -> String {
    match error {
        pem::Error::MissingSectionEnd { .. } => "a PEM section has no END line".into(),
        pem::Error::IllegalSectionStart { .. } => "a PEM BEGIN line is malformed".into(),
        pem::Error::Base64Decode(_) => "a PEM section is not valid base64".into(),
        pem::Error::Io(e) => format!("cannot be read ({e})"),
        pem::Error::SectionTooLarge => "a PEM section is too large".into(),
        pem::Error::NoItemsFound => "holds nothing usable".into(),
        _ => "is not valid PEM".into(),
    }
}

/// Every certificate in PEM text (other sections are skipped); at least one.
fn parse_certificates(text: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_slice_iter(text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_problem(&e))?;
    if certificates.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(certificates)
}

/// The CA certificates of a PEM file (it may hold several), each checked to be usable as a
/// trust anchor. Errors name the file.
pub fn read_ca_certificates(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let certificates = parse_certificates(&text)
        .map_err(|problem| anyhow::anyhow!("{}: {problem}", path.display()))?;
    let mut store = rustls::RootCertStore::empty();
    for (n, certificate) in certificates.iter().enumerate() {
        store.add(certificate.clone()).map_err(|e| {
            anyhow::anyhow!(
                "{}: certificate {} is not a usable CA certificate ({e})",
                path.display(),
                n + 1
            )
        })?;
    }
    Ok(certificates)
}

/// The ingest API's certificate chain and key, from the bytes of their files. The key must
/// match the chain's first certificate.
fn certified_key(
    cert_path: &Path,
    cert_text: &[u8],
    key_path: &Path,
    key_text: &[u8],
) -> Result<CertifiedKey, String> {
    let chain = parse_certificates(cert_text)
        .map_err(|problem| format!("{}: {problem}", cert_path.display()))?;
    let key = PrivateKeyDer::from_pem_slice(key_text).map_err(|e| match e {
        pem::Error::NoItemsFound => format!(
            "{}: holds no PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)",
            key_path.display()
        ),
        // Never the error's detail: it may quote a line of the key file.
        _ => format!("{}: is not a readable PEM private key", key_path.display()),
    })?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => format!(
            "the private key in {} does not match the certificate in {}",
            key_path.display(),
            cert_path.display()
        ),
        rustls::Error::InvalidCertificate(e) => {
            format!("{}: the certificate is unusable ({e})", cert_path.display())
        }
        _ => format!(
            "{}: the private key is unusable (not RSA, ECDSA or Ed25519)",
            key_path.display()
        ),
    })
}

/// Hands rustls the certificate in force; [`IngestTls::reload`] swaps it.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl Current {
    fn get(&self) -> Arc<CertifiedKey> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    fn set(&self, key: Arc<CertifiedKey>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = key;
    }
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

/// What a look at the files found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    /// The files are as last seen.
    Unchanged,
    /// A new pair is in force for new connections.
    Loaded,
    /// The files changed but cannot be used; the previous pair stays in force.
    Failed(String),
}

/// The ingest API's TLS: a certificate and key from two PEM files, reloaded when they
/// change. A pair that cannot be used (half written, a key that does not match) keeps the
/// previous one in force.
pub struct IngestTls {
    /// The listener it serves, for logs: `ingest`, `aggregated`.
    what: &'static str,
    cert_path: PathBuf,
    key_path: PathBuf,
    current: Arc<Current>,
    /// The files' contents last looked at, used or not: a broken pair is reported once.
    seen: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for IngestTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestTls")
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .finish_non_exhaustive()
    }
}

impl IngestTls {
    /// Loads the pair; any problem is a start-up error naming the file.
    pub fn load(cert_path: &Path, key_path: &Path) -> anyhow::Result<Self> {
        Self::load_for(
            "ingest",
            ["--tls-cert-file", "--tls-key-file"],
            cert_path,
            key_path,
        )
    }

    /// Loads the pair of another listener: `what` names it and `flags` its two flags in
    /// start-up errors.
    pub fn load_for(
        what: &'static str,
        flags: [&str; 2],
        cert_path: &Path,
        key_path: &Path,
    ) -> anyhow::Result<Self> {
        let cert_text = std::fs::read(cert_path)
            .with_context(|| format!("reading {} {}", flags[0], cert_path.display()))?;
        let key_text = std::fs::read(key_path)
            .with_context(|| format!("reading {} {}", flags[1], key_path.display()))?;
        let key = certified_key(cert_path, &cert_text, key_path, &key_text)
            .map_err(|problem| anyhow::anyhow!("{what} TLS: {problem}"))?;
        Ok(Self {
            what,
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            current: Arc::new(Current(RwLock::new(Arc::new(key)))),
            seen: Mutex::new((cert_text, key_text)),
        })
    }

    /// What hands rustls the pair in force, for an acceptor built elsewhere (the
    /// aggregated API's, which also verifies clients).
    pub fn resolver(&self) -> Arc<dyn ResolvesServerCert> {
        self.current.clone()
    }

    /// A TLS acceptor for the ingest listener that always uses the pair in force.
    pub fn acceptor(&self) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.current.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }

    /// Reads both files and, when they changed since last seen, puts them in force if they
    /// make a usable pair.
    pub fn reload(&self) -> Reload {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| format!("{}: cannot be read ({e})", path.display()))
        };
        let texts = read(&self.cert_path).and_then(|c| Ok((c, read(&self.key_path)?)));
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (cert_text, key_text) = match texts {
            Ok(texts) if texts == *seen => return Reload::Unchanged,
            Ok(texts) => texts,
            // A file that is briefly missing (being replaced) is looked at again next time.
            Err(problem) => return Reload::Failed(problem),
        };
        let result = certified_key(&self.cert_path, &cert_text, &self.key_path, &key_text);
        *seen = (cert_text, key_text);
        match result {
            Ok(key) => {
                self.current.set(Arc::new(key));
                Reload::Loaded
            }
            Err(problem) => Reload::Failed(problem),
        }
    }

    /// Looks at the files every `every`, forever, logging what changed. A failure is
    /// logged once per new content of the files (a missing file once until it returns).
    pub async fn watch(self: Arc<Self>, every: Duration) {
        let mut last_failure = None;
        loop {
            tokio::time::sleep(every).await;
            match self.reload() {
                Reload::Unchanged => last_failure = None,
                Reload::Loaded => {
                    last_failure = None;
                    tracing::info!(
                        cert = %self.cert_path.display(),
                        key = %self.key_path.display(),
                        "{} TLS certificate reloaded: new connections use it",
                        self.what
                    );
                }
                Reload::Failed(problem) => {
                    if last_failure.as_ref() != Some(&problem) {
                        tracing::error!(
                            error = %problem,
                            "{} TLS certificate not reloaded: the previous one stays in force",
                            self.what
                        );
                    }
                    last_failure = Some(problem);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever is wrong with a key file, the error names the file and quotes none of it,
    /// even where the PEM parser's own error would (a malformed BEGIN line).
    #[test]
    fn key_file_errors_name_the_file_and_never_quote_it() {
        let leaf = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let cert = leaf.cert.pem();
        let key = leaf.signing_key.serialize_pem();
        let body = key.lines().nth(1).unwrap();
        let cases: Vec<(String, &str)> = vec![
            (
                key[..key.len() / 2].to_string(),
                "is not a readable PEM private key",
            ),
            (
                format!("-----BEGIN PRIVATE KEY s3cr3t\n{body}\n"),
                "is not a readable PEM private key",
            ),
            (
                "-----BEGIN PRIVATE KEY-----\ns3cr3t!!\n-----END PRIVATE KEY-----\n".into(),
                "is not a readable PEM private key",
            ),
            ("s3cr3t".into(), "holds no PEM private key"),
            (key.replace(body, &body.replace('A', "B")), ""),
        ];
        for (text, expected) in cases {
            let err = certified_key(
                Path::new("/tls/tls.crt"),
                cert.as_bytes(),
                Path::new("/tls/tls.key"),
                text.as_bytes(),
            )
            .err()
            .unwrap_or_default();
            assert!(
                err.starts_with("/tls/tls.key: ") || err.contains("/tls/tls.key"),
                "{err}"
            );
            assert!(err.contains(expected), "{err}");
            assert!(
                !err.contains("s3cr3t") && !err.contains(&body[..16]),
                "{err}"
            );
        }
        assert!(
            certified_key(
                Path::new("c"),
                cert.as_bytes(),
                Path::new("k"),
                key.as_bytes()
            )
            .is_ok()
        );
    }
}
