//! Where moto, the independent EC2 server the agent's cloud calls are
//! cross-checked against, is installed. `cargo xtask setup` installs it
//! there; the agent's `moto_cross_check` test starts it from there. Both read
//! these constants, so the place is written once.
//!
//! moto is installed with pip. Debian's Python is "externally managed" (PEP 668:
//! pip refuses to install into the system), so it lives in a virtualenv of
//! its own, under `/var/lib` because a machine keeps it across reboots
//! (`/run` is a tmpfs) and a second setup then finds it and does nothing.

/// The virtualenv moto is installed into, made with `python3 -m venv`.
pub const MOTO_VENV: &str = "/var/lib/vpcnet-lab/venv";

/// The virtualenv's Python (its pip is `MOTO_PYTHON -m pip`).
pub const MOTO_PYTHON: &str = "/var/lib/vpcnet-lab/venv/bin/python3";

/// moto's server executable, started as
/// `moto_server -H 127.0.0.1 -p PORT`.
pub const MOTO_SERVER: &str = "/var/lib/vpcnet-lab/venv/bin/moto_server";

/// What pip installs: moto with its server's dependencies (flask), pinned
/// so the cross-check's expectations of moto's behaviour stay true.
pub const MOTO_REQUIREMENT: &str = "moto[server]==5.2.5";
