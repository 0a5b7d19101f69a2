//! The cluster certificate authority and per-node certificates (rcgen), behind
//! `trellis cert init` ([`init`]) and `trellis cert issue --node N` ([`issue`]).
//!
//! A directory holds `ca.pem`/`ca.key` and, per node, `node-N.pem`/`node-N.key`. A node
//! certificate is valid for the name [`node_server_name`]`(N)` (`node-N.trellis`) as a TLS
//! server and client, so one certificate serves both ends of mutual TLS and binds the node id.
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// File name of the CA certificate.
pub const CA_CERT: &str = "ca.pem";
/// File name of the CA private key.
pub const CA_KEY: &str = "ca.key";

/// Errors of certificate generation and loading.
#[derive(Debug, Error)]
pub enum CertError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid PEM {what}")]
    Pem { path: PathBuf, what: &'static str },
    #[error("{0} already exists; refusing to overwrite it (pass --force to replace it)")]
    Exists(PathBuf),
    #[error("a validity of {0} days is out of range (1 to 36500)")]
    Validity(u32),
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
}

/// The TLS server name of node `node`, which its certificate is valid for.
pub fn node_server_name(node: u32) -> String {
    format!("node-{node}.trellis")
}

/// Paths of node `node`'s certificate and key in `dir`.
pub fn node_paths(dir: &Path, node: u32) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("node-{node}.pem")),
        dir.join(format!("node-{node}.key")),
    )
}

/// Creates a cluster CA in `dir` (writes `ca.pem` and `ca.key`; refuses to overwrite).
pub fn init(dir: &Path) -> Result<ClusterCa, CertError> {
    ClusterCa::init(dir)
}

/// Issues node `node`'s certificate from the CA in `dir`; returns the certificate and key paths.
/// Refuses to overwrite an existing certificate or key.
pub fn issue(dir: &Path, node: u32) -> Result<(PathBuf, PathBuf), CertError> {
    ClusterCa::load(dir)?.issue(dir, node)
}

/// Days a cluster CA certificate is valid by default.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// Days a node certificate is valid by default.
pub const DEFAULT_NODE_DAYS: u32 = 365;

/// `[now - 1 h, now + days]`: a certificate's validity (the hour absorbs clock skew).
fn validity(p: &mut CertificateParams, days: u32) -> Result<(), CertError> {
    if !(1..=36_500).contains(&days) {
        return Err(CertError::Validity(days));
    }
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::hours(1);
    p.not_after = now + time::Duration::days(i64::from(days));
    Ok(())
}

/// A cluster certificate authority.
pub struct ClusterCa {
    key: KeyPair,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name
        .push(DnType::OrganizationName, "Trellis");
    p.distinguished_name
        .push(DnType::CommonName, "Trellis cluster CA");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

impl ClusterCa {
    /// A fresh CA in memory, valid for [`DEFAULT_CA_DAYS`].
    pub fn generate() -> Result<Self, CertError> {
        Self::generate_for(DEFAULT_CA_DAYS)
    }

    /// A fresh CA in memory, valid for `days` from now.
    pub fn generate_for(days: u32) -> Result<Self, CertError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params();
        validity(&mut params, days)?;
        let cert = params.self_signed(&key)?;
        Ok(ClusterCa {
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            key,
        })
    }

    /// A fresh CA written to `dir` (created if missing), valid for [`DEFAULT_CA_DAYS`].
    pub fn init(dir: &Path) -> Result<Self, CertError> {
        Self::init_for(dir, DEFAULT_CA_DAYS)
    }

    /// A fresh CA valid for `days`, written to `dir` (created if missing, readable by its
    /// owner only). An existing CA is never overwritten.
    pub fn init_for(dir: &Path, days: u32) -> Result<Self, CertError> {
        let key_path = dir.join(CA_KEY);
        if key_path.exists() {
            return Err(CertError::Exists(key_path));
        }
        private_dir(dir)?;
        let ca = Self::generate_for(days)?;
        write_file(&dir.join(CA_CERT), ca.cert_pem.as_bytes(), false)?;
        write_file(&key_path, ca.key.serialize_pem().as_bytes(), true)?;
        Ok(ca)
    }

