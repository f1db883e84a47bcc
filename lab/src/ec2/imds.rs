//! IMDSv2 from the same state as the EC2 API: a session token first
//! (`PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`,
//! 1 to 21600), then GETs carrying it (`X-aws-ec2-metadata-token`; 401
//! without it or once it has expired). The instance answering is the one
//! whose ENI owns the request's source address, as on EC2 where the
//! metadata service is per instance.
//!
//! An ENI appears under `network/interfaces/macs/` only once its
//! attachment is complete: the agent must wait for it, as on EC2.

use std::{
    collections::HashMap,
    fmt::Write,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use super::{
    model::{Ec2State, Eni, Instance, Rng},
    xml::timestamp_secs,
};

/// The TTL header of the token request (and of its answer).
pub const TOKEN_TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
/// The header GETs carry the token in.
pub const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";
/// The longest token life IMDS grants.
pub const MAX_TOKEN_TTL_SECS: u64 = 21_600;

/// An IMDS answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub body: String,
    /// The TTL header on token answers.
    pub ttl: Option<u64>,
    pub content_type: &'static str,
}

impl Reply {
    fn text(body: impl Into<String>) -> Self {
        Self {
            status: 200,
            body: body.into(),
            ttl: None,
            content_type: "text/plain",
        }
    }

    fn json(body: String) -> Self {
        Self {
            status: 200,
            body,
            ttl: None,
            content_type: "application/json",
        }
    }

    fn status(status: u16, body: &str) -> Self {
        Self {
            status,
            body: body.to_owned(),
            ttl: None,
            content_type: "text/plain",
        }
    }
}

/// The tokens handed out, with their expiry.
#[derive(Debug)]
pub struct Tokens {
    rng: Rng,
    tokens: HashMap<String, Instant>,
}

impl Tokens {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed ^ 0x7043_e457),
            tokens: HashMap::new(),
        }
    }

    fn issue(&mut self, ttl: Duration, now: Instant) -> String {
        self.tokens.retain(|_, expiry| *expiry > now);
        let token = format!(
            "AQAEA{:016x}{:016x}",
            self.rng.next_u64(),
            self.rng.next_u64()
        );
        self.tokens.insert(token.clone(), now + ttl);
        token
    }

    fn is_valid(&self, token: &str, now: Instant) -> bool {
        self.tokens.get(token).is_some_and(|expiry| *expiry > now)
    }
}

/// One IMDS request.
#[derive(Debug)]
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub token: Option<&'a str>,
    pub ttl: Option<&'a str>,
    pub source: Ipv4Addr,
}

/// Answers one request. `now_ms` is wall-clock time (credentials' expiry),
/// `now` the monotonic clock (tokens' expiry).
pub fn handle(
    state: &Ec2State,
    tokens: &mut Tokens,
    request: &Request<'_>,
    now: Instant,
    now_ms: u64,
) -> Reply {
    let path = request.path.split('?').next().unwrap_or_default();
    if path == "/latest/api/token" {
        if request.method != "PUT" {
            return Reply::status(405, "Method Not Allowed");
        }
        let Some(ttl) = request
            .ttl
            .and_then(|ttl| ttl.trim().parse::<u64>().ok())
            .filter(|ttl| (1..=MAX_TOKEN_TTL_SECS).contains(ttl))
        else {
            return Reply::status(400, "Bad Request");
        };
        let token = tokens.issue(Duration::from_secs(ttl), now);
        return Reply {
            ttl: Some(ttl),
            ..Reply::text(token)
        };
    }
    if request.method != "GET" {
        return Reply::status(405, "Method Not Allowed");
    }
    if !request.token.is_some_and(|t| tokens.is_valid(t, now)) {
        return Reply::status(401, "Unauthorized");
    }
    let Some(instance) = state.instance_by_address(request.source) else {
        return Reply::status(
            404,
            &format!("no instance owns {} in the lab's EC2", request.source),
        );
    };
    match lookup(state, instance, path, now_ms) {
        Some(reply) => reply,
        None => Reply::status(404, "Not Found"),
    }
}

fn listing(entries: &[&str]) -> Reply {
    Reply::text(entries.join("\n"))
}

