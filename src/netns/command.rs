//! Running iproute2 (`ip`, `tc`) with checked exit status, and the privilege check.
//!
//! The network is built by shelling out rather than speaking netlink (`rtnetlink`): the set-up
//! is a few dozen commands once per run, so their cost does not matter, and each failure
//! then carries the exact command line and iproute2's own message, which say more to an
//! operator than a netlink errno. `rtnetlink` would also pull an async netlink stack into the
//! binary for this alone.
use super::NetError;
use std::process::Command;

/// Runs `program args...`; its stdout on success, else an error with the command line, the
/// exit status and its stderr.
pub(super) fn run(program: &str, args: &[&str]) -> Result<String, NetError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| NetError::Spawn {
            program: program.to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(NetError::Command {
            command: format!("{program} {}", args.join(" ")),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Capability bits (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;

/// Fails unless this process may build the network: CAP_NET_ADMIN (links, addresses, qdiscs)
/// and CAP_SYS_ADMIN (`ip netns add` bind-mounts the namespace; `setns` into it).
pub fn check_privileges() -> Result<(), NetError> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = parse_cap_eff(&status).unwrap_or(0);
    let missing: Vec<&str> = [
        (CAP_NET_ADMIN, "CAP_NET_ADMIN"),
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"),
    ]
    .into_iter()
    .filter(|(bit, _)| effective & (1u64 << bit) == 0)
    .map(|(_, name)| name)
    .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(NetError::NotPermitted {
            missing: missing.join(" and "),
        })
    }
}

/// The effective capability set from `/proc/self/status` text (`CapEff:\t000001ffffffffff`).
fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_capabilities_are_read_from_proc_status() {
        let s = "Name:\ttrellis\nCapInh:\t0000000000000000\nCapEff:\t0000000000001000\n";
        assert_eq!(parse_cap_eff(s), Some(1 << CAP_NET_ADMIN));
        assert_eq!(parse_cap_eff("Name: x\n"), None);
    }

    #[test]
    fn a_failing_command_names_itself_and_its_stderr() {
        let e = run("sh", &["-c", "echo no such device >&2; exit 3"]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("`sh -c echo no such device >&2; exit 3`"),
            "{text}"
        );
        assert!(
            text.contains("exit status: 3") && text.ends_with(": no such device"),
            "{text}"
        );
        let e = run("trellis-no-such-program", &[]).unwrap_err();
        assert!(e.to_string().contains("iproute2"), "{e}");
    }
}
