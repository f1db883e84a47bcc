//! The agent's one way to the cloud: EC2 through `aws-sdk-ec2` and the
//! instance metadata service through the SDK's IMDSv2 client. Endpoints are
//! overridable as the SDK allows (`AWS_ENDPOINT_URL_EC2`,
//! `AWS_EC2_METADATA_SERVICE_ENDPOINT`) and as aws-node allows
//! (`AWS_EC2_ENDPOINT`); credentials come from the SDK's default chain. The
//! lab's EC2 emulator is reached the same way, through these calls.

mod ec2;
mod error;
mod imds;

use std::time::Duration;

use aws_config::{BehaviorVersion, Region, timeout::TimeoutConfig};

pub use self::{
    ec2::{
        EniInfo, InstanceTypeLimits, NewEni, SubnetInfo, TAG_CLUSTER_NAME, TAG_CREATED_AT,
        TAG_INSTANCE_ID, TAG_NO_MANAGE, eni_description, time_now_rfc3339,
    },
    error::CloudError,
    imds::{ImdsEni, InstanceMetadata},
};

/// aws-node's variable for an EC2 endpoint of its own.
pub const ENV_EC2_ENDPOINT: &str = "AWS_EC2_ENDPOINT";

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
#[derive(Clone, Debug, Default)]
pub struct CloudOptions {
    /// The region; `None`: IMDS's `placement/region`.
    pub region: Option<String>,
    /// The EC2 endpoint; `None`: `AWS_EC2_ENDPOINT`, else the SDK's own
    /// resolution (which honours `AWS_ENDPOINT_URL_EC2`).
    pub ec2_endpoint: Option<String>,
}

impl Cloud {
    /// Connects: the region comes from IMDS, as aws-node takes it.
    pub async fn connect() -> Result<Self, CloudError> {
        Self::connect_with(CloudOptions::default()).await
    }

    /// Connects with overrides (an EC2 endpoint without IMDS, as in the
    /// cross-check against moto).
    pub async fn connect_with(opts: CloudOptions) -> Result<Self, CloudError> {
        let imds = aws_config::imds::Client::builder().build();
        let region = match opts.region {
            Some(region) => region,
            None => imds::get(&imds, "placement/region").await?,
        };
        let sdk = aws_config::defaults(BehaviorVersion::latest())
            .region(Region::new(region))
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_timeout(EC2_OPERATION_TIMEOUT)
                    .build(),
            )
            .load()
            .await;
        let mut ec2 = aws_sdk_ec2::config::Builder::from(&sdk);
        let endpoint = opts.ec2_endpoint.or_else(|| {
            std::env::var(ENV_EC2_ENDPOINT)
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        });
        if let Some(endpoint) = endpoint {
            ec2 = ec2.endpoint_url(endpoint);
        }
        Ok(Self {
            ec2: aws_sdk_ec2::Client::from_conf(ec2.build()),
            imds,
        })
    }
}