fn lookup(state: &Ec2State, instance: &Instance, path: &str, now_ms: u64) -> Option<Reply> {
    if let Some(rest) = path.strip_prefix("/latest/dynamic") {
        return dynamic(state, instance, rest.trim_start_matches('/'));
    }
    let rest = path.strip_prefix("/latest/meta-data")?;
    let rest = rest.trim_start_matches('/');
    let primary = state.eni(&instance.primary_eni).ok()?;
    let reply = match rest {
        "" => listing(&[
            "ami-id",
            "hostname",
            "iam/",
            "instance-id",
            "instance-type",
            "local-hostname",
            "local-ipv4",
            "mac",
            "network/",
            "placement/",
            "security-groups",
        ]),
        "ami-id" => Reply::text(&instance.image_id),
        "instance-id" => Reply::text(&instance.id),
        "instance-type" => Reply::text(&instance.instance_type),
        "local-ipv4" => Reply::text(instance.primary_ip.to_string()),
        "hostname" | "local-hostname" => Reply::text(hostname(state, instance.primary_ip)),
        "mac" => Reply::text(&primary.mac),
        "security-groups" => Reply::text(group_names(state, &primary.groups)),
        "placement" | "placement/" => listing(&["availability-zone", "region"]),
        "placement/availability-zone" => Reply::text(&instance.availability_zone),
        "placement/region" => Reply::text(&state.region),
        "network" | "network/" => listing(&["interfaces/"]),
        "network/interfaces" | "network/interfaces/" => listing(&["macs/"]),
        "network/interfaces/macs" | "network/interfaces/macs/" => {
            let macs: Vec<String> = state
                .attached_enis(&instance.id)
                .iter()
                .map(|eni| format!("{}/", eni.mac))
                .collect();
            Reply::text(macs.join("\n"))
        }
        "iam" | "iam/" => listing(&["info", "security-credentials/"]),
        "iam/info" => Reply::json(format!(
            "{{\n  \"Code\" : \"Success\",\n  \"LastUpdated\" : \"{}\",\n  \"InstanceProfileArn\" : \"arn:aws:iam::{}:instance-profile/{}\",\n  \"InstanceProfileId\" : \"AIPAVPCNETLAB0000001\"\n}}",
            timestamp_secs(now_ms),
            state.account_id,
            state.iam_role
        )),
        "iam/security-credentials" | "iam/security-credentials/" => Reply::text(&state.iam_role),
        other => {
            if let Some(role) = other.strip_prefix("iam/security-credentials/") {
                if role != state.iam_role {
                    return None;
                }
                return Some(credentials(state, instance, now_ms));
            }
            let mac_path = other.strip_prefix("network/interfaces/macs/")?;
            let (mac, key) = mac_path.split_once('/').unwrap_or((mac_path, ""));
            let enis = state.attached_enis(&instance.id);
            let eni = enis.iter().find(|eni| eni.mac == mac)?;
            return per_mac(state, eni, key);
        }
    };
    Some(reply)
}

fn hostname(state: &Ec2State, addr: Ipv4Addr) -> String {
    let [a, b, c, d] = addr.octets();
    format!("ip-{a}-{b}-{c}-{d}.{}.compute.internal", state.region)
}

