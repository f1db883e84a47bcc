//! What the instance metadata service says about this instance and its
//! ENIs. aws-node reads the same keys; IMDS is the authority for which ENIs
//! are attached (and in which order) and for the VPC's CIDRs.

use std::{net::Ipv4Addr, str::FromStr};

use aws_config::imds::client::error::ImdsError;
use ipnet::Ipv4Net;

use super::{Cloud, CloudError};
use crate::telemetry::{self, Outcome};

const META_DATA: &str = "/latest/meta-data/";

/// This instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceMetadata {
    pub instance_id: String,
    pub instance_type: String,
    pub region: String,
    pub availability_zone: String,
    /// The primary ENI's MAC.
    pub primary_mac: String,
    /// The node's primary address.
    pub local_ipv4: Ipv4Addr,
}

/// One attached ENI, as IMDS lists it under `network/interfaces/macs/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImdsEni {
    pub mac: String,
    pub device_number: u32,
    pub interface_id: String,
    pub subnet_id: String,
    pub subnet_cidr: Ipv4Net,
    /// The primary address first.
    pub local_ipv4s: Vec<Ipv4Addr>,
    pub prefixes: Vec<Ipv4Net>,
    pub security_groups: Vec<String>,
    pub vpc_cidrs: Vec<Ipv4Net>,
}

pub(super) async fn get(imds: &aws_config::imds::Client, key: &str) -> Result<String, CloudError> {
    let path = format!("{META_DATA}{key}");
    get_optional(imds, key)
        .await?
        .ok_or_else(|| CloudError::Imds {
            path,
            detail: "not found (404)".to_owned(),
        })
}

/// `None` when IMDS answers 404: how it says a key has no value (an ENI
/// without prefixes has no `ipv4-prefix`).
async fn get_optional(
    imds: &aws_config::imds::Client,
    key: &str,
) -> Result<Option<String>, CloudError> {
    let path = format!("{META_DATA}{key}");
    let began = std::time::Instant::now();
    let answer = imds.get(&path).await;
    telemetry::imds_call(
        began.elapsed(),
        match &answer {
            Ok(_) => Outcome::Ok,
            Err(ImdsError::ErrorResponse(e)) => Outcome::OtherError {
                status: Some(e.response().status().as_u16()),
            },
            Err(_) => Outcome::OtherError { status: None },
        },
    );
    match answer {
        Ok(value) => Ok(Some(value.as_ref().trim().to_owned())),
        Err(ImdsError::ErrorResponse(e)) if e.response().status().as_u16() == 404 => Ok(None),
        Err(e) => Err(CloudError::Imds {
            detail: aws_sdk_ec2::error::DisplayErrorContext(&e).to_string(),
            path,
        }),
    }
}

fn parse<T: FromStr>(key: &str, value: &str, expected: &'static str) -> Result<T, CloudError> {
    value.trim().parse().map_err(|_| CloudError::ImdsValue {
        path: format!("{META_DATA}{key}"),
        value: value.to_owned(),
        expected,
    })
}

/// The lines of a listing or multi-valued key.
fn lines(value: &str) -> impl Iterator<Item = &str> {
    value.lines().map(str::trim).filter(|l| !l.is_empty())
}

impl Cloud {
    async fn imds(&self, key: &str) -> Result<String, CloudError> {
        get(&self.imds, key).await
    }

    /// This instance's identity and primary ENI.
    pub async fn instance_metadata(&self) -> Result<InstanceMetadata, CloudError> {
        let local_ipv4 = self.imds("local-ipv4").await?;
        Ok(InstanceMetadata {
            instance_id: self.imds("instance-id").await?,
            instance_type: self.imds("instance-type").await?,
            region: self.imds("placement/region").await?,
            availability_zone: self.imds("placement/availability-zone").await?,
            primary_mac: self.imds("mac").await?.to_ascii_lowercase(),
            local_ipv4: parse("local-ipv4", &local_ipv4, "an IPv4 address")?,
        })
    }

    /// Every ENI IMDS shows attached, by device number.
    pub async fn imds_enis(&self) -> Result<Vec<ImdsEni>, CloudError> {
        let listing = self.imds("network/interfaces/macs/").await?;
        let mut enis = Vec::new();
        for mac in lines(&listing) {
            enis.push(self.imds_eni(mac.trim_end_matches('/')).await?);
        }
        enis.sort_by_key(|e| e.device_number);
        Ok(enis)
    }

    /// One ENI by MAC.
    pub async fn imds_eni(&self, mac: &str) -> Result<ImdsEni, CloudError> {
        let mac = mac.to_ascii_lowercase();
        let base = format!("network/interfaces/macs/{mac}/");
        let key = |k: &str| format!("{base}{k}");
        let device = self.imds(&key("device-number")).await?;
        let subnet_cidr = self.imds(&key("subnet-ipv4-cidr-block")).await?;
        let local_ipv4s = self.imds(&key("local-ipv4s")).await?;
        let prefixes = get_optional(&self.imds, &key("ipv4-prefix"))
            .await?
            .unwrap_or_default();
        let security_groups = get_optional(&self.imds, &key("security-group-ids"))
            .await?
            .unwrap_or_default();
        let vpc_cidrs = self.imds(&key("vpc-ipv4-cidr-blocks")).await?;
        Ok(ImdsEni {
            device_number: parse(&key("device-number"), &device, "a device number")?,
            interface_id: self.imds(&key("interface-id")).await?,
            subnet_id: self.imds(&key("subnet-id")).await?,
            subnet_cidr: parse(&key("subnet-ipv4-cidr-block"), &subnet_cidr, "a CIDR")?,
            local_ipv4s: lines(&local_ipv4s)
                .map(|a| parse(&key("local-ipv4s"), a, "an IPv4 address"))
                .collect::<Result<_, _>>()?,
            prefixes: lines(&prefixes)
                .map(|p| parse(&key("ipv4-prefix"), p, "a CIDR"))
                .collect::<Result<_, _>>()?,
            security_groups: lines(&security_groups).map(str::to_owned).collect(),
            vpc_cidrs: lines(&vpc_cidrs)
                .map(|c| parse(&key("vpc-ipv4-cidr-blocks"), c, "a CIDR"))
                .collect::<Result<_, _>>()?,
            mac,
        })
    }

    /// The VPC's IPv4 CIDRs as IMDS lists them for the primary ENI: the
    /// datapath's "in the VPC" set, re-read so an associated CIDR reaches it.
    pub async fn vpc_cidrs(&self, primary_mac: &str) -> Result<Vec<Ipv4Net>, CloudError> {
        let key = format!("network/interfaces/macs/{primary_mac}/vpc-ipv4-cidr-blocks");
        let value = self.imds(&key).await?;
        lines(&value).map(|c| parse(&key, c, "a CIDR")).collect()
    }
}
