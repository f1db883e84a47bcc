//! Start-up and adoption: finding out the node from IMDS and EC2, taking
//! in its attached ENIs as their tags say (tagging those it manages),
//! replaying the checkpoint, and waiting for attachments to settle.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use ipnet::Ipv4Net;
use tokio::sync::{Mutex, Notify};
use tracing::{debug, info, warn};

use super::{
    AttachedEni, Inner, IpamCounters, Manager, ManagerError, ManagerOptions, Node, NodeNetwork,
    State, TrackedEni, events::Events, gateway_of, placement,
};
use crate::{
    cloud::{Cloud, CloudError, EniInfo, TAG_INSTANCE_ID, TAG_NO_MANAGE, managed_eni_tags},
    ipam::{
        checkpoint::Checkpoint,
        datastore::Datastore,
        pool::default_max_pods,
        subnets::{self, SubnetChoice},
    },
    retry,
};

/// How long an attach or detach may take before it counts as failed.
const ATTACH_TIMEOUT: Duration = Duration::from_mins(1);
/// The first and the longest pause between two looks at an attachment.
const ATTACH_POLL_FIRST: Duration = Duration::from_millis(100);
const ATTACH_POLL_CAP: Duration = Duration::from_secs(2);

/// Whose an attached ENI is, as aws-node's `setUnmanagedENIs` decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EniRole {
    /// The instance's primary ENI: always the pool's.
    Primary,
    /// Made for this instance by vpcnet or the VPC CNI (its instance tag),
    /// or tagged `no_manage` with another value than `true`.
    Own,
    /// Someone else's, taken in: `MANAGE_UNTAGGED_ENI` is true.
    Untagged,
    /// Tagged `no_manage=true`: left alone.
    NoManage,
    /// Someone else's, left alone: `MANAGE_UNTAGGED_ENI` is false.
    Foreign,
    /// A trunk (the VPC resource controller's) or EFA-only interface: left
    /// alone.
    NotForAddresses,
}

impl EniRole {
    fn of(eni: &EniInfo, primary: bool, instance_id: &str, manage_untagged: bool) -> Self {
        if primary {
            return Self::Primary;
        }
        if !eni.holds_addresses() {
            return Self::NotForAddresses;
        }
        match eni.tags.get(TAG_NO_MANAGE) {
            Some(_) if eni.no_manage() => Self::NoManage,
            Some(_) => Self::Own,
            None if eni.tags.get(TAG_INSTANCE_ID).map(String::as_str) == Some(instance_id) => {
                Self::Own
            }
            None if manage_untagged => Self::Untagged,
            None => Self::Foreign,
        }
    }

    /// Whether its addresses are the pool's and its link the agent's.
    fn managed(self) -> bool {
        matches!(self, Self::Primary | Self::Own | Self::Untagged)
    }

    /// What the log says of it, when it is not plainly the agent's own.
    fn said(self) -> Option<&'static str> {
        match self {
            Self::Primary => {
                Some("the primary ENI: vpcnet attaches its programs, changes nothing else")
            }
            Self::Own => None,
            Self::Untagged => Some(
                "not made for this instance by vpcnet or the VPC CNI: managed (MANAGE_UNTAGGED_ENI is true)",
            ),
            Self::NoManage => Some("tagged no_manage: left alone"),
            Self::Foreign => Some(
                "not made by vpcnet or the VPC CNI for this instance: left alone (MANAGE_UNTAGGED_ENI is false)",
            ),
            Self::NotForAddresses => Some("a trunk or EFA-only interface: left alone"),
        }
    }
}

impl Manager {
    /// Finds out the node, rebuilds its ENIs, replays the checkpoint and
    /// writes it back: from then on no address a running pod holds is
    /// handed out again.
    pub async fn start(
        cloud: Cloud,
        opts: ManagerOptions,
        network: Arc<dyn NodeNetwork>,
    ) -> Result<Self, ManagerError> {
        let _action = crate::telemetry::action(crate::telemetry::ACTION_NODE_INIT);
        let began = Instant::now();
        let started = Self::start_inner(cloud, opts, network).await;
        crate::telemetry::node_initialized(started.is_ok(), began.elapsed());
        started
    }

