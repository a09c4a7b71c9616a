//! Who is calling the aggregated API: only the API server's front proxy, proven by a client
//! certificate from its request-header CA with a name the API server lists, and then the
//! user it names in `X-Remote-User`/`X-Remote-Group`. The CA, the names and the headers
//! come from where every extension API server reads them: the ConfigMap
//! `kube-system/extension-apiserver-authentication`, which the API server writes. The API
//! server has authenticated and authorized the caller before it proxies, so herald asks no
//! TokenReview and no SubjectAccessReview here.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::http::HeaderMap;
use k8s_openapi::api::core::v1::ConfigMap;
use rustls::DistinguishedName;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ResolvesServerCert, WebPkiClientVerifier};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};

/// The ConfigMap the API server publishes its front-proxy settings in.
pub const CONFIG_MAP_NAMESPACE: &str = "kube-system";
pub const CONFIG_MAP_NAME: &str = "extension-apiserver-authentication";

/// The API server's front-proxy settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontProxy {
    /// The request-header client CA, PEM.
    pub client_ca: String,
    /// Names (certificate common names) allowed to act as the front proxy; empty: any
    /// certificate of the CA.
    pub allowed_names: Vec<String>,
    pub username_headers: Vec<String>,
    pub group_headers: Vec<String>,
}

/// A caller as the front proxy names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
}

/// Why a request is not the front proxy's.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no client certificate of the API server's front proxy")]
    NoCertificate,
    #[error("the client certificate's name is not one the API server lists as its front proxy")]
    NameNotAllowed,
    #[error("the front proxy named no user")]
    NoUser,
}

/// A JSON list of strings as the API server writes it in the ConfigMap (`["X-Remote-User"]`).
fn string_list(data: &BTreeMap<String, String>, key: &str) -> Result<Vec<String>, String> {
    match data.get(key) {
        None => Ok(Vec::new()),
        Some(text) => serde_json::from_str(text)
            .map_err(|e| format!("{key} is not a JSON list of strings ({e})")),
    }
}

impl FrontProxy {
    /// From the ConfigMap's data. Without a request-header CA the API server has no front
    /// proxy, and the aggregated API cannot be served.
    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Self, String> {
        let client_ca = data
            .get("requestheader-client-ca-file")
            .filter(|ca| !ca.trim().is_empty())
            .ok_or("it has no requestheader-client-ca-file: the API server runs without --requestheader-client-ca-file, so it cannot proxy to an aggregated API")?
            .clone();
        let username_headers = string_list(data, "requestheader-username-headers")?;
        if username_headers.is_empty() {
            return Err("it names no requestheader-username-headers".into());
        }
        Ok(Self {
            client_ca,
            allowed_names: string_list(data, "requestheader-allowed-names")?,
            username_headers,
            group_headers: string_list(data, "requestheader-group-headers")?,
        })
    }

    /// Reads the ConfigMap (one call, with a deadline).
    pub async fn read(client: &kube::Client) -> anyhow::Result<Self> {
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(client.clone(), CONFIG_MAP_NAMESPACE);
        let map = tokio::time::timeout(Duration::from_secs(15), api.get(CONFIG_MAP_NAME))
            .await
            .map_err(|_| anyhow::anyhow!("no answer in 15s"))??;
        Self::from_data(&map.data.unwrap_or_default()).map_err(|problem| {
            anyhow::anyhow!("ConfigMap {CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME}: {problem}")
        })
    }

    /// A client verifier that accepts only certificates of the request-header CA.
    fn verifier(&self) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
        let mut roots = rustls::RootCertStore::empty();
        for certificate in CertificateDer::pem_slice_iter(self.client_ca.as_bytes()) {
            roots.add(
                certificate.map_err(|e| anyhow::anyhow!("requestheader-client-ca-file: {e}"))?,
            )?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Ok(WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?)
    }

    /// The caller of a request that came over a connection authenticated with
    /// `certificate` (already verified against the CA by the TLS acceptor).
    pub fn identity(
        &self,
        certificate: Option<&CertificateDer<'_>>,
        headers: &HeaderMap,
    ) -> Result<Identity, Refusal> {
        let certificate = certificate.ok_or(Refusal::NoCertificate)?;
        if !self.allowed_names.is_empty() {
            let name = common_name(certificate).ok_or(Refusal::NameNotAllowed)?;
            if !self.allowed_names.contains(&name) {
                return Err(Refusal::NameNotAllowed);
            }
        }
        let values = |names: &[String]| -> Vec<String> {
            names
                .iter()
                .flat_map(|name| headers.get_all(name.as_str()))
                .filter_map(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .map(str::to_string)
                .collect()
        };
        let user = values(&self.username_headers)
            .into_iter()
            .next()
            .ok_or(Refusal::NoUser)?;
        Ok(Identity {
            user,
            groups: values(&self.group_headers),
        })
    }
}

/// A certificate's subject common name.
fn common_name(certificate: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate.as_ref()).ok()?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(name)
}

