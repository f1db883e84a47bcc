//! What can go wrong talking to EC2 and IMDS, and which of it is worth
//! retrying.

use aws_sdk_ec2::{
    config::http::HttpResponse,
    error::{DisplayErrorContext, ProvideErrorMetadata, SdkError},
};

use crate::telemetry::Outcome;

/// EC2's codes for "slow down" and "try again later".
const RETRYABLE_CODES: &[&str] = &[
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "InternalError",
    "InternalFailure",
    "Unavailable",
    "ServiceUnavailable",
];

/// The subnet has no free address (or no free /28) left.
const SUBNET_EXHAUSTED_CODES: &[&str] = &[
    "InsufficientFreeAddressesInSubnet",
    "InsufficientCidrBlocks",
];

#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    #[error("reading IMDS {path}: {detail}")]
    Imds { path: String, detail: String },
    #[error("IMDS {path}: {value:?} is not {expected}")]
    ImdsValue {
        path: String,
        value: String,
        expected: &'static str,
    },
    #[error("EC2 {action}: {code}: {message}")]
    Api {
        action: &'static str,
        code: String,
        message: String,
        /// The HTTP status, when a response came.
        status: Option<u16>,
    },
    #[error("EC2 {action}: {detail}")]
    Transport {
        action: &'static str,
        detail: String,
    },
    #[error("EC2 {action}: the reply has no {field}")]
    Incomplete {
        action: &'static str,
        field: &'static str,
    },
}

impl CloudError {
    pub(crate) fn from_sdk<E>(action: &'static str, err: &SdkError<E, HttpResponse>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let status = err.raw_response().map(|r| r.status().as_u16());
        match err.code() {
            Some(code) => Self::Api {
                action,
                code: code.to_owned(),
                message: err.message().unwrap_or_default().to_owned(),
                status,
            },
            None => Self::Transport {
                action,
                detail: DisplayErrorContext(err).to_string(),
            },
        }
    }

    /// The EC2 call that failed (`None` for IMDS).
    #[must_use]
    pub fn action(&self) -> Option<&'static str> {
        match self {
            Self::Api { action, .. }
            | Self::Transport { action, .. }
            | Self::Incomplete { action, .. } => Some(action),
            Self::Imds { .. } | Self::ImdsValue { .. } => None,
        }
    }

    /// EC2's error code, if EC2 answered with one.
    #[must_use]
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// How the call ended, for the metrics.
    #[must_use]
    pub fn outcome(&self) -> Outcome<'_> {
        match self {
            Self::Api { code, .. } => Outcome::ApiError(code),
            Self::Imds { .. }
            | Self::ImdsValue { .. }
            | Self::Transport { .. }
            | Self::Incomplete { .. } => Outcome::OtherError { status: None },
        }
    }

    /// Throttling, server errors and lost connections: retry with backoff.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Api { code, status, .. } => {
                RETRYABLE_CODES.contains(&code.as_str()) || status.is_some_and(|s| s >= 500)
            }
            Self::Transport { .. } | Self::Imds { .. } => true,
            Self::ImdsValue { .. } | Self::Incomplete { .. } => false,
        }
    }

    /// EC2 is throttling this account.
    #[must_use]
    pub fn is_throttling(&self) -> bool {
        matches!(
            self.code(),
            Some("RequestLimitExceeded" | "Throttling" | "ThrottlingException")
        )
    }

    /// The subnet is out of addresses or of free /28 blocks.
    #[must_use]
    pub fn is_subnet_exhausted(&self) -> bool {
        self.code()
            .is_some_and(|code| SUBNET_EXHAUSTED_CODES.contains(&code))
    }

    /// No free, aligned /28 left in the subnet (it may still have single
    /// addresses): the cue to fall back from prefixes to addresses.
    #[must_use]
    pub fn is_insufficient_cidr_blocks(&self) -> bool {
        self.code() == Some("InsufficientCidrBlocks")
    }
}
