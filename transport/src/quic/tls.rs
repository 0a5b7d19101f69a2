//! rustls configurations for mutual TLS against the cluster CA (ring provider, TLS 1.3,
//! TLS13_AES_128_GCM_SHA256 only — the same suite for QUIC and for the TLS-over-TCP baseline),
//! and the quinn endpoint/transport configurations built from a [`super::QuicConfig`].
use super::{QuicConfig, QuicError};
use crate::certs::{node_server_name, NodeIdentity};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use std::sync::Arc;

/// ALPN protocol of the QUIC transport.
pub const ALPN: &[u8] = b"trellis/1";

/// The ring provider restricted to TLS13_AES_128_GCM_SHA256.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
    Arc::new(p)
}

fn roots(ca: &CertificateDer<'static>) -> Result<Arc<RootCertStore>, QuicError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(ca.clone())
        .map_err(|e| QuicError::Tls(format!("cluster CA: {e}")))?;
    Ok(Arc::new(roots))
}

fn tls(e: rustls::Error) -> QuicError {
    QuicError::Tls(e.to_string())
}

/// Server side: presents `id`'s certificate, requires a client certificate signed by its CA.
pub fn server_config(id: &NodeIdentity, alpn: &[u8]) -> Result<rustls::ServerConfig, QuicError> {
    let provider = crypto_provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(&id.ca)?, provider.clone())
        .build()
        .map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(tls)?;
    cfg.alpn_protocols = vec![alpn.to_vec()];
    Ok(cfg)
}

/// Client side: trusts only `ca`; presents `id`'s certificate when given (tests build
/// certificate-less clients to check they are refused).
pub fn client_config(
    ca: &CertificateDer<'static>,
    id: Option<&NodeIdentity>,
    alpn: &[u8],
) -> Result<rustls::ClientConfig, QuicError> {
    let builder = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_root_certificates(roots(ca)?);
    let mut cfg = match id {
        Some(id) => builder
            .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
            .map_err(tls)?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![alpn.to_vec()];
    Ok(cfg)
}

/// True if `cert` (already verified against the CA) is valid for node `node`'s name.
pub fn cert_is_for_node(cert: &CertificateDer<'_>, node: u32) -> bool {
    let Ok(cert) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(node_server_name(node)) else {
        return false;
    };
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

/// quinn's transport parameters from `cfg`.
pub fn transport_config(cfg: &QuicConfig) -> Result<quinn::TransportConfig, QuicError> {
    let varint = |what: &str, v: u64| {
        quinn::VarInt::from_u64(v)
            .map_err(|_| QuicError::Endpoint(format!("{what} {v} out of range")))
    };
    let mut t = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(cfg.idle_timeout).map_err(|_| {
        QuicError::Endpoint(format!("idle timeout {:?} out of range", cfg.idle_timeout))
    })?;
    t.max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(cfg.keep_alive))
        .stream_receive_window(varint("stream window", cfg.stream_window)?)
        .receive_window(varint("connection window", cfg.conn_window)?)
        .send_window(cfg.send_window)
        .max_concurrent_uni_streams(cfg.max_streams.into())
        .max_concurrent_bidi_streams(4u32.into())
        .enable_segmentation_offload(cfg.gso);
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(cfg.max_udp_payload.max(1200))
        .black_hole_cooldown(cfg.mtu_black_hole_cooldown);
    if let (None, Some(lo)) = (cfg.known_mtu, cfg.loopback_mtu()) {
        // Loopback: the interface's MTU is the path's, so one probe at it suffices (a
        // minimum change spanning the whole range makes the search probe the upper bound
        // at once). Packets start at 1200 bytes: quinn pads handshake packets and loss
        // probes to the minimum MTU, and before the path is validated it may send only 3x
        // what it received.
        mtu.upper_bound(lo)
            .minimum_change(lo.saturating_sub(1200).max(1));
    }
    t.mtu_discovery_config(Some(mtu));
    if let Some(known) = cfg.known_mtu {
        let known = known.clamp(1200, cfg.max_udp_payload.max(1200));
        t.initial_mtu(known).min_mtu(known);
    }
    Ok(t)
}

/// quinn server and client configurations for node `id`.
pub fn quinn_configs(
    cfg: &QuicConfig,
    id: &NodeIdentity,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), QuicError> {
    let transport = Arc::new(transport_config(cfg)?);
    let server = quinn::crypto::rustls::QuicServerConfig::try_from(server_config(id, ALPN)?)
        .map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server));
    server.transport_config(transport.clone());
    let client =
        quinn::crypto::rustls::QuicClientConfig::try_from(client_config(&id.ca, Some(id), ALPN)?)
            .map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client));
    client.transport_config(transport);
    Ok((server, client))
}
