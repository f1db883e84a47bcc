//! How the programs sit on an interface's tc hooks.
//!
//! From 6.6 the kernel has TCX: each program is a bpf link, pinned under
//! `links/`, that outlives the agent and takes a new program in one atomic
//! swap. Before 6.6 (Amazon Linux 2023's 6.1) there is only the clsact
//! qdisc with `cls_bpf` filters. There vpcnet creates the qdisc when the
//! interface has none, and puts one filter on each hook at a fixed priority
//! and handle ([`FILTER_PRIORITY`], [`FILTER_HANDLE`]). A filter is not tied
//! to the process that added it, so it stays when the agent exits, however
//! it exits; the next agent finds it by its priority and handle and
//! replaces its program in place (`RTM_NEWTFILTER` on the existing handle:
//! one filter, swapped under RCU, no gap and never two). The program is
//! pinned where a TCX link would be, so the next agent knows which program
//! each interface carries, and `uninstall` which filters to delete.

use std::path::Path;

use aya::programs::{
    SchedClassifier, TcAttachType,
    links::Link as _,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
};
use tracing::debug;

use super::DatapathError;

/// How the programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// TCX links (6.6 and later), pinned.
    Tcx,
    /// A clsact qdisc and `cls_bpf` filters (any kernel; the only way before
    /// 6.6).
    Clsact,
}

/// Chooses the attach mode instead of the kernel's (`tcx` or `clsact`): for
/// tests of the clsact path on a TCX kernel, and for nodes where another
/// tool must see packets before vpcnet in the clsact chain.
pub const ENV_TC_ATTACH: &str = "VPCNET_TC_ATTACH";

impl AttachMode {
    /// TCX where the kernel has it (6.6), clsact before; `VPCNET_TC_ATTACH`
    /// overrides.
    pub fn from_env() -> Result<Self, DatapathError> {
        match std::env::var(ENV_TC_ATTACH).ok().as_deref() {
            None | Some("") => Ok(Self::of_kernel()),
            Some("tcx") => Ok(Self::Tcx),
            Some("clsact") => Ok(Self::Clsact),
            Some(other) => Err(DatapathError::AttachMode(other.to_owned())),
        }
    }

    /// The running kernel's: TCX from 6.6.
    pub fn of_kernel() -> Self {
        let tcx = aya::util::KernelVersion::new(6, 6, 0);
        if aya::util::KernelVersion::current().is_ok_and(|current| current >= tcx) {
            Self::Tcx
        } else {
            Self::Clsact
        }
    }
}

/// The priority of vpcnet's filters. What else attaches on the same hooks
/// decides it. The AWS network policy agent puts its filters on pod veths
/// at priority 1 (handle 1); they answer allow (`TC_ACT_OK`) or drop,
/// and either ends the chain. Running after them, a drop stands, and an
/// allowed packet skips vpcnet's pod program and takes the node's stack,
/// where the ENI's programs still translate and steer it: slower, never
/// wrong, and network policy stays enforced. Sharing priority 1 would make
/// the order depend on who attached first. Filters added without a
/// priority get 49152 and below, after ours.
pub const FILTER_PRIORITY: u16 = 2;

/// The handle of vpcnet's filters: not 1, the handle the network policy
/// agent's clean-up deletes on pod veths whatever the priority.
pub const FILTER_HANDLE: TcHandle = TcHandle::new(0, 0x5650);

const ENOENT: i32 = 2;
const EEXIST: i32 = 17;
/// What the kernel answers a filter change on an interface with no clsact.
const EINVAL: i32 = 22;

fn netlink_errno(error: &aya::programs::ProgramError) -> Option<i32> {
    match error {
        aya::programs::ProgramError::TcError(TcError::NetlinkError(e)) => e.raw_os_error(),
        _ => None,
    }
}

/// Puts `program` on `iface`'s `direction` hook: replaces the program of
/// vpcnet's filter in place when it is there, adds the filter (and the
/// clsact qdisc) when it is not. The filter stays after this process.
pub fn attach(
    program: &mut SchedClassifier,
    name: &'static str,
    iface: &str,
    direction: TcAttachType,
) -> Result<(), DatapathError> {
    let err = |source| DatapathError::Program { name, source };
    let existing =
        SchedClassifierLink::attached(iface, direction, FILTER_PRIORITY, FILTER_HANDLE, None)
            .map_err(|_| DatapathError::NoInterface(iface.to_owned()))?;
    let id = match program.attach_to_link(existing) {
        Ok(id) => id,
        // No filter of ours there yet (or not even the qdisc).
        Err(e) if netlink_errno(&e).is_some_and(|errno| errno == ENOENT || errno == EINVAL) => {
            add_clsact(iface)?;
            program
                .attach_with_options(
                    iface,
                    direction,
                    TcAttachOptions::Netlink(NlOptions {
                        priority: FILTER_PRIORITY,
                        handle: FILTER_HANDLE,
                        classid: None,
                    }),
                )
                .map_err(err)?
        }
        Err(e) => return Err(err(e)),
    };
    // Dropping the link would delete the filter: it must outlive us.
    std::mem::forget(program.take_link(id).map_err(err)?);
    Ok(())
}

/// Adds a clsact qdisc to `iface` unless it has one.
fn add_clsact(iface: &str) -> Result<(), DatapathError> {
    match tc::qdisc_add_clsact(iface) {
        Ok(()) | Err(TcError::AlreadyAttached) => Ok(()),
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(EEXIST) => Ok(()),
        Err(source) => Err(DatapathError::Clsact {
            iface: iface.to_owned(),
            source,
        }),
    }
}

/// Deletes vpcnet's filters from both hooks of `iface`, if it has them.
pub fn detach(iface: &str) {
    for direction in [TcAttachType::Ingress, TcAttachType::Egress] {
        let Ok(link) =
            SchedClassifierLink::attached(iface, direction, FILTER_PRIORITY, FILTER_HANDLE, None)
        else {
            return;
        };
        if let Err(e) = link.detach() {
            debug!(interface = iface, ?direction, error = %e, "no filter of vpcnet to delete");
        }
    }
}

/// Pins `program` at `path` (the clsact mode's record of a filter),
/// replacing what was pinned there in one step: pinned beside it, then
/// renamed over it, so that an agent killed meanwhile leaves the old
/// record or the new one, never none (a link directory short of a record
/// is attached again from scratch, its filters deleted first).
pub fn pin_program(
    program: &mut SchedClassifier,
    name: &'static str,
    path: &Path,
) -> Result<(), DatapathError> {
    let pin_err = |source| DatapathError::LinkPin {
        path: path.to_owned(),
        source,
    };
    // bpffs refuses dots in names.
    let beside = path.with_file_name(format!(
        "{}_new",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    match std::fs::remove_file(&beside) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(pin_err(source)),
    }
    program
        .pin(&beside)
        .map_err(|e| pin_err(std::io::Error::other(e)))?;
    crate::crash_points::step("a filter's record pinned beside the old one");
    std::fs::rename(&beside, path)
        .map_err(pin_err)
        .map(|()| debug!(program = name, pin = %path.display(), "filter recorded"))
}
