//! The address manager's durability: killed with SIGKILL at random points
//! of 1000 assign/release cycles it never hands an address out twice and
//! loses none; started on a node aws-node managed, it takes over aws-node's
//! checkpoint (written here by hand from the VPC CNI's format) without
//! moving a pod.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test ipam_restart -- --test-threads=1 --nocapture`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicI32, Ordering},
    },
    time::{Duration, Instant},
};

use nix::{sys::signal::Signal, unistd::Pid};
use tonic::Code;
use vpcnet_bpf_tests::ipam::{IpamLab, holdings, lab_lock, pod};
use vpcnet_lab::ipam_checkpoint_file;

/// Released addresses rest one second: churn reuses them.
const ENV: &[(&str, &str)] = &[("IP_COOLDOWN_PERIOD", "1")];
/// Cycles of the crash test.
const CYCLES: usize = 1000;
/// Live pods at most (m5.large holds 27).
const LIVE_PODS: usize = 15;

/// The agent's pid, 0 while it is down.
fn agent_pid(lab: &IpamLab) -> i32 {
    lab.lab.state().agent.as_ref().map_or(0, |a| a.pid)
}

/// Whether a failed call means "the agent is gone" (the killer struck).
fn agent_gone(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Internal
    ) && !status.message().contains("failed to assign")
}

/// The agent under test and what it takes to keep it running: the
/// killer thread's view of its pid, and the restarts so far.
struct Crashing {
    lab: IpamLab,
    pid: Arc<AtomicI32>,
    restarts: usize,
}

impl Crashing {
    /// Restarts a killed agent and reconnects.
    fn restart(&mut self) {
        self.lab.lab.kill_agent().expect("reaping the killed agent");
        self.lab.lab.start_agent().expect("restarting the agent");
        self.lab.connect();
        self.pid.store(agent_pid(&self.lab), Ordering::SeqCst);
        self.restarts += 1;
    }

    /// ADD, retried across kills as the kubelet retries it.
    fn add(&mut self, id: usize) -> Ipv4Addr {
        loop {
            match self.lab.add(id) {
                Ok(reply) => return reply.ipv4_addr.parse().expect("an address"),
                Err(status) if agent_gone(&status) => self.restart(),
                Err(status) => panic!("ADD of pod {id}: {status}"),
            }
        }
    }

    /// DEL, retried across kills.
    fn del(&mut self, id: usize) -> Option<Ipv4Addr> {
        loop {
            match self.lab.del(id) {
                Ok(released) => return released,
                Err(status) if agent_gone(&status) => self.restart(),
                Err(status) => panic!("DEL of pod {id}: {status}"),
            }
        }
    }
}

/// Kills the agent whose pid `pid` holds at random moments until `stop`;
/// returns how many times it did.
fn killer(pid: Arc<AtomicI32>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut kills = 0;
        while !stop.load(Ordering::SeqCst) {
            // A random point in time: requests, checkpoint writes and EC2
            // calls are all in flight somewhere in between.
            std::thread::park_timeout(Duration::from_millis(150 + fastrand::u64(0..600)));
            let victim = pid.swap(0, Ordering::SeqCst);
            if victim > 0 && !stop.load(Ordering::SeqCst) {
                let _ = nix::sys::signal::kill(Pid::from_raw(victim), Signal::SIGKILL);
                kills += 1;
            }
        }
        kills
    })
}

