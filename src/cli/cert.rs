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
    Init,
    /// Issue the certificate and key of node N, signed by the cluster CA.
    Issue {
        #[arg(long)]
        node: u32,
    },
}

pub fn run(a: CertArgs) -> Result<()> {
    match a.action {
        CertAction::Init => {
            certs::init(&a.dir)?;
            println!("cluster CA written to {}", a.dir.join("ca.pem").display());
        }
        CertAction::Issue { node } => {
            let (cert, key) = certs::issue(&a.dir, node)?;
            println!(
                "node {node}: certificate {} and key {}",
                cert.display(),
                key.display()
            );
        }
    }
    Ok(())
}