    async fn start_inner(
        cloud: Cloud,
        opts: ManagerOptions,
        network: Arc<dyn NodeNetwork>,
    ) -> Result<Self, ManagerError> {
        let settings = &opts.settings;
        let instance = cloud.instance_metadata().await?;
        let limits = cloud.instance_type_limits(&instance.instance_type).await?;
        let imds_enis = cloud.imds_enis().await?;
        let primary_eni = imds_enis
            .iter()
            .find(|e| e.mac == instance.primary_mac)
            .cloned()
            .ok_or_else(|| ManagerError::NoPrimaryEni(instance.primary_mac.clone()))?;
        let max_enis = settings
            .max_eni
            .map_or(limits.max_enis, |m| m.min(limits.max_enis));
        let max_pods = settings
            .max_pods
            .unwrap_or_else(|| default_max_pods(limits, max_enis, settings.prefix_delegation));
        let vpc_id = cloud.subnet(&primary_eni.subnet_id).await?.vpc_id;
        if opts.eni_configs.is_none()
            && let Some(custom) = settings.eni_config_override()
        {
            // Fails early on a custom-networking subnet that does not exist.
            cloud.subnet(&custom.subnet_id).await?;
        }
        let eni_tags = managed_eni_tags(
            &instance.instance_id,
            settings.cluster_name.as_deref(),
            &settings.additional_eni_tags,
        );
        let node = Node {
            instance,
            limits,
            max_enis,
            max_pods,
            primary_eni,
            vpc_id,
            eni_tags,
        };
        let placement = placement(&opts);
        info!(
            instance = %node.instance.instance_id,
            instance_type = %node.instance.instance_type,
            max_enis, max_pods,
            ips_per_eni = limits.ips_per_eni,
            eni_subnets = SubnetChoice {
                cloud: &cloud,
                vpc_id: &node.vpc_id,
                zone: &node.instance.availability_zone,
                primary_subnet_id: &node.primary_eni.subnet_id,
                cluster: settings.cluster_name.as_deref(),
                discovery: settings.subnet_discovery,
            }
            .describe(&placement),
            prefix_delegation = settings.prefix_delegation,
            "address manager starting"
        );
        let manager = Self {
            inner: Arc::new(Inner {
                cloud,
                node,
                network,
                state: Mutex::new(State {
                    datastore: Datastore::new(opts.settings.ip_cooldown),
                    enis: BTreeMap::new(),
                    draining: BTreeMap::new(),
                    prefix_fallback: false,
                    recent: BTreeMap::new(),
                    vpc_cidrs: Vec::new(),
                }),
                opts,
                wake: Notify::new(),
                pool_changed: Notify::new(),
                counters: IpamCounters::default(),
                events: Events::new(),
            }),
        };
        manager.rebuild().await?;
        Ok(manager)
    }

    /// The ENIs attached to this instance, from EC2 (tags, prefixes) once
    /// every attachment has settled; this instance's own detached ENIs (a
    /// crash between create and attach, or detach and delete) are deleted.
    async fn rebuild(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let instance_id = &me.node.instance.instance_id;
        let mut enis = Vec::new();
        for eni in me.cloud.instance_enis(instance_id).await? {
            match eni.attachment_status.as_deref() {
                Some("attached") => enis.push(eni),
                // An earlier run was detaching it when it stopped: it will
                // never be attached again. Once detached, the sweep below
                // finds it among this node's detached ENIs and deletes it.
                Some("detaching") => {
                    info!(eni = %eni.id, "waiting for the detach an earlier run started");
                    self.wait_attachment(&eni.id, "detached").await?;
                }
                _ => enis.push(self.wait_attachment(&eni.id, "attached").await?),
            }
        }
        let provisioning = me.opts.settings.provisioning;
        for eni in me.cloud.detached_agent_enis(None).await? {
            if provisioning
                && eni.tags.get(TAG_INSTANCE_ID) == Some(instance_id)
                && !eni.no_manage()
            {
                info!(eni = %eni.id, "deleting this node's detached ENI left by an earlier run");
                me.state.lock().await.draining.insert(eni.id.clone(), None);
            }
        }
        let excluded = self.subnets().excluded().await?;
        for eni in &enis {
            self.track(eni, excluded.contains(&eni.subnet_id)).await?;
        }
        let mut st = me.state.lock().await;
        let path = &me.opts.settings.backing_store;
        if let Some(checkpoint) = Checkpoint::read(path)? {
            let orphans = st.datastore.restore(&checkpoint);
            for orphan in &orphans {
                warn!(
                    container = %orphan.key.container_id,
                    addr = ?orphan.ipv4,
                    "checkpointed address is on no ENI of this node any more"
                );
            }
            info!(
                restored = checkpoint.allocations.len() - orphans.len(),
                orphans = orphans.len(),
                "checkpoint replayed"
            );
        }
        st.datastore.checkpoint().write(path)?;
        Ok(())
    }

