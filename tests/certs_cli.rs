//! `trellis cert` as an operator uses it: keys are never overwritten by accident, validity is
//! bounded and configurable, and the certificate folder is private.
mod binary;

use binary::trellis;

fn cert(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    trellis()
        .arg("cert")
        .args(args)
        .arg("--dir")
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn issue_refuses_to_overwrite_a_key_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("certs");
    assert!(cert(&dir, &["init"]).status.success());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "the certificate folder is private");
        let key = std::fs::metadata(dir.join("ca.key")).unwrap();
        assert_eq!(key.permissions().mode() & 0o777, 0o600);
    }
    assert!(cert(&dir, &["issue", "--node", "1"]).status.success());
    let key = std::fs::read(dir.join("node-1.key")).unwrap();
    let again = cert(&dir, &["issue", "--node", "1"]);
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        err.contains("node-1.key") && err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.join("node-1.key")).unwrap(),
        key,
        "untouched"
    );
    let forced = cert(&dir, &["issue", "--node", "1", "--force", "--days", "30"]);
    assert!(forced.status.success());
    assert_ne!(
        std::fs::read(dir.join("node-1.key")).unwrap(),
        key,
        "replaced"
    );
    // A second CA is never created over the first.
    assert!(!cert(&dir, &["init"]).status.success());
}

#[test]
fn validity_is_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("certs");
    for days in ["0", "36501"] {
        let out = cert(&dir, &["init", "--days", days]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("out of range"), "{err}");
    }
    assert!(cert(&dir, &["init", "--days", "90"]).status.success());
}

#[cfg(unix)]
#[test]
fn launch_keeps_its_certificates_in_a_private_folder() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("cluster");
    let out = trellis()
        .args([
            "launch",
            "--nodes",
            "2",
            "--partitions",
            "2",
            "--epochs",
            "1",
        ])
        .args([
            "--data",
            "synthetic:nodes=300,degree=5,features=8,classes=3,seed=1",
        ])
        .arg("--dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mode = std::fs::metadata(dir.join("certs"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o700, "the launcher's certificate folder is private");
}