    /// The CA stored in `dir`.
    pub fn load(dir: &Path) -> Result<Self, CertError> {
        let cert_path = dir.join(CA_CERT);
        let cert_pem = read_string(&cert_path)?;
        let cert_der =
            CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|_| CertError::Pem {
                path: cert_path,
                what: "certificate",
            })?;
        let key_path = dir.join(CA_KEY);
        let key = KeyPair::from_pem(&read_string(&key_path)?).map_err(|_| CertError::Pem {
            path: key_path,
            what: "private key",
        })?;
        Ok(ClusterCa {
            key,
            cert_der,
            cert_pem,
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    /// A certificate and key for node `node`, in memory.
    pub fn issue_identity(&self, node: u32) -> Result<NodeIdentity, CertError> {
        let (cert_pem, key) = self.sign_node(node, DEFAULT_NODE_DAYS)?;
        let chain =
            vec![CertificateDer::from_pem_slice(cert_pem.as_bytes())
                .expect("rcgen writes valid PEM")];
        let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes())
            .expect("rcgen writes valid PEM");
        Ok(NodeIdentity {
            node,
            ca: self.cert_der(),
            chain,
            key,
        })
    }

    /// Writes `node-N.pem` and `node-N.key` (valid [`DEFAULT_NODE_DAYS`]) to `dir`; returns
    /// their paths. Existing files are never overwritten.
    pub fn issue(&self, dir: &Path, node: u32) -> Result<(PathBuf, PathBuf), CertError> {
        self.issue_with(dir, node, DEFAULT_NODE_DAYS, false)
    }

    /// As [`ClusterCa::issue`], valid for `days`; `force` replaces an existing certificate
    /// and key of the node.
    pub fn issue_with(
        &self,
        dir: &Path,
        node: u32,
        days: u32,
        force: bool,
    ) -> Result<(PathBuf, PathBuf), CertError> {
        let (cert_path, key_path) = node_paths(dir, node);
        if !force {
            if let Some(p) = [&key_path, &cert_path].into_iter().find(|p| p.exists()) {
                return Err(CertError::Exists(p.clone()));
            }
        }
        private_dir(dir)?;
        let (cert_pem, key) = self.sign_node(node, days)?;
        write_file(&cert_path, cert_pem.as_bytes(), false)?;
        write_file(&key_path, key.serialize_pem().as_bytes(), true)?;
        Ok((cert_path, key_path))
    }

    fn sign_node(&self, node: u32, days: u32) -> Result<(String, KeyPair), CertError> {
        let mut p = CertificateParams::new(vec![node_server_name(node)])?;
        validity(&mut p, days)?;
        p.distinguished_name
            .push(DnType::OrganizationName, "Trellis");
        p.distinguished_name
            .push(DnType::CommonName, format!("trellis node {node}"));
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        // The issuer is rebuilt from the CA's fixed parameters and its key: the same
        // distinguished name and key identifier as in the CA certificate.
        let ca = ca_params();
        let issuer = Issuer::from_params(&ca, &self.key);
        let cert = p.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key))
    }
}

/// What a node needs for mutual TLS: the CA to trust, its certificate chain and its key.
pub struct NodeIdentity {
    pub node: u32,
    pub ca: CertificateDer<'static>,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity {
            node: self.node,
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl NodeIdentity {
    /// Loads node `node`'s identity from `dir` (`ca.pem`, `node-N.pem`, `node-N.key`).
    pub fn load(dir: &Path, node: u32) -> Result<Self, CertError> {
        let ca_path = dir.join(CA_CERT);
        let ca =
            CertificateDer::from_pem_slice(read_string(&ca_path)?.as_bytes()).map_err(|_| {
                CertError::Pem {
                    path: ca_path,
                    what: "certificate",
                }
            })?;
        let (cert_path, key_path) = node_paths(dir, node);
        let chain = vec![
            CertificateDer::from_pem_slice(read_string(&cert_path)?.as_bytes()).map_err(|_| {
                CertError::Pem {
                    path: cert_path,
                    what: "certificate",
                }
            })?,
        ];
        let key =
            PrivateKeyDer::from_pem_slice(read_string(&key_path)?.as_bytes()).map_err(|_| {
                CertError::Pem {
                    path: key_path,
                    what: "private key",
                }
            })?;
        Ok(NodeIdentity {
            node,
            ca,
            chain,
            key,
        })
    }
}

fn read_string(path: &Path) -> Result<String, CertError> {
    std::fs::read_to_string(path).map_err(|source| CertError::Io {
        path: path.into(),
        source,
    })
}

/// Creates `dir` if missing; a folder this creates is readable by its owner only (0700).
fn private_dir(dir: &Path) -> Result<(), CertError> {
    if dir.is_dir() {
        return Ok(());
    }
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        b.mode(0o700);
    }
    b.create(dir).map_err(|source| CertError::Io {
        path: dir.into(),
        source,
    })
}

fn write_file(path: &Path, data: &[u8], secret: bool) -> Result<(), CertError> {
    let io = |source| CertError::Io {
        path: path.into(),
        source,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    opts.open(path)
        .and_then(|mut f| f.write_all(data))
        .map_err(io)
}
