//! The emulator's admin API: HTTP/1.1 with JSON bodies on a Unix socket,
//! for the lab and its tests to look at and steer EC2 from outside the
//! agent's view: the whole state, call and fault counters, faults and the
//! attachment delay at run time, subnets filled by "other instances", and
//! ENIs leaked by an agent that crashed.
//!
//! [`AdminClient`] is its blocking client (the lab's library is not async).

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use super::{EmulatorError, config::FaultRule, faults::ActionCounters, model::StateSnapshot};

/// `GET`: `{"ok": true}` once the emulator serves.
pub const HEALTH: &str = "/healthz";
/// `GET`: [`StateSnapshot`].
pub const STATE: &str = "/state";
/// `GET`: [`CallsView`].
pub const CALLS: &str = "/calls";
/// `PUT` a list of [`FaultRule`]s: replaces the rules.
pub const FAULTS: &str = "/faults";
/// `PUT` [`AttachDelayRequest`].
pub const ATTACH_DELAY: &str = "/attach-delay";
/// `POST` [`OccupyRequest`].
pub const OCCUPY: &str = "/occupy";
pub const ASSIGN: &str = "/assign";
/// `POST` [`LeakedEniRequest`]: [`LeakedEniResponse`].
pub const LEAKED_ENI: &str = "/leaked-eni";
/// `POST` [`RunInstanceRequest`]: [`RunInstanceResponse`].
pub const RUN_INSTANCE: &str = "/run-instance";
/// `POST` [`VpcCidrRequest`]: the state. A CIDR associated with the VPC
/// (what `AssociateVpcCidrBlock` does), seen in IMDS at once.
pub const VPC_CIDR: &str = "/vpc-cidr";
/// A branch ENI on the lab node's trunk, as the resource controller makes
/// one (the trunk attached first if the node has none).
pub const BRANCH_ENI: &str = "/branch-eni";
/// Starts the lab's VPC resource controller
/// ([`super::resource_controller`]).
pub const RESOURCE_CONTROLLER: &str = "/resource-controller";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BranchEniRequest {
    /// The branch ENI's address; EC2 picks one if absent.
    #[serde(default)]
    pub private_ip: Option<Ipv4Addr>,
}

/// A CIDR to associate with the VPC.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VpcCidrRequest {
    pub cidr: Ipv4Net,
}

/// Calls and injected faults per action, and the run-time settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallsView {
    pub actions: BTreeMap<String, ActionCounters>,
    pub faults: Vec<FaultRule>,
    /// Times the lab's network could not follow the state (see the log).
    pub fabric_errors: u64,
    pub attach_delay_ms: u64,
}

impl CallsView {
    /// The counters of `action` (zero if it was never called).
    pub fn action(&self, action: &str) -> ActionCounters {
        self.actions.get(action).copied().unwrap_or_default()
    }
}

/// The attachment delay, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct AttachDelayRequest {
    pub ms: u64,
}

/// Addresses and prefixes of a subnet used by instances the emulator does
/// not model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OccupyRequest {
    pub subnet_id: String,
    #[serde(default)]
    pub addresses: Vec<Ipv4Addr>,
    #[serde(default)]
    pub prefixes: Vec<Ipv4Net>,
}

/// Specific secondary addresses for an ENI, as `AssignPrivateIpAddresses`
/// with `PrivateIpAddress.N` would give them (what another CNI assigned
/// before the agent came).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AssignRequest {
    pub network_interface_id: String,
    pub addresses: Vec<Ipv4Addr>,
}

/// An available ENI, tagged as the agent tags its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeakedEniRequest {
    pub subnet_id: String,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    #[serde(default)]
    pub secondary_count: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeakedEniResponse {
    pub network_interface_id: String,
}

/// `RunInstances` for one instance.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunInstanceRequest {
    pub instance_type: String,
    pub subnet_id: String,
    #[serde(default)]
    pub private_ip: Option<Ipv4Addr>,
    #[serde(default)]
    pub image_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunInstanceResponse {
    pub instance_id: String,
}

/// An admin error: EC2's code when the state refused.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdminErrorBody {
    pub code: String,
    pub message: String,
}

/// How long one admin call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A blocking client of the admin socket.
#[derive(Debug, Clone)]
pub struct AdminClient {
    socket: PathBuf,
}

