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
use vpcnet_bpf_tests::ipam::{IpamLab, holdings, pod};
use vpcnet_lab::ipam_checkpoint_file;

/// Released addresses rest one second: churn reuses them.
const ENV: &[(&str, &str)] = &[("IP_COOLDOWN_PERIOD", "1")];
/// Cycles of the crash test.
const CYCLES: usize = 1000;
/// Live pods at most (m5.large holds 27).
const LIVE_PODS: usize = 15;

fn lab_lock() -> vpcnet_lab::LabLock {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the address-manager tests need root (network namespaces, eBPF)"
    );
    let lock = vpcnet_lab::serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    lock
}

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

/// Restarts a killed agent and reconnects.
fn restart(lab: &mut IpamLab, pid: &AtomicI32, restarts: &mut usize) {
    lab.lab.kill_agent().expect("reaping the killed agent");
    lab.lab.start_agent().expect("restarting the agent");
    lab.connect();
    pid.store(agent_pid(lab), Ordering::SeqCst);
    *restarts += 1;
}

#[test]
fn sigkill_during_churn_never_hands_an_address_out_twice_nor_loses_one() {
    let _lock = lab_lock();
    // No cooldown: a released address is handed out again at once, the
    // hardest case for double assignment.
    let mut lab = IpamLab::up("m5.large", &[("IP_COOLDOWN_PERIOD", "0")]);
    let instance = lab.emulator().instance_id().to_owned();
    let pid = Arc::new(AtomicI32::new(agent_pid(&lab)));
    let stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let (pid, stop) = (Arc::clone(&pid), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut kills = 0;
            while !stop.load(Ordering::SeqCst) {
                // A random point in time: requests, checkpoint writes and
                // EC2 calls are all in flight somewhere in between.
                std::thread::park_timeout(Duration::from_millis(150 + fastrand::u64(0..600)));
                let victim = pid.swap(0, Ordering::SeqCst);
                if victim > 0 && !stop.load(Ordering::SeqCst) {
                    let _ = nix::sys::signal::kill(Pid::from_raw(victim), Signal::SIGKILL);
                    kills += 1;
                }
            }
            kills
        })
    };

    // The model: which pod holds which address, by the agent's answers.
    let mut held: BTreeMap<usize, Ipv4Addr> = BTreeMap::new();
    let mut restarts = 0;
    let mut next_pod = 0;
    let started = Instant::now();
    for cycle in 0..CYCLES {
        let id = next_pod;
        next_pod += 1;
        let addr = loop {
            match lab.add(id) {
                Ok(reply) => break reply.ipv4_addr.parse::<Ipv4Addr>().expect("an address"),
                Err(status) if agent_gone(&status) => restart(&mut lab, &pid, &mut restarts),
                Err(status) => panic!("cycle {cycle}: ADD of pod {id}: {status}"),
            }
        };
        if let Some((other, _)) = held.iter().find(|(_, a)| **a == addr) {
            panic!("cycle {cycle}: {addr} handed to pod {id} while pod {other} holds it");
        }
        held.insert(id, addr);
        // A retried ADD (the kubelet does it) gets the same address, also
        // across a restart.
        if cycle % 50 == 0 {
            let (&old, &old_addr) = held.iter().next().expect("a pod");
            let again = loop {
                match lab.add(old) {
                    Ok(reply) => break reply.ipv4_addr.parse::<Ipv4Addr>().expect("an address"),
                    Err(status) if agent_gone(&status) => restart(&mut lab, &pid, &mut restarts),
                    Err(status) => panic!("cycle {cycle}: repeated ADD of pod {old}: {status}"),
                }
            };
            assert_eq!(again, old_addr, "cycle {cycle}: pod {old}'s address moved");
        }
        if held.len() > LIVE_PODS || cycle == CYCLES - 1 {
            let victims: Vec<usize> = if cycle == CYCLES - 1 {
                held.keys().copied().collect()
            } else {
                let keys: Vec<usize> = held.keys().copied().collect();
                vec![keys[fastrand::usize(0..keys.len())]]
            };
            for victim in victims {
                loop {
                    match lab.del(victim) {
                        // None: the DEL before a kill had released it.
                        Ok(released) => {
                            if let Some(released) = released {
                                assert_eq!(released, held[&victim], "DEL released another address");
                            }
                            break;
                        }
                        Err(status) if agent_gone(&status) => {
                            restart(&mut lab, &pid, &mut restarts);
                        }
                        Err(status) => panic!("cycle {cycle}: DEL of pod {victim}: {status}"),
                    }
                }
                held.remove(&victim);
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    killer.thread().unpark();
    let kills = killer.join().expect("the killer thread");
    // The killer may have taken the last pid (and killed it) after the last call.
    if pid.load(Ordering::SeqCst) == 0 {
        restart(&mut lab, &pid, &mut restarts);
    }
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
