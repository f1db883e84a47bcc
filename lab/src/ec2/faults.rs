//! Injected faults and call counters. EC2 throttles (`RequestLimitExceeded`,
//! HTTP 503) and has bad moments (503 `Unavailable`, 500 `InternalError`);
//! an agent must retry with backoff and never lose state over them. A
//! node's IAM role may also lack an action (403 `UnauthorizedOperation`),
//! which the agent must report. Rates
//! per action (or `*` for all) are set in the configuration or at run time
//! through the admin API; every call and every injected fault is counted
//! per action so tests can check what the agent did.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    config::FaultRule,
    model::{Ec2Error, Rng},
};

/// What happened to one action so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionCounters {
    /// Every call, faulted or not.
    pub calls: u64,
    /// Calls answered with an EC2 error (injected ones included).
    pub errors: u64,
    /// Injected `RequestLimitExceeded`.
    pub throttled: u64,
    /// Injected `Unavailable`.
    pub unavailable: u64,
    /// Injected `InternalError`.
    pub internal: u64,
    /// Injected `UnauthorizedOperation`.
    #[serde(default)]
    pub unauthorized: u64,
}

/// The fault rules, their random draws, and the counters.
#[derive(Debug)]
pub struct Faults {
    rules: Vec<FaultRule>,
    rng: Rng,
    counters: BTreeMap<String, ActionCounters>,
}

impl Faults {
    pub fn new(rules: Vec<FaultRule>, seed: u64) -> Self {
        Self {
            rules,
            // Its own stream: faults must not change which addresses a run
            // gets.
            rng: Rng::new(seed ^ 0xfa17_fa17),
            counters: BTreeMap::new(),
        }
    }

    /// Replaces every rule.
    pub fn set_rules(&mut self, rules: Vec<FaultRule>) {
        self.rules = rules;
    }

    pub fn rules(&self) -> &[FaultRule] {
        &self.rules
    }

    /// Counts a call of `action` and says whether to fail it, and how. A
    /// rule for the action itself wins over `*`.
    pub fn on_call(&mut self, action: &str) -> Option<Ec2Error> {
        let counters = self.counters.entry(action.to_owned()).or_default();
        counters.calls += 1;
        let rule = self
            .rules
            .iter()
            .find(|r| r.action == action)
            .or_else(|| self.rules.iter().find(|r| r.action == "*"))?;
        let draw = self.rng.unit();
        let fault = if draw < rule.throttle {
            counters.throttled += 1;
            Ec2Error::new("RequestLimitExceeded", "Request limit exceeded.")
        } else if draw < rule.throttle + rule.unavailable {
            counters.unavailable += 1;
            Ec2Error::new(
                "Unavailable",
                "The server is overloaded and can't handle the request.",
            )
        } else if draw < rule.throttle + rule.unavailable + rule.internal {
            counters.internal += 1;
            Ec2Error::new(
                "InternalError",
                "An internal error has occurred. Retry your request.",
            )
        } else if draw < rule.throttle + rule.unavailable + rule.internal + rule.unauthorized {
            counters.unauthorized += 1;
            Ec2Error::new(
                "UnauthorizedOperation",
                "You are not authorized to perform this operation.",
            )
        } else {
            return None;
        };
        Some(fault)
    }

    /// Counts an error answer to `action`.
    pub fn on_error(&mut self, action: &str) {
        self.counters.entry(action.to_owned()).or_default().errors += 1;
    }

    pub fn counters(&self) -> &BTreeMap<String, ActionCounters> {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_count_and_specific_rules_win() {
        let mut faults = Faults::new(
            vec![
                FaultRule {
                    action: "*".into(),
                    throttle: 1.0,
                    ..FaultRule::default()
                },
                FaultRule {
                    action: "DescribeVpcs".into(),
                    ..FaultRule::default()
                },
            ],
            3,
        );
        for _ in 0..10 {
            assert_eq!(
                faults.on_call("AssignPrivateIpAddresses").unwrap().code,
                "RequestLimitExceeded"
            );
            assert!(faults.on_call("DescribeVpcs").is_none());
        }
        assert_eq!(faults.counters()["AssignPrivateIpAddresses"].throttled, 10);
        assert_eq!(faults.counters()["DescribeVpcs"].calls, 10);
        faults.set_rules(vec![FaultRule {
            action: "DescribeVpcs".into(),
            internal: 0.5,
            ..FaultRule::default()
        }]);
        let failed = (0..1000)
            .filter(|_| faults.on_call("DescribeVpcs").is_some())
            .count();
        assert!((400..600).contains(&failed), "{failed}");
        assert_eq!(faults.counters()["DescribeVpcs"].internal, failed as u64);
    }
}
