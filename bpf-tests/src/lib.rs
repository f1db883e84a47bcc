//! Helpers for the tests that load the real programs: a loaded datapath in
//! its own pin directory, packets built with etherparse, and checksum checks
//! written independently of the code under test.

pub mod aws_node_wiring;
pub mod aws_policy_agent;
pub mod bulk;
pub mod crashes;
pub mod cri;
pub mod differential;
pub mod echo;
pub mod flood;
pub mod fuzz;
pub mod half_closed;
pub mod hooks;
pub mod idle;
pub mod ipam;
pub mod loaded;
pub mod netpol;
pub mod packets;
pub mod scrape;

use std::{
    mem::ManuallyDrop,
    net::Ipv4Addr,
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::programs::{TestRun, TestRunOptions};
use ipnet::Ipv4Net;
use loaded::Loaded;
use vpcnet_agent::{
    datapath::{Datapath, DatapathError, LoadOptions, remove_pins},
    snat::SnatSettings,
};
use vpcnet_common::{
    cidr::CidrKind,
    counters::Counter,
    endpoint::{Endpoint, Eni},
    maps,
};

/// tc's "pass, let the next program see it", "drop" and "redirected".
pub const TC_ACT_UNSPEC: i32 = -1;
pub const TC_ACT_SHOT: i32 = 2;
pub const TC_ACT_REDIRECT: i32 = 7;

/// The device a `BPF_PROG_TEST_RUN` packet arrives on (loopback): in the
/// routing tests, the pod's own veth.
pub const TEST_RUN_IFINDEX: u32 = 1;

/// The lab's addresses (DESIGN.md), used for crafted packets too.
pub const NODE: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 162);
pub const POD: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 20);
pub const POD2: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 21);
pub const PEER: Ipv4Addr = Ipv4Addr::new(10, 20, 12, 50);
pub const INET: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const ONPREM: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// A node-local address outside the VPC (the one `NodeLocal DNSCache` uses).
pub const NODE_LOCAL_DNS: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
/// The EKS default service CIDR.
pub const SERVICE_CIDR: &str = "10.100.0.0/16";
pub const VPC_CIDRS: [&str; 2] = ["10.20.0.0/16", "100.64.0.0/16"];

/// The kernel's own `ip rule`s (as `ip rule show` prints them): all an eBPF
/// node has.
pub const KERNEL_RULES: [&str; 3] = [
    "0:\tfrom all lookup local",
    "32766:\tfrom all lookup main",
    "32767:\tfrom all lookup default",
];

static NEXT_ID: AtomicU32 = AtomicU32::new(0);

/// The real programs, loaded with maps pinned in a directory of their own
/// that is removed on drop ([`Harness::load_in`]), or taken from those this
/// process loaded before, their maps emptied and unpinned
/// ([`Harness::new`]).
pub struct Harness {
    /// Taken out on drop, to be handed back.
    pub datapath: ManuallyDrop<Datapath>,
    /// `None` for programs taken from the process' loaded ones.
    pin_dir: Option<PathBuf>,
    /// What goes with programs to hand back when the test passed.
    reusable: Option<Loaded>,
}

/// What a program did with a packet.
#[derive(Debug)]
pub struct Outcome {
    pub action: i32,
    pub packet: Vec<u8>,
}