    /// Gives a managed ENI, the primary one included, the tags it lacks
    /// (aws-node's, the operator's), as aws-node does when it takes one.
    async fn tag_managed(&self, eni: &EniInfo) -> Result<(), ManagerError> {
        let me = &self.inner;
        if !me.opts.settings.provisioning {
            return Ok(());
        }
        let missing: Vec<(&str, &str)> = me
            .node
            .eni_tags
            .iter()
            .filter(|(key, value)| eni.tags.get(*key) != Some(*value))
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        me.cloud.tag(&eni.id, &missing).await?;
        info!(eni = %eni.id, tags = ?missing, "ENI tagged");
        Ok(())
    }

    /// Takes an attached ENI into the pool (and the node's links);
    /// `subnet_excluded`: its subnet serves no pod.
    pub(super) async fn track(
        &self,
        eni: &EniInfo,
        subnet_excluded: bool,
    ) -> Result<(), ManagerError> {
        let me = &self.inner;
        let device_number = eni.device_index.unwrap_or_default();
        let primary = eni.mac == me.node.instance.primary_mac;
        let subnet = if primary {
            me.node.primary_eni.subnet_cidr
        } else {
            me.cloud.imds_eni(&eni.mac).await?.subnet_cidr
        };
        let role = EniRole::of(
            eni,
            primary,
            &me.node.instance.instance_id,
            me.opts.settings.manage_untagged_eni,
        );
        let left_alone = !role.managed();
        if let Some(said) = role.said() {
            let (interface, manager) = me
                .network
                .interface_owner(&eni.mac)
                .await
                .unwrap_or_else(|| ("(no link)".to_owned(), "unknown".to_owned()));
            info!(eni = %eni.id, %interface, %manager, role = said, "ENI link owner");
        }
        if subnet_excluded && !left_alone {
            info!(
                eni = %eni.id,
                subnet = %eni.subnet_id,
                "ENI in a subnet tagged {}=0 (or for other clusters only): no pod gets its addresses, its idle ones go back to EC2",
                subnets::TAG_ROLE_CNI
            );
        }
        if !left_alone {
            self.tag_managed(eni).await?;
        }
        if !primary && !left_alone {
            let addr = eni.primary_addr.ok_or(CloudError::Incomplete {
                action: "DescribeNetworkInterfaces",
                field: "PrivateIpAddress",
            })?;
            let attached = AttachedEni {
                id: eni.id.clone(),
                mac: eni.mac.clone(),
                device_number,
                addr: Ipv4Net::new(addr, subnet.prefix_len()).unwrap_or(subnet),
                gateway: gateway_of(subnet),
            };
            me.network
                .eni_attached(&attached)
                .await
                .map_err(|e| ManagerError::Network {
                    eni: eni.id.clone(),
                    reason: e.to_string(),
                })?;
        }
        let mut st = me.state.lock().await;
        st.enis.insert(
            eni.id.clone(),
            TrackedEni {
                device_number,
                mac: eni.mac.clone(),
                attachment_id: eni.attachment_id.clone(),
                subnet_id: eni.subnet_id.clone(),
                subnet,
                subnet_excluded,
                primary_addr: eni.primary_addr,
                no_manage: left_alone,
                trunk: eni.is_trunk(),
                attached_at: Instant::now(),
            },
        );
        if left_alone {
            return Ok(());
        }
        let excluded = (primary && me.opts.settings.custom_network) || subnet_excluded;
        st.datastore
            .add_eni(&eni.id, device_number, primary, excluded);
        st.datastore.add_addrs(&eni.id, &eni.secondary_addrs)?;
        for prefix in &eni.prefixes {
            st.datastore.add_prefix(&eni.id, *prefix)?;
        }
        drop(st);
        me.pool_changed.notify_waiters();
        Ok(())
    }

