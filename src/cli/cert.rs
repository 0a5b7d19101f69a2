//! `trellis cert`: the cluster certificate authority and per-node certificates (mutual TLS).
use anyhow::Result;
use clap::{Args, Subcommand};
use std::path::PathBuf;
use trellis_transport::certs;

#[derive(Debug, Clone, Args)]
pub struct CertArgs {
    #[command(subcommand)]
    pub action: CertAction,
    /// Folder holding ca.pem, ca.key and node-N.{pem,key}.
    #[arg(long, global = true, default_value = "certs")]
    pub dir: PathBuf,
}

#[derive(Debug, Clone, Subcommand)]
pub enum CertAction {
    /// Create the cluster certificate authority (refuses to overwrite one).
    Init {
        /// Days the CA certificate is valid.
        #[arg(long, default_value_t = certs::DEFAULT_CA_DAYS)]
        days: u32,
    },
    /// Issue the certificate and key of node N, signed by the cluster CA (refuses to
    /// overwrite existing ones without --force).
    Issue {
        #[arg(long)]
        node: u32,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = certs::DEFAULT_NODE_DAYS)]
        days: u32,
        /// Replace the node's existing certificate and key.
        #[arg(long)]
        force: bool,
    },
}

pub fn run(a: CertArgs) -> Result<()> {
    match a.action {
        CertAction::Init { days } => {
            certs::ClusterCa::init_for(&a.dir, days)?;
            println!("cluster CA written to {}", a.dir.join("ca.pem").display());
        }
        CertAction::Issue { node, days, force } => {
            let ca = certs::ClusterCa::load(&a.dir)?;
            let (cert, key) = ca.issue_with(&a.dir, node, days, force)?;
            println!(
                "node {node}: certificate {} and key {}",
                cert.display(),
                key.display()
            );
        }
    }
    Ok(())
}