impl Harness {
    /// A pin directory of its own for a harness (see [`Harness::load_in`]).
    pub fn new_pin_dir() -> PathBuf {
        PathBuf::from(format!(
            "/sys/fs/bpf/vpcnet-test-{}-{}",
            std::process::id(),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Loads the programs with `nat_entries` flows per NAT map over what is
    /// pinned in `pin_dir` (as a starting agent does), nothing configured;
    /// `pin_dir` is removed on drop, also when loading fails.
    pub fn load_in(pin_dir: PathBuf, nat_entries: u32) -> Result<Self, DatapathError> {
        Self::load_sized(
            pin_dir,
            nat_entries,
            LoadOptions::default().stack_flow_entries,
        )
    }

    /// As [`Harness::load_in`], the stack flows map holding
    /// `stack_flow_entries` halves.
    pub fn load_sized(
        pin_dir: PathBuf,
        nat_entries: u32,
        stack_flow_entries: u32,
    ) -> Result<Self, DatapathError> {
        let loaded = Datapath::load(&LoadOptions {
            pin_dir: pin_dir.clone(),
            nat_entries,
            stack_flow_entries,
            ..LoadOptions::default()
        });
        match loaded {
            Ok(datapath) => Ok(Self {
                datapath: ManuallyDrop::new(datapath),
                pin_dir: Some(pin_dir),
                reusable: None,
            }),
            Err(e) => {
                let _ = remove_pins(&pin_dir);
                Err(e)
            }
        }
    }

    /// The programs with `nat_entries` flows per NAT map (loaded once per
    /// process, see [`loaded`]) and the lab's node configured with
    /// `settings`.
    pub fn new(settings: &SnatSettings, nat_entries: u32) -> Self {
        let (loaded, datapath) = Loaded::take(nat_entries).unwrap_or_else(|e| {
            panic!("loading the programs (run as root, after `cargo xtask setup`): {e:?}")
        });
        let mut harness = Self {
            datapath: ManuallyDrop::new(datapath),
            pin_dir: None,
            reusable: Some(loaded),
        };
        harness.configure(settings);
        let cidrs: Vec<(Ipv4Net, CidrKind)> = VPC_CIDRS
            .iter()
            .map(|c| (c.parse().unwrap(), CidrKind::Vpc))
            .chain(
                settings
                    .exclude_snat_cidrs
                    .iter()
                    .map(|n| (*n, CidrKind::Excluded)),
            )
            .chain([NODE, NODE_LOCAL_DNS].map(|a| (Ipv4Net::new(a, 32).unwrap(), CidrKind::Local)))
            .chain(std::iter::once((
                SERVICE_CIDR.parse().unwrap(),
                CidrKind::Service,
            )))
            .collect();
        harness.datapath.maps.set_cidrs(&cidrs).unwrap();
        harness
    }

    /// The lab's defaults: SNAT on, prng ports.
    pub fn lab_default() -> Self {
        Self::new(&SnatSettings::default(), maps::NAT_DEFAULT_ENTRIES)
    }

    pub fn configure(&mut self, settings: &SnatSettings) {
        let mut cfg = settings.datapath_config(NODE, 0x5eed_1234);
        // The primary ENI stays what `add_eni` made it.
        cfg.primary_ifindex = self
            .datapath
            .maps
            .config()
            .map_or(0, |old| old.primary_ifindex);
        self.datapath.maps.set_config(&cfg).unwrap();
    }

    /// Runs `program` on `packet` once.
    pub fn run(&self, program: &'static str, packet: &[u8]) -> Outcome {
        let prog = self.datapath.program(program).unwrap();
        let mut out = vec![0u8; packet.len() + 256];
        let opts = TestRunOptions {
            data_in: Some(packet),
            data_out: Some(&mut out),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).expect("BPF_PROG_TEST_RUN");
        out.truncate(result.data_size_out as usize);
        Outcome {
            // tc actions are ints; the kernel hands them back as u32.
            action: i32::from_ne_bytes(result.return_value.to_ne_bytes()),
            packet: out,
        }
    }

    /// Runs `program` on `packet` carrying skb mark `mark`; returns what it
    /// did and the mark it left.
    pub fn run_with_mark(&self, program: &'static str, packet: &[u8], mark: u32) -> (Outcome, u32) {
        self.try_run_with_mark(program, packet, mark)
            .expect("BPF_PROG_TEST_RUN")
    }

    /// [`Harness::run_with_mark`], or the kernel's refusal of the frame
    /// (`BPF_PROG_TEST_RUN` takes no IPv4 frame shorter than an IPv4
    /// header, though tc on a real link may meet one).
    pub fn try_run_with_mark(
        &self,
        program: &'static str,
        packet: &[u8],
        mark: u32,
    ) -> Result<(Outcome, u32), aya::programs::ProgramError> {
        // `struct __sk_buff`: `mark` is its third u32; the kernel takes a
        // shorter context and zero-fills the rest.
        const SKB_CTX_LEN: usize = 12;
        const SKB_MARK_OFF: usize = 8;
        let prog = self.datapath.program(program).unwrap();
        let mut ctx_in = [0u8; SKB_CTX_LEN];
        ctx_in[SKB_MARK_OFF..].copy_from_slice(&mark.to_ne_bytes());
        // The kernel hands back its whole `struct __sk_buff` (192 bytes here).
        let mut ctx_out = [0u8; 256];
        let mut out = vec![0u8; packet.len() + 256];
        let opts = TestRunOptions {
            data_in: Some(packet),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts)?;
        out.truncate(result.data_size_out as usize);
        let mark_out = u32::from_ne_bytes(ctx_out[SKB_MARK_OFF..SKB_CTX_LEN].try_into().unwrap());
        let outcome = Outcome {
            action: i32::from_ne_bytes(result.return_value.to_ne_bytes()),
            packet: out,
        };
        Ok((outcome, mark_out))
    }

    pub fn egress(&self, packet: &[u8]) -> Outcome {
        self.run(maps::PROG_ENI_EGRESS, packet)
    }

    pub fn ingress(&self, packet: &[u8]) -> Outcome {
        self.run(maps::PROG_ENI_INGRESS, packet)
    }

    pub fn counter(&self, counter: Counter) -> u64 {
        self.datapath.maps.counter(counter).unwrap()
    }

    /// Puts a local pod in the endpoint map.
    pub fn add_endpoint(&mut self, addr: Ipv4Addr, endpoint: &Endpoint) {
        self.datapath.maps.set_endpoint(addr, endpoint).unwrap();
    }

    /// Puts an ENI (link index, gateway) in the ENI map.
    pub fn add_eni(&mut self, ifindex: u32, gateway: Ipv4Addr, flags: u32) {
        let eni = Eni {
            gateway: vpcnet_common::addr_to_raw(gateway.octets()),
            flags,
        };
        self.datapath.maps.set_eni(ifindex, &eni).unwrap();
    }

    /// Entries in the forward and the reverse NAT map.
    pub fn table_sizes(&self) -> (usize, usize) {
        let maps = &self.datapath.maps;
        (maps.nat_fwd.keys().count(), maps.nat_rev.keys().count())
    }

    /// Runs `program` and asserts the packet passed untouched, counted as `verdict`.
    pub fn assert_untouched(&self, program: &'static str, packet: &[u8], verdict: Counter) {
        let before = self.counter(verdict);
        let out = self.run(program, packet);
        assert_eq!(out.action, TC_ACT_UNSPEC, "{verdict:?}");
        assert_eq!(
            out.packet, packet,
            "packet must pass untouched ({verdict:?})"
        );
        assert_eq!(
            self.counter(verdict),
            before + 1,
            "{verdict:?} must count it"
        );
    }

    pub fn assert_egress_untouched(&self, packet: &[u8], verdict: Counter) {
        self.assert_untouched(maps::PROG_ENI_EGRESS, packet, verdict);
    }

    pub fn assert_ingress_untouched(&self, packet: &[u8], verdict: Counter) {
        self.assert_untouched(maps::PROG_ENI_INGRESS, packet, verdict);
    }

    /// Runs `program` and asserts the packet was dropped for `reason`.
    pub fn assert_dropped(&self, program: &'static str, packet: &[u8], reason: Counter) {
        let before = self.counter(reason);
        let out = self.run(program, packet);
        assert_eq!(out.action, TC_ACT_SHOT, "expected a drop for {reason:?}");
        assert_eq!(self.counter(reason), before + 1, "{reason:?} must count it");
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never read again.
        let datapath = unsafe { ManuallyDrop::take(&mut self.datapath) };
        if let Some(pin_dir) = &self.pin_dir {
            let _ = remove_pins(pin_dir);
        }
        // A failed test's maps may be in any state: not for the next one.
        if let Some(loaded) = self.reusable.take()
            && !std::thread::panicking()
        {
            loaded.give_back(datapath);
        }
    }
}

/// The agent binary cargo built next to this test (`cargo test --workspace`
/// builds every workspace binary; `cargo xtask test` does that).
pub fn agent_binary() -> PathBuf {
    workspace_binary("vpcnet-agent")
}

/// The image `cargo xtask image --bin-dir target/debug` builds from the
/// workspace's binaries (`cargo xtask test` builds it before the tests),
/// deployed as the working tree's kustomization says.
pub fn agent_image() -> vpcnet_lab::AgentImage {
    let image = image_dir().join(format!(
        "vpcnet-{}-debug.oci.tar",
        env!("CARGO_PKG_VERSION")
    ));
    assert!(
        image.is_file(),
        "{} is missing: build it with `cargo xtask image --bin-dir target/debug` \
         (`cargo xtask test` does)",
        image.display()
    );
    vpcnet_lab::AgentImage::new(image)
}

/// The previous commit's image (`HEAD~1`'s binaries, `cargo xtask image
/// --commit HEAD~1`, which `cargo xtask test` runs before the tests),
/// deployed as that commit's kustomization says: what a rolling update
/// starts from.
pub fn previous_agent_image() -> vpcnet_lab::AgentImage {
    let output = std::process::Command::new("git")
        .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "HEAD~1"])
        .output()
        .expect("running git");
    let commit = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    assert!(
        output.status.success() && commit.len() == 40,
        "no previous commit here (a shallow clone?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let image = image_dir().join(format!("vpcnet-{}-debug.oci.tar", &commit[..8]));
    assert!(
        image.is_file(),
        "{} is missing: build it with `cargo xtask image --commit HEAD~1` \
         (`cargo xtask test` does)",
        image.display()
    );
    vpcnet_lab::AgentImage {
        deploy_commit: Some(commit),
        ..vpcnet_lab::AgentImage::new(image)
    }
}

/// `target/image`, beside this test's profile directory.
fn image_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/image
    exe.ancestors()
        .nth(3)
        .map(|target| target.join("image"))
        .expect("the target directory")
}

/// The CNI plugin binary, likewise.
pub fn cni_plugin_binary() -> PathBuf {
    workspace_binary("vpcnet-cni")
}

fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let bin = exe
        .parent()
        .and_then(std::path::Path::parent)
        .map(|dir| dir.join(name))
        .expect("test executable under target/<profile>/deps");
    assert!(
        bin.is_file(),
        "{} is missing: build it first (`cargo build --workspace --bins`, or run `cargo xtask test`)",
        bin.display()
    );
    bin
}