#[test]
fn sigkill_during_churn_never_hands_an_address_out_twice_nor_loses_one() {
    let _lock = lab_lock();
    // No cooldown: a released address is handed out again at once, the
    // hardest case for double assignment.
    let lab = IpamLab::up("m5.large", &[("IP_COOLDOWN_PERIOD", "0")]);
    let instance = lab.emulator().instance_id().to_owned();
    let pid = Arc::new(AtomicI32::new(agent_pid(&lab)));
    let stop = Arc::new(AtomicBool::new(false));
    let killer = killer(Arc::clone(&pid), Arc::clone(&stop));
    let mut node = Crashing {
        lab,
        pid: Arc::clone(&pid),
        restarts: 0,
    };

    // The model: which pod holds which address, by the agent's answers.
    // Pod `cycle` is added in cycle `cycle`.
    let mut held: BTreeMap<usize, Ipv4Addr> = BTreeMap::new();
    let started = Instant::now();
    for cycle in 0..CYCLES {
        let addr = node.add(cycle);
        if let Some((other, _)) = held.iter().find(|(_, a)| **a == addr) {
            panic!("cycle {cycle}: {addr} handed to pod {cycle} while pod {other} holds it");
        }
        held.insert(cycle, addr);
        // A retried ADD (the kubelet does it) gets the same address, also
        // across a restart.
        if cycle % 50 == 0 {
            let (&old, &old_addr) = held.iter().next().expect("a pod");
            assert_eq!(
                node.add(old),
                old_addr,
                "cycle {cycle}: pod {old}'s address moved"
            );
        }
        let victims: Vec<usize> = if cycle == CYCLES - 1 {
            held.keys().copied().collect()
        } else if held.len() > LIVE_PODS {
            let keys: Vec<usize> = held.keys().copied().collect();
            vec![keys[fastrand::usize(0..keys.len())]]
        } else {
            Vec::new()
        };
        for victim in victims {
            // None: the DEL before a kill had released it already.
            if let Some(released) = node.del(victim) {
                assert_eq!(released, held[&victim], "DEL released another address");
            }
            held.remove(&victim);
        }
    }
    stop.store(true, Ordering::SeqCst);
    killer.thread().unpark();
    let kills = killer.join().expect("the killer thread");
    // The killer may have taken the last pid (and killed it) after the last call.
    if pid.load(Ordering::SeqCst) == 0 {
        node.restart();
    }
    let Crashing {
        mut lab, restarts, ..
    } = node;
    let elapsed = started.elapsed();

    // Nothing held, on disk and in the agent.
    let status = lab.status();
    assert_eq!(
        status.assigned_addrs, 0,
        "addresses still assigned after every DEL"
    );
    let checkpoint = std::fs::read_to_string(ipam_checkpoint_file()).expect("the checkpoint");
    let checkpoint: serde_json::Value = serde_json::from_str(&checkpoint).expect("JSON");
    assert_eq!(
        checkpoint["allocations"].as_array().map_or(0, Vec::len),
        0,
        "checkpoint allocations left: {checkpoint}"
    );
    // None lost: every address EC2 has on the node's ENIs is in the pool.
    let settled = lab.wait_status("the pool matching EC2", Duration::from_secs(30), |s| {
        s.assigned_addrs == 0
    });
    let ec2 = holdings(&lab.ec2_state(), &instance);
    assert_eq!(
        ec2.pod_addrs.len(),
        settled.total_addrs as usize,
        "addresses EC2 holds for the node vs. the agent's pool"
    );
    assert!(
        ec2.detached_enis.is_empty(),
        "leaked ENIs: {:?}",
        ec2.detached_enis
    );
    assert!(kills >= 3, "the agent was killed only {kills} times");
    println!(
        "{CYCLES} assign/release cycles in {:.1} s with {kills} SIGKILLs ({restarts} restarts): double assignments 0, addresses lost 0, leaked ENIs 0",
        elapsed.as_secs_f64()
    );
    lab.lab.down().expect("taking the lab down");
}

#[test]
fn takes_over_aws_nodes_checkpoint_without_moving_a_pod() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up("m5.large", ENV);
    let instance = lab.emulator().instance_id().to_owned();
    let state = lab.wait_ec2("the warm pool", Duration::from_secs(30), |s| {
        holdings(s, &instance).pod_addrs.len() >= 9
    });
    let running: Vec<Ipv4Addr> = holdings(&state, &instance)
        .pod_addrs
        .into_iter()
        .take(3)
        .collect();

    // As aws-node leaves /var/run/aws-node/ipam.json (pkg/ipamd/datastore's
    // CheckpointData, version vpc-cni-ipam/1), written by hand.
    lab.lab.stop_agent().expect("stopping the agent");
    let entries: Vec<String> = running
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let key = pod(1000 + i);
            format!(
                r#"{{"networkName":"aws-cni","containerID":"{}","ifName":"eth0","ipv4":"{addr}","allocationTimestamp":1732000000000000000,"metadata":{{"k8sPodNamespace":"default","k8sPodName":"web-{i}"}}}}"#,
                key.container_id
            )
        })
        .collect();
    let checkpoint = format!(
        r#"{{"version":"vpc-cni-ipam/1","allocations":[{}]}}"#,
        entries.join(",")
    );
    std::fs::write(ipam_checkpoint_file(), checkpoint).expect("writing aws-node's checkpoint");
    // Their host veths, as aws-node's plugin named them: the agent's sweep
    // leaves an address alone while its pod's veth is there.
    for i in 0..running.len() {
        let veth = vpcnet_api::pod::host_veth_name("eni", "default", &format!("web-{i}"));
        vpcnet_lab::exec_ok(
            vpcnet_lab::addrs::NS_NODE,
            &[
                "ip",
                "link",
                "add",
                &veth,
                "type",
                "veth",
                "peer",
                "name",
                &format!("{veth}p"),
            ],
        )
        .expect("an aws-node pod's veth");
    }
    lab.lab
        .start_agent()
        .expect("starting the agent on aws-node's node");
    lab.connect();

    let status = lab.status();
    assert_eq!(
        status.assigned_addrs, 3,
        "aws-node's pods hold their addresses"
    );
    // The running pods' retried ADDs get their own addresses back.
    for (i, addr) in running.iter().enumerate() {
        let reply = lab.add(1000 + i).expect("ADD of a running pod");
        assert_eq!(
            reply.ipv4_addr,
            addr.to_string(),
            "running pod web-{i} moved"
        );
    }
    // New pods never get them.
    let (new, _) = lab.fill(0, 100);
    let new: BTreeSet<Ipv4Addr> = new.into_iter().collect();
    assert_eq!(new.len(), 27 - 3, "the rest of the node's capacity");
    for addr in &running {
        assert!(
            !new.contains(addr),
            "{addr} of a running pod handed out again"
        );
    }
    assert_eq!(lab.del(1001).expect("DEL"), Some(running[1]));
    println!(
        "took over aws-node's checkpoint: 3 running pods kept their addresses, 24 new pods got others"
    );
    lab.lab.down().expect("taking the lab down");
}
