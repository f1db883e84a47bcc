//! The agent's one way to the cloud: EC2 through `aws-sdk-ec2` and the
//! instance metadata service through the SDK's IMDSv2 client. Endpoints are
//! overridable as the SDK allows (`AWS_ENDPOINT_URL_EC2`,
//! `AWS_EC2_METADATA_SERVICE_ENDPOINT`) and as aws-node allows
//! (`AWS_EC2_ENDPOINT`, `HTTP_TIMEOUT`); credentials come from the SDK's
//! default chain. The
//! lab's EC2 emulator is reached the same way, through these calls.

mod ec2;
mod error;
mod imds;
pub mod metrics;

use std::time::Duration;

use aws_config::{BehaviorVersion, Region, timeout::TimeoutConfig};

pub use self::{
    ec2::{
        ENI_OWNER, EniInfo, InstanceTypeLimits, NewEni, SubnetInfo, TAG_CLUSTER_NAME,
        TAG_CREATED_AT, TAG_ENI_OWNER, TAG_INSTANCE_ID, TAG_NO_MANAGE, eni_description,
        managed_eni_tags, time_now_rfc3339,
    },
    error::CloudError,
    imds::{ImdsEni, InstanceMetadata},
};
use crate::env::Env;

/// aws-node's variable for an EC2 endpoint of its own.
pub const ENV_EC2_ENDPOINT: &str = "AWS_EC2_ENDPOINT";
/// aws-node's bound on one HTTP request to EC2 or IMDS, in seconds.
pub const ENV_HTTP_TIMEOUT: &str = "HTTP_TIMEOUT";
/// Its default, and the least aws-node takes.
pub const MIN_HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one EC2 call may take, retries included: a stuck call must not
/// stall the pool's reconciliation for long.
const EC2_OPERATION_TIMEOUT: Duration = Duration::from_secs(20);

/// Clients for EC2 and IMDS.
#[derive(Clone, Debug)]
pub struct Cloud {
    ec2: aws_sdk_ec2::Client,
    imds: aws_config::imds::Client,
}

/// Overrides of what `Cloud::connect` finds out itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloudOptions {
    /// The region; `None`: IMDS's `placement/region`.
    pub region: Option<String>,
    /// The EC2 endpoint; `None`: the SDK's own resolution (which honours
    /// `AWS_ENDPOINT_URL_EC2`).
    pub ec2_endpoint: Option<String>,
    /// One HTTP request's bound (an attempt, for EC2).
    pub http_timeout: Duration,
}

impl Default for CloudOptions {
    fn default() -> Self {
        Self {
            region: None,
            ec2_endpoint: None,
            http_timeout: MIN_HTTP_TIMEOUT,
        }
    }
}

impl CloudOptions {
    /// aws-node's variables: `AWS_EC2_ENDPOINT`, and `HTTP_TIMEOUT` (below
    /// 10 s or unreadable: 10 s, as aws-node, said at start).
    pub fn from_env(env: &Env) -> Self {
        let mut opts = Self {
            ec2_endpoint: env.get(ENV_EC2_ENDPOINT).map(|v| v.trim().to_owned()),
            ..Self::default()
        };
        if let Some(value) = env.get(ENV_HTTP_TIMEOUT) {
            match value.trim().parse::<u64>() {
                Ok(seconds) if Duration::from_secs(seconds) >= MIN_HTTP_TIMEOUT => {
                    opts.http_timeout = Duration::from_secs(seconds);
                }
                Ok(_) => env.tolerate(ENV_HTTP_TIMEOUT, value, "below 10 seconds", "10"),
                Err(_) => env.tolerate(ENV_HTTP_TIMEOUT, value, "not whole seconds", "10"),
            }
        }
        opts
    }
}

impl Cloud {
    /// Connects: the region comes from IMDS, as aws-node takes it.
    pub async fn connect(opts: CloudOptions) -> Result<Self, CloudError> {
        let imds = aws_config::imds::Client::builder()
            .connect_timeout(opts.http_timeout)
            .read_timeout(opts.http_timeout)
            .build();
        let region = match opts.region {
            Some(region) => region,
            None => imds::get(&imds, "placement/region").await?,
        };
        let sdk = aws_config::defaults(BehaviorVersion::latest())
            .region(Region::new(region))
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_timeout(EC2_OPERATION_TIMEOUT.max(opts.http_timeout))
                    .operation_attempt_timeout(opts.http_timeout)
                    .build(),
            )
            .load()
            .await;
        let mut ec2 = aws_sdk_ec2::config::Builder::from(&sdk);
        if let Some(endpoint) = opts.ec2_endpoint {
            ec2 = ec2.endpoint_url(endpoint);
        }
        Ok(Self {
            ec2: aws_sdk_ec2::Client::from_conf(ec2.build()),
            imds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_timeout_in_seconds_at_least_ten() {
        let env = Env::from_pairs([(ENV_HTTP_TIMEOUT, "30")]);
        assert_eq!(
            CloudOptions::from_env(&env).http_timeout,
            Duration::from_secs(30)
        );
        for value in ["5", "ten", "-1"] {
            let env = Env::from_pairs([(ENV_HTTP_TIMEOUT, value)]);
            assert_eq!(CloudOptions::from_env(&env).http_timeout, MIN_HTTP_TIMEOUT);
            assert_eq!(env.tolerated().len(), 1, "{value}");
        }
    }
}