/// Runs the agent's CLI in the lab's node namespace (where its pins and
/// interfaces are) and returns its stdout.
pub fn agent_cli(args: &[&str]) -> String {
    let bin = agent_binary();
    let out = std::process::Command::new("nsenter")
        .arg(format!(
            "--net=/var/run/netns/{}",
            vpcnet_lab::addrs::NS_NODE
        ))
        .arg(&bin)
        .args(args)
        .output()
        .expect("running nsenter");
    assert!(
        out.status.success(),
        "vpcnet-agent {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A datapath counter of the lab's running agent.
pub fn lab_counter(counter: Counter) -> u64 {
    agent_cli(&["counters", "--all"])
        .lines()
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            (fields.next() == Some(counter.name()))
                .then(|| fields.next().and_then(|v| v.parse().ok()))?
        })
        .unwrap_or_else(|| panic!("counter {} not printed by the agent", counter.name()))
}

/// A NAT flow as the pinned table holds it: the original tuple (source,
/// destination, ports, protocol) and the translation (address, port).
pub type NatTuple = (u32, u32, u16, u16, u8, u32, u16);

/// The lab agent's NAT table now (its maps pinned at the default place).
pub fn pinned_nat_table() -> std::collections::BTreeSet<NatTuple> {
    vpcnet_agent::datapath::DatapathMaps::open_pinned(std::path::Path::new(maps::PIN_DIR))
        .and_then(|maps| maps.flows())
        .expect("reading the NAT table")
        .into_iter()
        .map(|f| {
            let k = f.key;
            (
                k.saddr, k.daddr, k.sport, k.dport, k.proto, f.fwd.addr, f.fwd.port,
            )
        })
        .collect()
}

/// The lab agent's NAT flows toward `server`: those of a test's long
/// connections, which a restart must keep whatever it takes. (The node's
/// own short ones, the agent's to IMDS, end by their timeouts meanwhile
/// when a restart is slow.)
pub fn pinned_nat_flows_to(server: std::net::SocketAddrV4) -> std::collections::BTreeSet<NatTuple> {
    let (addr, port) = (
        vpcnet_common::addr_to_raw(server.ip().octets()),
        vpcnet_common::port_to_raw(server.port()),
    );
    pinned_nat_table()
        .into_iter()
        .filter(|&(_, daddr, _, dport, ..)| daddr == addr && dport == port)
        .collect()
}