    /// Polls EC2 until the ENI's attachment reaches `state` (EC2 has no
    /// notification for it; aws-node polls too).
    pub(super) async fn wait_attachment(
        &self,
        eni_id: &str,
        state: &'static str,
    ) -> Result<EniInfo, ManagerError> {
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        let mut delays = retry::delays(ATTACH_POLL_FIRST, ATTACH_POLL_CAP);
        loop {
            match self.inner.cloud.eni(eni_id).await {
                Ok(eni) if eni.attachment_status.as_deref() == Some(state) => return Ok(eni),
                Ok(eni) if state == "detached" && eni.status == "available" => return Ok(eni),
                Ok(_) => {}
                Err(e) if e.is_retryable() => {
                    debug!(eni = eni_id, error = %e, "polling attachment");
                }
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(ManagerError::Timeout {
                    eni: eni_id.to_owned(),
                    state,
                    timeout: ATTACH_TIMEOUT,
                });
            }
            tokio::time::sleep(delays.next().unwrap_or(ATTACH_POLL_CAP)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    //! Whose an attached ENI is, as aws-node's `setUnmanagedENIs` decides.

    use std::collections::BTreeMap;

    use super::*;

    const INSTANCE: &str = "i-0node";

    fn eni(tags: &[(&str, &str)], interface_type: Option<&str>) -> EniInfo {
        EniInfo {
            id: "eni-1".to_owned(),
            mac: "0a:00:00:00:00:01".to_owned(),
            subnet_id: "subnet-1".to_owned(),
            status: "in-use".to_owned(),
            attachment_id: None,
            attachment_status: Some("attached".to_owned()),
            device_index: Some(1),
            primary_addr: None,
            secondary_addrs: Vec::new(),
            prefixes: Vec::new(),
            tags: tags
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            interface_type: interface_type.map(str::to_owned),
        }
    }

    #[test]
    fn which_attached_enis_the_pool_takes_in() {
        let ours = [(TAG_INSTANCE_ID, INSTANCE)];
        let cases = [
            ("the primary", eni(&[], None), true, false, EniRole::Primary),
            (
                "made for this instance",
                eni(&ours, None),
                false,
                false,
                EniRole::Own,
            ),
            (
                "no_manage=false",
                eni(&[(TAG_NO_MANAGE, "false")], None),
                false,
                false,
                EniRole::Own,
            ),
            (
                "no_manage=true",
                eni(
                    &[(TAG_NO_MANAGE, "true"), (TAG_INSTANCE_ID, INSTANCE)],
                    None,
                ),
                false,
                true,
                EniRole::NoManage,
            ),
            (
                "another instance's",
                eni(&[(TAG_INSTANCE_ID, "i-0other")], None),
                false,
                false,
                EniRole::Foreign,
            ),
            (
                "untagged, MANAGE_UNTAGGED_ENI true",
                eni(&[], None),
                false,
                true,
                EniRole::Untagged,
            ),
            (
                "untagged, MANAGE_UNTAGGED_ENI false",
                eni(&[], None),
                false,
                false,
                EniRole::Foreign,
            ),
            (
                "a trunk",
                eni(&ours, Some("trunk")),
                false,
                true,
                EniRole::NotForAddresses,
            ),
            (
                "EFA-only",
                eni(&ours, Some("efa-only")),
                false,
                true,
                EniRole::NotForAddresses,
            ),
        ];
        for (case, eni, primary, manage_untagged, want) in cases {
            assert_eq!(
                EniRole::of(&eni, primary, INSTANCE, manage_untagged),
                want,
                "{case}"
            );
        }
        let managed: Vec<EniRole> = [
            EniRole::Primary,
            EniRole::Own,
            EniRole::Untagged,
            EniRole::NoManage,
            EniRole::Foreign,
            EniRole::NotForAddresses,
        ]
        .into_iter()
        .filter(|r| r.managed())
        .collect();
        assert_eq!(managed, [EniRole::Primary, EniRole::Own, EniRole::Untagged]);
    }
}