/// The client verifier in force; [`Trust::update`] swaps it when the API server's
/// front-proxy CA changes, so a rotation needs no restart. It names no acceptable CAs in
/// the handshake (they would have to be borrowed from the verifier in force); TLS clients
/// then send the certificate they have.
#[derive(Debug)]
pub struct Trust {
    current: RwLock<(FrontProxy, Arc<dyn ClientCertVerifier>)>,
}

impl Trust {
    pub fn new(front_proxy: FrontProxy) -> anyhow::Result<Arc<Self>> {
        let verifier = front_proxy.verifier()?;
        Ok(Arc::new(Self {
            current: RwLock::new((front_proxy, verifier)),
        }))
    }

    /// The settings in force.
    pub fn front_proxy(&self) -> FrontProxy {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    fn verifier(&self) -> Arc<dyn ClientCertVerifier> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }

    /// Puts new settings in force; false when they are the ones in force already.
    pub fn update(&self, front_proxy: FrontProxy) -> anyhow::Result<bool> {
        if self.front_proxy() == front_proxy {
            return Ok(false);
        }
        let verifier = front_proxy.verifier()?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = (front_proxy, verifier);
        Ok(true)
    }

    /// A TLS acceptor that serves `certificate` and requires a client certificate of the
    /// front-proxy CA in force.
    pub fn acceptor(
        self: &Arc<Self>,
        certificate: Arc<dyn ResolvesServerCert>,
    ) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(self.clone())
            .with_cert_resolver(certificate);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

impl ClientCertVerifier for Trust {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.verifier()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.verifier().supported_verify_schemes()
    }
}

/// Re-reads the ConfigMap every `every`, forever, and puts a changed front proxy in force.
pub async fn follow(trust: Arc<Trust>, client: kube::Client, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        match FrontProxy::read(&client)
            .await
            .and_then(|fp| trust.update(fp))
        {
            Ok(true) => tracing::info!(
                "the API server's front-proxy settings changed; the new ones are in force"
            ),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot re-read the API server's front-proxy settings; those in force stay")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn ca_and_client(name: &str) -> (String, CertificateDer<'static>) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let client = params.signed_by(&key, &issuer).unwrap();
        (ca.pem(), client.der().clone())
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        map
    }

    #[test]
    fn settings_are_read_as_the_api_server_writes_them() {
        let fp = FrontProxy::from_data(&data(&[
            ("requestheader-client-ca-file", "PEM"),
            ("requestheader-allowed-names", r#"["front-proxy-client"]"#),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
            ("requestheader-group-headers", r#"["X-Remote-Group"]"#),
            (
                "requestheader-extra-headers-prefix",
                r#"["X-Remote-Extra-"]"#,
            ),
        ]))
        .unwrap();
        assert_eq!(fp.allowed_names, ["front-proxy-client"]);
        assert_eq!(fp.username_headers, ["X-Remote-User"]);
        let no_ca = FrontProxy::from_data(&data(&[(
            "requestheader-username-headers",
            r#"["X-Remote-User"]"#,
        )]));
        assert!(no_ca.unwrap_err().contains("requestheader-client-ca-file"));
        let bad = FrontProxy::from_data(&data(&[
            ("requestheader-client-ca-file", "PEM"),
            ("requestheader-username-headers", "X-Remote-User"),
        ]));
        assert!(bad.unwrap_err().contains("JSON list"));
    }

    #[test]
    fn only_an_allowed_name_may_name_the_user() {
        let (ca, proxy) = ca_and_client("front-proxy-client");
        let (_, other) = ca_and_client("someone-else");
        let fp = FrontProxy {
            client_ca: ca,
            allowed_names: vec!["front-proxy-client".into()],
            username_headers: vec!["X-Remote-User".into()],
            group_headers: vec!["X-Remote-Group".into()],
        };
        let named = headers(&[
            ("x-remote-user", "alice"),
            ("x-remote-group", "dev"),
            ("x-remote-group", "system:authenticated"),
        ]);
        assert_eq!(
            fp.identity(Some(&proxy), &named),
            Ok(Identity {
                user: "alice".into(),
                groups: vec!["dev".into(), "system:authenticated".into()],
            })
        );
        assert_eq!(fp.identity(None, &named), Err(Refusal::NoCertificate));
        assert_eq!(
            fp.identity(Some(&other), &named),
            Err(Refusal::NameNotAllowed)
        );
        assert_eq!(
            fp.identity(Some(&proxy), &headers(&[])),
            Err(Refusal::NoUser)
        );
        let any_name = FrontProxy {
            allowed_names: Vec::new(),
            ..fp
        };
        assert!(any_name.identity(Some(&other), &named).is_ok());
    }
}
