//! The agent's EC2 calls against moto's EC2 server, an implementation of the
//! EC2 Query API written independently of this project: every
//! [`Cloud`] method on the happy path, checked for what a user of the
//! agent would check. The lab's own emulator is what the other tests run
//! against; it was written from the same reading of the API as the agent,
//! so a misreading could be shared by both. moto catches that: it is the
//! wire-level cross-check (issue 4), not a model of EC2's limits (it has
//! none, and no /28 prefixes; see [`prefixes_on_moto`]).
//!
//! moto runs inside a network namespace of its own (`vpcnet-moto-<pid>`),
//! as do the SDK's sockets, so nothing listens or connects in the host's
//! namespace. `cargo xtask setup` installs moto ([`vpcnet_lab::moto`]).
//!
//! Needs root (namespaces). Takes the lab's lock for the whole test: a lab's
//! teardown removes every `vpcnet-` namespace, this one's too.
//!
//! Run alone: `cargo test -p vpcnet-agent --test moto_cross_check -- --nocapture`
//! prints a table of each call and what came of it.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use aws_sdk_ec2::{
    config::{Credentials, Region},
    types::{InstanceType, NetworkInterface, ResourceType, Tag, TagSpecification},
};
use ipnet::Ipv4Net;
use vpcnet_agent::cloud::{
    Cloud, CloudError, CloudOptions, ENI_OWNER, EniInfo, NewEni, TAG_CLUSTER_NAME, TAG_CREATED_AT,
    TAG_ENI_OWNER, TAG_INSTANCE_ID, eni_description, managed_eni_tags,
};
use vpcnet_lab::moto::MOTO_SERVER;

/// moto's port inside the test's namespace: the namespace is new and
/// private, so any fixed port is free.
const PORT: u16 = 5000;
const REGION: &str = "us-east-1";
const VPC_CIDR: &str = "10.20.0.0/16";
const SUBNET_CIDR: &str = "10.20.11.0/24";
const CLUSTER: &str = "vpcnet-moto";
/// An AMI moto knows (its `EXAMPLE_AMI_ID`); `RunInstances` needs one.
const AMI: &str = "ami-12c6146b";
/// How long moto may take to listen: it starts in about a second; the
/// bound is there so a broken install fails the test instead of hanging it.
const STARTUP_PATIENCE: Duration = Duration::from_secs(30);
/// moto picks ids, MACs and addresses at random, the addresses with no
/// regard for those already taken: a new ENI's secondary address can be its
/// own primary (once in a dozen runs unseeded). Seeded (`/moto-api/seed`),
/// the pinned moto answers the same every run; with this seed its picks
/// are distinct and outside the subnet's reserved addresses.
const SEED: u32 = 4;
/// The pause between two connection attempts while moto starts.
const POLL_PAUSE: Duration = Duration::from_millis(20);

/// The test's namespaces are `vpcnet-moto-<pid>`.
const NS_PREFIX: &str = "vpcnet-moto-";

/// A network namespace of the test's own, removed when dropped (also when
/// the test fails).
struct Netns(String);

impl Netns {
    fn new(name: String) -> Self {
        // Ones left by runs killed before their guards ran: with the lab's
        // lock held, no other run is using any.
        let stale: Vec<String> = vpcnet_lab::netns::lab_namespaces()
            .unwrap_or_default()
            .into_iter()
            .filter(|ns| ns.starts_with(NS_PREFIX))
            .collect();
        let _ = vpcnet_lab::netns::delete_namespaces(&stale);
        vpcnet_lab::netns::create_namespaces(std::slice::from_ref(&name))
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        let netns = Self(name);
        vpcnet_lab::netns::ip_batch(Some(&netns.0), &["link set lo up".to_owned()])
            .unwrap_or_else(|e| panic!("bringing lo up in {}: {e}", netns.0));
        netns
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = vpcnet_lab::netns::delete_namespaces(std::slice::from_ref(&self.0)) {
            eprintln!("removing namespace {}: {e}", self.0);
        }
    }
}

/// moto's server, killed and reaped when dropped (also when the test
/// fails). Its output goes to a file, printed when it does not start.
struct Moto {
    child: Child,
    log: PathBuf,
}

