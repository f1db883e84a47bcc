//! IPv4 policy routing rules: the VPC CNI's (rule 1024 and the per-pod
//! rules 512 and 1536), which the agent removes when it takes a node over
//! from aws-node and writes back when it hands the node back.

use std::net::IpAddr;

use futures_util::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::{
    IpVersion,
    packet_route::rule::{RuleAction, RuleAttribute, RuleMessage},
};

use super::{NetlinkError, NetlinkHandle, errno};

/// An IPv4 rule, with the selectors the VPC CNI uses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ipv4Rule {
    pub priority: u32,
    pub from: Option<Ipv4Net>,
    pub to: Option<Ipv4Net>,
    /// `fwmark <mark>/<mask>`.
    pub fwmark: Option<(u32, u32)>,
    pub iif: Option<String>,
    pub table: u32,
}

/// `addr/len` from a rule's address attribute and its header length.
fn prefix(addr: &IpAddr, len: u8) -> Option<Ipv4Net> {
    match addr {
        IpAddr::V4(addr) => Ipv4Net::new(*addr, len).ok(),
        IpAddr::V6(_) => None,
    }
}

impl Ipv4Rule {
    fn from_message(message: &RuleMessage) -> Self {
        let mut rule = Self {
            priority: 0,
            from: None,
            to: None,
            fwmark: None,
            iif: None,
            table: u32::from(message.header.table),
        };
        let (mut fwmark, mut mask_bits) = (None, None);
        for attribute in &message.attributes {
            match attribute {
                RuleAttribute::Priority(priority) => rule.priority = *priority,
                RuleAttribute::Source(addr) => rule.from = prefix(addr, message.header.src_len),
                RuleAttribute::Destination(addr) => {
                    rule.to = prefix(addr, message.header.dst_len);
                }
                RuleAttribute::FwMark(value) => fwmark = Some(*value),
                RuleAttribute::FwMask(value) => mask_bits = Some(*value),
                RuleAttribute::Iifname(name) => rule.iif = Some(name.clone()),
                RuleAttribute::Table(table) => rule.table = *table,
                _ => {}
            }
        }
        rule.fwmark = fwmark.map(|mark| (mark, mask_bits.unwrap_or(u32::MAX)));
        rule
    }
}

impl NetlinkHandle {
    /// Every IPv4 rule, as the kernel lists them.
    pub async fn ipv4_rules(&self) -> Result<Vec<Ipv4Rule>, NetlinkError> {
        Ok(self
            .rule_messages()
            .await?
            .iter()
            .map(Ipv4Rule::from_message)
            .collect())
    }

    async fn rule_messages(&self) -> Result<Vec<RuleMessage>, NetlinkError> {
        self.handle
            .rule()
            .get(IpVersion::V4)
            .execute()
            .try_collect()
            .await
            .map_err(|source| NetlinkError::ListRules(Box::new(source)))
    }

    /// Deletes every IPv4 rule `doomed` picks; returns how many went. A
    /// rule deleted meanwhile by someone else is not an error.
    pub async fn delete_rules(
        &self,
        doomed: impl Fn(&Ipv4Rule) -> bool,
    ) -> Result<usize, NetlinkError> {
        let mut deleted = 0;
        for message in self.rule_messages().await? {
            let rule = Ipv4Rule::from_message(&message);
            if !doomed(&rule) {
                continue;
            }
            match self.handle.rule().del(message).execute().await {
                Ok(()) => deleted += 1,
                Err(err) if errno(&err) == Some(libc::ENOENT) => {}
                Err(source) => {
                    return Err(NetlinkError::DelRule {
                        rule: format!("{rule:?}"),
                        source: Box::new(source),
                    });
                }
            }
        }
        Ok(deleted)
    }

    /// Adds `rule` unless an equal one is there; returns whether it added.
    pub async fn add_rule(&self, rule: &Ipv4Rule) -> Result<bool, NetlinkError> {
        if self.ipv4_rules().await?.contains(rule) {
            return Ok(false);
        }
        let mut request = self
            .handle
            .rule()
            .add()
            .v4()
            .priority(rule.priority)
            .table_id(rule.table)
            // `ip rule add ... table N` is this action; unset, the kernel
            // would answer every lookup the rule matches with EINVAL.
            .action(RuleAction::ToTable);
        if let Some(from) = rule.from {
            request = request.source_prefix(from.addr(), from.prefix_len());
        }
        if let Some(to) = rule.to {
            request = request.destination_prefix(to.addr(), to.prefix_len());
        }
        if let Some(iif) = &rule.iif {
            request = request.input_interface(iif.clone());
        }
        if let Some((mark, mask)) = rule.fwmark {
            request = request.fw_mark(mark);
            request
                .message_mut()
                .attributes
                .push(RuleAttribute::FwMask(mask));
        }
        request
            .execute()
            .await
            .map_err(|source| NetlinkError::AddRule {
                rule: format!("{rule:?}"),
                source: Box::new(source),
            })?;
        Ok(true)
    }
}