fn group_names(state: &Ec2State, groups: &[String]) -> String {
    groups
        .iter()
        .map(|g| state.security_group_name(g).unwrap_or(g.as_str()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `network/interfaces/macs/<mac>/<key>`.
fn per_mac(state: &Ec2State, eni: &Eni, key: &str) -> Option<Reply> {
    let attachment = eni.attachment.as_ref()?;
    let subnet = state.subnet(&eni.subnet_id).ok()?;
    let reply = match key.trim_end_matches('/') {
        "" => {
            let mut keys = vec![
                "device-number",
                "interface-id",
                "local-hostname",
                "local-ipv4s",
                "mac",
                "network-card-index",
                "owner-id",
                "security-group-ids",
                "security-groups",
                "subnet-id",
                "subnet-ipv4-cidr-block",
                "vpc-id",
                "vpc-ipv4-cidr-block",
                "vpc-ipv4-cidr-blocks",
            ];
            if !eni.prefixes.is_empty() {
                keys.push("ipv4-prefix");
                keys.sort_unstable();
            }
            listing(&keys)
        }
        "device-number" => Reply::text(attachment.device_index.to_string()),
        "network-card-index" => Reply::text(attachment.network_card_index.to_string()),
        "interface-id" => Reply::text(&eni.id),
        "mac" => Reply::text(&eni.mac),
        "local-hostname" => Reply::text(hostname(state, eni.primary_ip)),
        "local-ipv4s" => Reply::text(
            eni.addresses()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        "ipv4-prefix" if !eni.prefixes.is_empty() => Reply::text(
            eni.prefixes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        "owner-id" => Reply::text(&eni.owner_id),
        "security-group-ids" => Reply::text(eni.groups.join("\n")),
        "security-groups" => Reply::text(group_names(state, &eni.groups)),
        "subnet-id" => Reply::text(&eni.subnet_id),
        "subnet-ipv4-cidr-block" => Reply::text(subnet.cidr.to_string()),
        "vpc-id" => Reply::text(&eni.vpc_id),
        "vpc-ipv4-cidr-block" => Reply::text(state.vpc.cidrs[0].to_string()),
        "vpc-ipv4-cidr-blocks" => Reply::text(
            state
                .vpc
                .cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => return None,
    };
    Some(reply)
}

/// `/latest/dynamic/...`.
fn dynamic(state: &Ec2State, instance: &Instance, rest: &str) -> Option<Reply> {
    match rest.trim_end_matches('/') {
        "" => Some(listing(&["instance-identity/"])),
        "instance-identity" => Some(listing(&["document"])),
        "instance-identity/document" => Some(Reply::json(
            serde_json::to_string_pretty(&serde_json::json!({
                "accountId": state.account_id,
                "architecture": "x86_64",
                "availabilityZone": instance.availability_zone,
                "imageId": instance.image_id,
                "instanceId": instance.id,
                "instanceType": instance.instance_type,
                "pendingTime": timestamp_secs(instance.launch_time_ms),
                "privateIp": instance.primary_ip.to_string(),
                "region": state.region,
                "version": "2017-09-30",
            }))
            .expect("serializable"),
        )),
        _ => None,
    }
}

/// The role's temporary credentials: fake, valid for six hours, enough for
/// the SDK's default chain to sign requests to the emulator (which does not
/// check signatures).
fn credentials(state: &Ec2State, instance: &Instance, now_ms: u64) -> Reply {
    let mut key = String::from("ASIAVPCNETLAB");
    let digits: String = instance
        .id
        .chars()
        .rev()
        .take(7)
        .collect::<String>()
        .to_uppercase();
    let _ = write!(key, "{digits}");
    Reply::json(format!(
        "{{\n  \"Code\" : \"Success\",\n  \"LastUpdated\" : \"{}\",\n  \"Type\" : \"AWS-HMAC\",\n  \"AccessKeyId\" : \"{key}\",\n  \"SecretAccessKey\" : \"vpcnet-lab-secret-{}\",\n  \"Token\" : \"vpcnet-lab-session-token-{}\",\n  \"Expiration\" : \"{}\"\n}}",
        timestamp_secs(now_ms),
        state.iam_role,
        instance.id,
        timestamp_secs(now_ms + 6 * 3600 * 1000)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ec2::config::{Config, LAB_NODE_SUBNET_ID};

    const NODE: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 162);

    fn get<'a>(path: &'a str, token: &'a str) -> Request<'a> {
        Request {
            method: "GET",
            path,
            token: Some(token),
            ttl: None,
            source: NODE,
        }
    }

    #[test]
    fn token_flow_and_per_mac_keys() {
        let mut state = Ec2State::new(&Config::lab());
        let id = state
            .run_instance(
                "m5.large",
                "ami-1",
                LAB_NODE_SUBNET_ID,
                Some(NODE),
                vec![],
                0,
            )
            .unwrap();
        let mut tokens = Tokens::new(1);
        let now = Instant::now();
        let put = |ttl: &'static str| Request {
            method: "PUT",
            path: "/latest/api/token",
            token: None,
            ttl: Some(ttl),
            source: NODE,
        };
        for bad in ["0", "21601", "x"] {
            assert_eq!(handle(&state, &mut tokens, &put(bad), now, 0).status, 400);
        }
        let reply = handle(&state, &mut tokens, &put("60"), now, 0);
        assert_eq!((reply.status, reply.ttl), (200, Some(60)));
        let token = reply.body;
        let no_token = Request {
            token: None,
            ..get("/latest/meta-data/instance-id", "")
        };
        assert_eq!(handle(&state, &mut tokens, &no_token, now, 0).status, 401);
        let later = now + Duration::from_secs(61);
        let expired = handle(
            &state,
            &mut tokens,
            &get("/latest/meta-data/instance-id", &token),
            later,
            0,
        );
        assert_eq!(expired.status, 401);
        let mut ok = |path: &str| {
            let reply = handle(&state, &mut tokens, &get(path, &token), now, 0);
            assert_eq!(reply.status, 200, "{path}: {}", reply.body);
            reply.body
        };
        assert_eq!(ok("/latest/meta-data/instance-id"), id);
        assert_eq!(ok("/latest/meta-data/mac"), crate::addrs::NODE_ETH0_MAC);
        assert_eq!(
            ok("/latest/meta-data/network/interfaces/macs/"),
            format!("{}/", crate::addrs::NODE_ETH0_MAC)
        );
        let base = format!(
            "/latest/meta-data/network/interfaces/macs/{}/",
            crate::addrs::NODE_ETH0_MAC
        );
        assert_eq!(ok(&format!("{base}device-number")), "0");
        assert_eq!(ok(&format!("{base}local-ipv4s")), "10.20.11.162");
        assert_eq!(
            ok(&format!("{base}vpc-ipv4-cidr-blocks")),
            "10.20.0.0/16\n100.64.0.0/16"
        );
        assert!(
            ok("/latest/dynamic/instance-identity/document")
                .contains("\"privateIp\": \"10.20.11.162\"")
        );
        let none = handle(
            &state,
            &mut tokens,
            &get(&format!("{base}ipv4-prefix"), &token),
            now,
            0,
        );
        assert_eq!(none.status, 404);
    }

    #[test]
    fn imds_times_drop_milliseconds() {
        assert_eq!(timestamp_secs(1_709_251_199_123), "2024-02-29T23:59:59Z");
    }
}
