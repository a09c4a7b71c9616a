//! Certificates made at test time with rcgen: a CA the test generates, leaves it issues
//! for any names, and files to hand herald (removed with their folder on drop).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

/// A certificate authority made for one test.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
    pub der: CertificateDer<'static>,
}

/// A certificate and its private key, both PEM, and the certificate's DER.
#[derive(Clone)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses) with this serial.
    pub fn leaf(&self, names: &[&str], serial: u64) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.serial_number = Some(SerialNumber::from_slice(&serial.to_be_bytes()));
        params
            .distinguished_name
            .push(DnType::CommonName, "herald test leaf");
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }
}

impl Leaf {
    /// A rustls server configuration presenting this certificate.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let chain = vec![self.der.clone()];
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).unwrap();
        let mut config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// A reqwest client that trusts only `ca`.
pub fn client_trusting(ca: &Ca) -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_der(&ca.der).unwrap()])
        .build()
        .unwrap()
}

/// A folder of files for herald, removed on drop.
pub struct Files {
    pub dir: PathBuf,
}

impl Files {
    pub fn new() -> Self {
        Self {
            dir: super::fresh_dir("herald-tls"),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `name` atomically (a new file renamed over the old); returns its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        write_atomically(&path, text);
        path
    }
}

/// Writes `path` through a temporary file renamed over it.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