impl Moto {
    /// Starts moto in `ns` and waits until it accepts connections.
    fn start(ns: &str) -> Self {
        let server = Path::new(MOTO_SERVER);
        assert!(
            server.exists(),
            "{MOTO_SERVER} is missing: run `cargo xtask setup` (it installs moto's EC2 server \
             from PyPI)"
        );
        let log = std::env::temp_dir().join(format!("{ns}.log"));
        let out = File::create(&log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let err = out.try_clone().unwrap();
        // nsenter (no --fork) execs moto_server in place: the child is moto.
        let mut command = Command::new("nsenter");
        // SAFETY: the closure runs in the child between fork and exec and
        // makes one async-signal-safe system call.
        unsafe {
            // Killed with the test's thread even if the test is killed
            // before its guards run (the signal survives exec: nsenter is
            // not set-uid).
            command.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
        let child = command
            .arg(format!(
                "--net={}",
                vpcnet_lab::netns::netns_path(ns).display()
            ))
            .arg("--")
            .arg(server)
            .args(["-H", "127.0.0.1", "-p", &PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {MOTO_SERVER} through nsenter: {e}"));
        let mut moto = Self { child, log };
        moto.wait_listening(ns);
        moto
    }

    /// Polls moto's port from inside `ns` until a connection succeeds, and
    /// then seeds moto's random numbers (see [`SEED`]).
    /// Nothing tells another process that a server has started listening,
    /// so this is a poll: connect attempts, each refused at once until moto
    /// binds, [`POLL_PAUSE`] between them, bounded by [`STARTUP_PATIENCE`],
    /// and a check that moto has not died meanwhile.
    fn wait_listening(&mut self, ns: &str) {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, PORT));
        let deadline = Instant::now() + STARTUP_PATIENCE;
        let child = &mut self.child;
        let waited = vpcnet_lab::run_in(ns, move || {
            loop {
                if let Ok(stream) = TcpStream::connect_timeout(&addr, POLL_PAUSE * 10) {
                    return seed(stream);
                }
                match child.try_wait() {
                    Ok(None) => {}
                    Ok(Some(status)) => {
                        return Err(format!("moto_server exited ({status}) before listening"));
                    }
                    Err(e) => return Err(format!("waiting on moto_server: {e}")),
                }
                if Instant::now() >= deadline {
                    return Err(format!(
                        "moto_server did not listen on {addr} within {STARTUP_PATIENCE:?}"
                    ));
                }
                std::thread::sleep(POLL_PAUSE);
            }
        })
        .unwrap();
        if let Err(why) = waited {
            panic!("{why}; its output:\n{}", self.output());
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Seeds moto's random numbers through its admin API, on `stream`.
fn seed(mut stream: TcpStream) -> Result<(), String> {
    let request = format!(
        "POST /moto-api/seed?a={SEED} HTTP/1.1\r\nHost: 127.0.0.1:{PORT}\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream
        .set_read_timeout(Some(STARTUP_PATIENCE))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .map_err(|e| format!("seeding moto: {e}"))?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .map_err(|e| format!("seeding moto: {e}"))?;
    let status = answer.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(())
    } else {
        Err(format!("seeding moto: {status:?}"))
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The world moto is given before the agent's calls: what a node finds
/// when it starts.
struct World {
    instance_id: String,
    subnet_id: String,
    security_group: String,
}

/// Makes the VPC, subnet, security group and instance with plain SDK calls.
async fn prepare(ec2: &aws_sdk_ec2::Client) -> World {
    let vpc = ec2.create_vpc().cidr_block(VPC_CIDR).send().await.unwrap();
    let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).unwrap().to_owned();
    let subnet = ec2
        .create_subnet()
        .vpc_id(&vpc_id)
        .cidr_block(SUBNET_CIDR)
        .send()
        .await
        .unwrap();
    let subnet_id = subnet
        .subnet()
        .and_then(|s| s.subnet_id())
        .unwrap()
        .to_owned();
    let security_group = ec2
        .create_security_group()
        .vpc_id(&vpc_id)
        .group_name("vpcnet-nodes")
        .description("vpcnet moto cross-check nodes")
        .send()
        .await
        .unwrap()
        .group_id()
        .unwrap()
        .to_owned();
    let run = ec2
        .run_instances()
        .image_id(AMI)
        .instance_type(InstanceType::M5Large)
        .subnet_id(&subnet_id)
        .security_group_ids(&security_group)
        .min_count(1)
        .max_count(1)
        .tag_specifications(
            TagSpecification::builder()
                .resource_type(ResourceType::Instance)
                .tags(Tag::builder().key("Name").value("vpcnet-node").build())
                .build(),
        )
        .send()
        .await
        .unwrap();
    let instance_id = run.instances()[0].instance_id().unwrap().to_owned();
    World {
        instance_id,
        subnet_id,
        security_group,
    }
}

/// The call → outcome table's header; [`row`] prints a row as soon as
/// the call is checked, so a failure shows how far the test got.
fn print_header() {
    println!("{:<34} outcome", "call");
    println!("{:-<34} {:-<60}", "", "");
}

fn row(call: &str, outcome: impl std::fmt::Display) {
    println!("{call:<34} {outcome}");
}

fn in_subnet(addr: Ipv4Addr) -> bool {
    SUBNET_CIDR.parse::<Ipv4Net>().unwrap().contains(&addr)
}

fn secondaries(eni: &EniInfo) -> BTreeSet<Ipv4Addr> {
    eni.secondary_addrs.iter().copied().collect()
}

/// Whether `mac` reads as `aa:bb:cc:dd:ee:ff` in lower case.
fn is_mac(mac: &str) -> bool {
    let parts: Vec<&str> = mac.split(':').collect();
    parts.len() == 6
        && parts.iter().all(|p| {
            p.len() == 2
                && p.chars()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        })
}

#[test]
fn cloud_calls_parse_and_behave_against_moto() {
    assert!(nix::unistd::geteuid().is_root(), "this test needs root");
    let _lock = vpcnet_lab::serial();
    // The SDK's default credential chain reads these first (moto takes any
    // signature); IMDS is off so the chain never waits on it. Set before any
    // client exists and before any other thread of this test runs.
    // SAFETY: this test binary has this one test; no other thread reads the
    // environment while it is written.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", "vpcnet-moto");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "vpcnet-moto");
        std::env::remove_var("AWS_SESSION_TOKEN");
        std::env::remove_var("AWS_PROFILE");
        std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
    }
    // Locals drop in reverse order: moto, then its namespace, then the lock.
    let netns = Netns::new(format!("{NS_PREFIX}{}", std::process::id()));
    let _moto = Moto::start(&netns.0);
    let endpoint = format!("http://127.0.0.1:{PORT}");
    vpcnet_lab::run_in(&netns.0, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(cross_check(&endpoint));
    })
    .unwrap();
}

async fn cross_check(endpoint: &str) {
    let ec2 = aws_sdk_ec2::Client::from_conf(
        aws_sdk_ec2::Config::builder()
            .region(Region::new(REGION))
            .credentials_provider(Credentials::for_tests())
            .endpoint_url(endpoint)
            .build(),
    );
    let world = prepare(&ec2).await;
    let cloud = Cloud::connect(CloudOptions {
        region: Some(REGION.to_owned()),
        ec2_endpoint: Some(endpoint.to_owned()),
        ..CloudOptions::default()
    })
    .await
    .unwrap();
    let check = Check { ec2, cloud, world };
    print_header();
    let primary = check.discovery().await;
    let (created, attachment) = check.create_and_attach().await;
    check.addresses(&created).await;
    check
        .tag_detach_delete(&created.id, &attachment, &primary)
        .await;
}

/// The calls, in the order a node makes them, in phases.
struct Check {
    /// Plain SDK calls, to look at what `EniInfo` does not carry.
    ec2: aws_sdk_ec2::Client,
    cloud: Cloud,
    world: World,
}

impl Check {
    /// What a node reads first: its limits, its subnet, its ENIs. Returns
    /// the instance's primary ENI.
    async fn discovery(&self) -> EniInfo {
        let (cloud, world) = (&self.cloud, &self.world);
        let instance = world.instance_id.as_str();
        let limits = cloud.instance_type_limits("m5.large").await.unwrap();
        assert_eq!((limits.max_enis, limits.ips_per_eni), (3, 10), "{limits:?}");
        assert_eq!(limits.vcpus, 2, "{limits:?}");
        row("instance_type_limits(m5.large)", format!("{limits:?}"));

        let subnet = cloud.subnet(&world.subnet_id).await.unwrap();
        assert_eq!(subnet.cidr.to_string(), SUBNET_CIDR);
        assert_eq!(subnet.id, world.subnet_id);
        // A /24 has 251 usable addresses; the instance holds one.
        assert!(
            (1..=251).contains(&subnet.available_addresses),
            "{subnet:?}"
        );
        row(
            "subnet",
            format!("{} {} free", subnet.cidr, subnet.available_addresses),
        );

        let before = cloud.instance_enis(instance).await.unwrap();
        assert_eq!(before.len(), 1, "the instance's primary ENI: {before:?}");
        let primary = &before[0];
        assert_eq!(primary.device_index, Some(0), "{primary:?}");
        assert!(primary.primary_addr.is_some_and(in_subnet), "{primary:?}");
        row(
            "instance_enis (before)",
            format!("{} device 0, {:?}", primary.id, primary.primary_addr),
        );

        before[0].clone()
    }

    /// A new ENI with addresses and tags, attached at device index 1.
    /// Returns it and its attachment id.
    async fn create_and_attach(&self) -> (EniInfo, String) {
        let (cloud, world, ec2) = (&self.cloud, &self.world, &self.ec2);
        let instance = world.instance_id.as_str();
        let security_groups = [world.security_group.clone()];
        let tags = managed_eni_tags(instance, Some(CLUSTER), &BTreeMap::new());
        let created = cloud
            .create_eni(&NewEni {
                subnet_id: &world.subnet_id,
                security_groups: &security_groups,
                instance_id: instance,
                tags: &tags,
                secondary_addrs: 3,
                prefixes: 0,
            })
            .await
            .unwrap();
        check_created(&created, world);
        let eni_id = created.id.clone();
        row(
            "create_eni (3 secondaries)",
            format!(
                "{eni_id} {} primary {:?}, secondaries {:?}, {} tags",
                created.mac,
                created.primary_addr,
                created.secondary_addrs,
                created.tags.len()
            ),
        );
        check_wire_fields(ec2, &eni_id, world).await;

        let attachment = cloud.attach_eni(&eni_id, instance, 1).await.unwrap();
        assert!(attachment.starts_with("eni-attach-"), "{attachment}");
        let enis = cloud.instance_enis(instance).await.unwrap();
        let attached = enis
            .iter()
            .find(|e| e.id == eni_id)
            .unwrap_or_else(|| panic!("instance_enis does not list {eni_id}: {enis:?}"));
        assert_eq!(enis.len(), 2, "{enis:?}");
        assert_eq!(attached.device_index, Some(1), "{attached:?}");
        assert_eq!(attached.attachment_id.as_deref(), Some(attachment.as_str()));
        assert_eq!(attached.attachment_status.as_deref(), Some("attached"));
        assert_eq!(attached.status, "in-use");
        assert_eq!(attached.mac, created.mac);
        let delete_on_termination = delete_on_termination(ec2, &eni_id).await;
        row(
            "attach_eni (device 1)",
            format!(
                "{attachment}; instance_enis: {} ENIs; deleteOnTermination {delete_on_termination} \
                 (moto ignores the modify)",
                enis.len()
            ),
        );

        (created, attachment)
    }

    /// Addresses and prefixes added to the attached ENI and taken back.
    async fn addresses(&self, created: &EniInfo) {
        let cloud = &self.cloud;
        let eni_id = &created.id;
        let original = secondaries(created);
        let returned = cloud.assign_addrs(eni_id, 2).await.unwrap();
        let after_assign = cloud.eni(eni_id).await.unwrap();
        let added: Vec<Ipv4Addr> = secondaries(&after_assign)
            .difference(&original)
            .copied()
            .collect();
        assert_eq!(added.len(), 2, "{after_assign:?} vs {original:?}");
        assert!(original.is_subset(&secondaries(&after_assign)));
        assert!(added.iter().all(|a| in_subnet(*a)), "{added:?}");
        // EC2 answers with the addresses it assigned; moto 5.2.5 answers with
        // every address of the ENI, its primary included. Either way the new
        // ones are in the answer, and the answer is exactly one or the other.
        let returned_set: BTreeSet<Ipv4Addr> = returned.iter().copied().collect();
        let every: BTreeSet<Ipv4Addr> = secondaries(&after_assign)
            .into_iter()
            .chain(after_assign.primary_addr)
            .collect();
        let returned_is = if returned_set == added.iter().copied().collect() {
            "the new ones"
        } else {
            assert_eq!(returned_set, every, "neither the new addresses nor all");
            "every address of the ENI (moto)"
        };
        row(
            "assign_addrs(2)",
            format!("{added:?} added; the reply lists {returned_is}"),
        );

        cloud.unassign_addrs(eni_id, &added).await.unwrap();
        let after_unassign = cloud.eni(eni_id).await.unwrap();
        assert_eq!(secondaries(&after_unassign), original);
        row(
            "unassign_addrs",
            format!("{} secondaries left", after_unassign.secondary_addrs.len()),
        );

        row("assign_prefixes(1)", prefixes_on_moto(cloud, eni_id).await);
    }

    /// A tag, then the ENI's end: detached (and found as a leak
    /// candidate), deleted, and what describing and deleting it again say.
    async fn tag_detach_delete(&self, eni_id: &str, attachment: &str, primary: &EniInfo) {
        let cloud = &self.cloud;
        let instance = self.world.instance_id.as_str();
        cloud
            .tag(eni_id, &[("vpcnet.test/cross-check", "moto")])
            .await
            .unwrap();
        let tagged = cloud.eni(eni_id).await.unwrap();
        assert_eq!(
            tagged
                .tags
                .get("vpcnet.test/cross-check")
                .map(String::as_str),
            Some("moto"),
            "{:?}",
            tagged.tags
        );
        assert_eq!(
            tagged.tags.len(),
            5,
            "the new tag joins the others: {:?}",
            tagged.tags
        );
        row("tag", format!("{} tags", tagged.tags.len()));

        cloud.detach_eni(attachment).await.unwrap();
        let detached = cloud.eni(eni_id).await.unwrap();
        assert_eq!(detached.status, "available", "{detached:?}");
        let still = cloud.instance_enis(instance).await.unwrap();
        assert!(still.iter().all(|e| e.id != eni_id), "{still:?}");
        let leaked = cloud.detached_agent_enis(Some(CLUSTER)).await.unwrap();
        assert_eq!(
            leaked.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
            [eni_id]
        );
        let other = cloud
            .detached_agent_enis(Some("another-cluster"))
            .await
            .unwrap();
        assert!(
            other.is_empty(),
            "another cluster's filter matched: {other:?}"
        );
        let any = cloud.detached_agent_enis(None).await.unwrap();
        assert_eq!(any.len(), 1, "{any:?}");
        row(
            "detach_eni + detached_agent_enis",
            format!("status {}, listed for {CLUSTER} only", detached.status),
        );

        cloud.delete_eni(eni_id).await.unwrap();
        let gone = cloud.eni(eni_id).await.unwrap_err();
        // `eni` describes with a filter, and a filter matching nothing is an
        // empty answer, not an error: "gone" reads as the reply having no
        // NetworkInterface (the address manager counts that as deleted).
        assert!(
            matches!(
                gone,
                CloudError::Incomplete {
                    field: "NetworkInterface",
                    ..
                }
            ),
            "{gone:?}"
        );
        assert_eq!(gone.code(), None);
        assert!(!gone.is_retryable(), "{gone:?}");
        row("delete_eni; eni()", format!("Err({gone})"));

        let again = cloud.delete_eni(eni_id).await.unwrap_err();
        assert_eq!(
            again.code(),
            Some("InvalidNetworkInterfaceID.NotFound"),
            "{again:?}"
        );
        assert!(
            matches!(
                again,
                CloudError::Api {
                    status: Some(400),
                    ..
                }
            ),
            "{again:?}"
        );
        assert!(!again.is_retryable(), "{again:?}");
        assert!(!again.is_throttling() && !again.is_subnet_exhausted());
        row("delete_eni (again)", format!("Err({again})"));

        let after = cloud.instance_enis(instance).await.unwrap();
        assert_eq!(after.len(), 1, "{after:?}");
        assert_eq!(after[0].id, primary.id);
        row("instance_enis (after)", format!("{} ENI", after.len()));
    }
}

/// What `create_eni` returns: a MAC, a primary address and the secondaries
/// asked for, all in the subnet, and aws-node's three tags.
fn check_created(eni: &EniInfo, world: &World) {
    assert!(eni.id.starts_with("eni-"), "{eni:?}");
    assert!(is_mac(&eni.mac), "{eni:?}");
    assert_eq!(eni.subnet_id, world.subnet_id);
    assert_eq!(eni.status, "available", "{eni:?}");
    assert_eq!(eni.attachment_id, None);
    assert_eq!(eni.device_index, None);
    assert!(eni.primary_addr.is_some_and(in_subnet), "{eni:?}");
    assert_eq!(eni.secondary_addrs.len(), 3, "{eni:?}");
    assert!(eni.secondary_addrs.iter().all(|a| in_subnet(*a)), "{eni:?}");
    let all: BTreeSet<Ipv4Addr> = eni
        .secondary_addrs
        .iter()
        .copied()
        .chain(eni.primary_addr)
        .collect();
    assert_eq!(all.len(), 4, "addresses repeat: {eni:?}");
    assert!(eni.prefixes.is_empty(), "{eni:?}");
    assert_eq!(
        eni.tags.get(TAG_INSTANCE_ID).map(String::as_str),
        Some(world.instance_id.as_str())
    );
    assert_eq!(
        eni.tags.get(TAG_CLUSTER_NAME).map(String::as_str),
        Some(CLUSTER)
    );
    let created_at = eni.tags.get(TAG_CREATED_AT).expect("createdAt tag");
    aws_sdk_ec2::primitives::DateTime::from_str(
        created_at,
        aws_sdk_ec2::primitives::DateTimeFormat::DateTime,
    )
    .unwrap_or_else(|e| panic!("createdAt {created_at:?} is not RFC 3339: {e}"));
    assert_eq!(
        eni.tags.get(TAG_ENI_OWNER).map(String::as_str),
        Some(ENI_OWNER)
    );
    assert_eq!(eni.tags.len(), 4, "{:?}", eni.tags);
    assert!(!eni.no_manage());
}

/// ENI `eni_id` as moto describes it to the SDK.
async fn described(ec2: &aws_sdk_ec2::Client, eni_id: &str) -> NetworkInterface {
    let out = ec2
        .describe_network_interfaces()
        .network_interface_ids(eni_id)
        .send()
        .await
        .unwrap();
    out.network_interfaces()[0].clone()
}

/// What `EniInfo` does not carry but the agent sends: the description
/// aws-node gives its ENIs and the security group.
async fn check_wire_fields(ec2: &aws_sdk_ec2::Client, eni_id: &str, world: &World) {
    let eni = described(ec2, eni_id).await;
    assert_eq!(
        eni.description(),
        Some(eni_description(&world.instance_id).as_str())
    );
    let groups: Vec<&str> = eni.groups().iter().filter_map(|g| g.group_id()).collect();
    assert_eq!(groups, [world.security_group.as_str()]);
}

/// `attach_eni` also sets delete-on-termination (through
/// `ModifyNetworkInterfaceAttribute`), so a terminated node leaks no ENI.
/// moto 5.2.5 answers that call but ignores its `Attachment.*` parameters
/// (it applies only groups, source/dest check and description), so the flag
/// stays as attach made it: what is checked here is that the call parsed
/// and that the flag is described. Returns the flag, for the table.
async fn delete_on_termination(ec2: &aws_sdk_ec2::Client, eni_id: &str) -> bool {
    let eni = described(ec2, eni_id).await;
    let attachment = eni.attachment().unwrap();
    attachment
        .delete_on_termination()
        .unwrap_or_else(|| panic!("no deleteOnTermination: {attachment:?}"))
}

/// `assign_prefixes` and `unassign_prefixes` on moto. moto 5.2.5 has no
/// /28 prefixes: it reads neither `Ipv4PrefixCount` nor `Ipv4Prefix.N`, so
/// `AssignPrivateIpAddresses` with only a prefix count assigns nothing and
/// answers with the ENI's addresses and no prefixes, and the unassign is a
/// no-op. What can be checked is that both calls go through and parse, that
/// the answer holds no prefix, and that the ENI is left as it was. If a
/// later moto assigns prefixes, they are checked for real.
async fn prefixes_on_moto(cloud: &Cloud, eni_id: &str) -> String {
    let before = cloud.eni(eni_id).await.unwrap();
    let prefixes = cloud
        .assign_prefixes(eni_id, 1)
        .await
        .unwrap_or_else(|e| panic!("assign_prefixes on moto: {e:?}"));
    let after = cloud.eni(eni_id).await.unwrap();
    assert_eq!(after.prefixes, prefixes);
    cloud.unassign_prefixes(eni_id, &prefixes).await.unwrap();
    let unassigned = cloud.eni(eni_id).await.unwrap();
    assert!(unassigned.prefixes.is_empty(), "{unassigned:?}");
    assert_eq!(secondaries(&unassigned), secondaries(&before));
    match prefixes[..] {
        [] => {
            assert_eq!(secondaries(&after), secondaries(&before));
            "Ok([]): moto ignores Ipv4PrefixCount (no prefixes)".to_owned()
        }
        [prefix] => {
            assert_eq!(prefix.prefix_len(), 28);
            assert!(SUBNET_CIDR.parse::<Ipv4Net>().unwrap().contains(&prefix));
            format!("{prefix}, unassigned again")
        }
        _ => panic!("one prefix asked for, got {prefixes:?}"),
    }
}