impl AdminClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Whether the emulator answers.
    pub fn health(&self) -> Result<(), EmulatorError> {
        self.call::<serde_json::Value>("GET", HEALTH, None)
            .map(drop)
    }

    /// The whole state.
    pub fn state(&self) -> Result<StateSnapshot, EmulatorError> {
        self.call("GET", STATE, None)
    }

    /// Calls and faults per action.
    pub fn calls(&self) -> Result<CallsView, EmulatorError> {
        self.call("GET", CALLS, None)
    }

    /// Replaces the fault rules (an empty list stops all faults).
    pub fn set_faults(&self, rules: &[FaultRule]) -> Result<CallsView, EmulatorError> {
        self.call("PUT", FAULTS, Some(serde_json::to_vec(rules)?))
    }

    /// Sets the attachment (and detachment) delay.
    pub fn set_attach_delay(&self, delay: Duration) -> Result<CallsView, EmulatorError> {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.call(
            "PUT",
            ATTACH_DELAY,
            Some(serde_json::to_vec(&AttachDelayRequest { ms })?),
        )
    }

    /// Marks addresses and prefixes of a subnet as used by other instances.
    pub fn occupy(
        &self,
        subnet_id: &str,
        addresses: &[Ipv4Addr],
        prefixes: &[Ipv4Net],
    ) -> Result<StateSnapshot, EmulatorError> {
        let request = OccupyRequest {
            subnet_id: subnet_id.to_owned(),
            addresses: addresses.to_vec(),
            prefixes: prefixes.to_vec(),
        };
        self.call("POST", OCCUPY, Some(serde_json::to_vec(&request)?))
    }

    /// Assigns `addresses` to the ENI `eni_id` as secondary addresses.
    pub fn assign(
        &self,
        eni_id: &str,
        addresses: &[Ipv4Addr],
    ) -> Result<StateSnapshot, EmulatorError> {
        let request = AssignRequest {
            network_interface_id: eni_id.to_owned(),
            addresses: addresses.to_vec(),
        };
        self.call("POST", ASSIGN, Some(serde_json::to_vec(&request)?))
    }

    /// Creates an available ENI with `tags` (a leaked one); its id.
    pub fn create_leaked_eni(
        &self,
        subnet_id: &str,
        tags: &BTreeMap<String, String>,
        secondary_count: u32,
    ) -> Result<String, EmulatorError> {
        let request = LeakedEniRequest {
            subnet_id: subnet_id.to_owned(),
            tags: tags.clone(),
            secondary_count,
        };
        let reply: LeakedEniResponse =
            self.call("POST", LEAKED_ENI, Some(serde_json::to_vec(&request)?))?;
        Ok(reply.network_interface_id)
    }

    /// Associates another CIDR with the VPC.
    pub fn associate_vpc_cidr(&self, cidr: Ipv4Net) -> Result<StateSnapshot, EmulatorError> {
        let request = VpcCidrRequest { cidr };
        self.call("POST", VPC_CIDR, Some(serde_json::to_vec(&request)?))
    }

    /// A branch ENI on the lab node's trunk: what the pod's
    /// `vpc.amazonaws.com/pod-eni` annotation says of it.
    pub fn branch_eni(
        &self,
        private_ip: Option<Ipv4Addr>,
    ) -> Result<vpcnet_api::pod::BranchEni, EmulatorError> {
        let request = BranchEniRequest { private_ip };
        self.call("POST", BRANCH_ENI, Some(serde_json::to_vec(&request)?))
    }

    /// Starts the lab's VPC resource controller.
    pub fn start_resource_controller(
        &self,
        opts: &super::resource_controller::ControllerOptions,
    ) -> Result<(), EmulatorError> {
        let _: serde_json::Value =
            self.call("POST", RESOURCE_CONTROLLER, Some(serde_json::to_vec(opts)?))?;
        Ok(())
    }

    /// Launches an instance; its id.
    pub fn run_instance(&self, request: &RunInstanceRequest) -> Result<String, EmulatorError> {
        let reply: RunInstanceResponse =
            self.call("POST", RUN_INSTANCE, Some(serde_json::to_vec(request)?))?;
        Ok(reply.instance_id)
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, EmulatorError> {
        let what = format!("{method} {path} on {}", self.socket.display());
        let body = body.unwrap_or_default();
        let (status, body) = crate::unix_http::exchange(
            &self.socket,
            method,
            path,
            "application/json",
            &body,
            CALL_TIMEOUT,
        )
        .map_err(|source| EmulatorError::Io {
            context: format!("admin call {what}"),
            source,
        })?;
        let body = body.as_slice();
        if status != 200 {
            let (code, message) = serde_json::from_slice::<AdminErrorBody>(body).map_or_else(
                |_| (String::new(), String::from_utf8_lossy(body).into_owned()),
                |e| (e.code, e.message),
            );
            return Err(EmulatorError::Admin {
                request: what,
                status,
                code,
                message,
            });
        }
        serde_json::from_slice(body).map_err(|err| EmulatorError::BadResponse {
            request: what,
            reason: err.to_string(),
        })
    }
}
