//! What the lab's differential tests share: the same cases run through the
//! VPC CNI's iptables wiring and through the eBPF datapath give a table
//! each, printed side by side, compared with each other, and each checked
//! against what the VPC CNI does.
//!
//! A test keeps its own cases, outcomes and far ends; it tells this module
//! how to print and check them by implementing [`Row`] for its case type
//! (and [`FarEnd`] for the ends its whoami servers stand at).
//!
//! Where a run leaves the reference out ([`reference_half`]), the eBPF
//! table is checked against what the VPC CNI does alone.

use std::{
    fmt::{self, Debug},
    net::{Ipv4Addr, SocketAddrV4},
};

use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    WhoamiServer,
    test_sizes::{REFERENCE_LABS_VAR, reference_labs},
};

use crate::lab_counter;

/// A row's key in a differential table: how it prints and what the VPC CNI
/// does for it.
pub trait Row: Debug + PartialEq {
    /// What one case did, in one datapath.
    type Outcome: Debug + PartialEq;

    /// The key columns: their headers and widths, in order.
    const COLUMNS: &'static [(&'static str, usize)];
    /// The width of the iptables column (the ebpf one is last, unpadded).
    const OUTCOME_WIDTH: usize;

    /// The key columns' cells, one per [`Row::COLUMNS`].
    fn cells(&self) -> Vec<String>;

    /// How `outcome` reads in this row.
    fn describe(&self, outcome: &Self::Outcome) -> String;

    /// What the VPC CNI does.
    fn expected(&self) -> Self::Outcome;
}

/// The iptables reference's half of a differential test: what `run`
/// returns, or `None` where this run leaves the reference out
/// ([`REFERENCE_LABS_VAR`]); then vpcnet's half is held to the expectations
/// the reference meets where it runs.
pub fn reference_half<T>(run: impl FnOnce() -> T) -> Option<T> {
    if reference_labs() {
        Some(run())
    } else {
        println!(
            "the iptables reference is not run here ({REFERENCE_LABS_VAR}=0): vpcnet is held to \
             what the reference does where it runs"
        );
        None
    }
}

/// Every case of a run in the order it ran, with what it did.
pub type Table<C> = [(C, <C as Row>::Outcome)];

/// The two tables side by side, with a mark where they differ; without
/// the reference's, the eBPF one beside what the VPC CNI does.
pub struct SideBySide<'a, C: Row> {
    pub iptables: Option<&'a Table<C>>,
    pub ebpf: &'a Table<C>,
}

impl<C: Row> fmt::Display for SideBySide<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = C::OUTCOME_WIDTH;
        for (header, column) in C::COLUMNS {
            write!(f, "{header:<column$} ")?;
        }
        let reference_header = if self.iptables.is_some() {
            "iptables (VPC CNI)"
        } else {
            "expected (VPC CNI)"
        };
        writeln!(f, "{reference_header:<width$} ebpf (vpcnet)")?;
        for (index, (case, ebpf)) in self.ebpf.iter().enumerate() {
            let expected;
            let iptables = if let Some(table) = self.iptables {
                let (iptables_case, outcome) = &table[index];
                assert_eq!(
                    case, iptables_case,
                    "both runs probe the same cases in order"
                );
                outcome
            } else {
                expected = case.expected();
                &expected
            };
            let cells = case.cells();
            assert_eq!(cells.len(), C::COLUMNS.len(), "a cell per key column");
            for (cell, (_, column)) in cells.iter().zip(C::COLUMNS) {
                write!(f, "{cell:<column$} ")?;
            }
            let differs = if iptables == ebpf { "" } else { "  <- differs" };
            writeln!(
                f,
                "{:<width$} {}{differs}",
                case.describe(iptables),
                case.describe(ebpf),
            )?;
        }
        Ok(())
    }
}

/// The rows where the two datapaths did not do the same.
pub fn differences<C: Row>(iptables: Option<&Table<C>>, ebpf: &Table<C>) -> Vec<String> {
    iptables
        .unwrap_or_default()
        .iter()
        .zip(ebpf)
        .filter(|((_, a), (_, b))| a != b)
        .map(|((case, a), (_, b))| format!("{case:?}: iptables {a:?}, ebpf {b:?}"))
        .collect()
}

/// The rows of either datapath that are not what the VPC CNI does,
/// iptables' first.
pub fn wrong_rows<C: Row>(iptables: Option<&Table<C>>, ebpf: &Table<C>) -> Vec<String> {
    iptables
        .map(|table| ("iptables", table))
        .into_iter()
        .chain([("ebpf", ebpf)])
        .flat_map(|(datapath, table)| {
            table.iter().filter_map(move |(case, outcome)| {
                let want = case.expected();
                (*outcome != want)
                    .then(|| format!("{datapath} {case:?}: got {outcome:?}, expected {want:?}"))
            })
        })
        .collect()
}

/// The datapaths did the same, and what the VPC CNI does.
///
/// # Panics
///
/// Listing the rows that differ and the wrong ones, when there are any.
pub fn assert_same_and_expected<C: Row>(iptables: Option<&Table<C>>, ebpf: &Table<C>) {
    let differences = differences(iptables, ebpf);
    let wrong = wrong_rows(iptables, ebpf);
    assert!(
        differences.is_empty() && wrong.is_empty(),
        "the datapaths differ:\n{}\nnot what the VPC CNI does:\n{}",
        differences.join("\n"),
        wrong.join("\n")
    );
}

/// Prints `title` over the two tables side by side, then asserts as
/// [`assert_same_and_expected`].
///
/// # Panics
///
/// As [`assert_same_and_expected`].
pub fn show_and_assert<C: Row>(title: &str, iptables: Option<&Table<C>>, ebpf: &Table<C>) {
    println!("{title}\n{}", SideBySide { iptables, ebpf });
    assert_same_and_expected(iptables, ebpf);
}

/// The lab's agent's drop counters that are not zero, as `name = value`.
pub fn lab_drops() -> Vec<String> {
    Counter::ALL
        .iter()
        .filter(|counter| counter.is_drop())
        .map(|&counter| (counter, lab_counter(counter)))
        .filter(|(_, value)| *value > 0)
        .map(|(counter, value)| format!("{} = {value}", counter.name()))
        .collect()
}

/// An end of the lab a whoami server can stand at.
pub trait FarEnd: Copy + PartialEq {
    fn addr(self) -> Ipv4Addr;
    /// The network namespace it is in.
    fn ns(self) -> String;
    fn name(self) -> String;
}

/// A whoami server at each of some ends, removed on drop.
pub struct WhoamiServers<E> {
    servers: Vec<(E, WhoamiServer)>,
}

impl<E: FarEnd> WhoamiServers<E> {
    /// Starts one at each of `ends`, listening on `port` (TCP and UDP).
    ///
    /// # Panics
    ///
    /// When one does not start.
    pub fn start(ends: impl IntoIterator<Item = E>, port: u16) -> Self {
        let servers = ends
            .into_iter()
            .map(|end| {
                let server = WhoamiServer::start(&end.ns(), SocketAddrV4::new(end.addr(), port))
                    .unwrap_or_else(|e| panic!("whoami server for {}: {e}", end.name()));
                (end, server)
            })
            .collect();
        Self { servers }
    }

    /// The one at `end`.
    ///
    /// # Panics
    ///
    /// When `end` has none.
    pub fn at(&self, end: E) -> &WhoamiServer {
        self.servers
            .iter()
            .find_map(|(e, server)| (*e == end).then_some(server))
            .expect("a server per end")
    }
}
