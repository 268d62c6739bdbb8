//! Why a Lease could not be read, created or renewed, by cause: each with its own fix, decided
//! on the apiserver's status code, never on the text.

use crate::observe::kube_error::in_words;

/// A Lease (the election's, or a sharded replica's member Lease) that could not be read,
/// created or renewed. Every attempt is repeated (the election loops); the cause is on
/// `/readyz` and in the log.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// 401 or 403: kubecast's identity may not use the Lease.
    #[error(
        "lease {namespace}/{name}: {message} (fix: grant get, watch, create and update on leases.coordination.k8s.io {name} in {namespace} to kubecast's identity, and list and delete on leases there: each replica's member Lease)"
    )]
    Forbidden { namespace: String, name: String, message: String },
    /// 404 when creating it: the namespace does not exist.
    #[error(
        "lease {namespace}/{name}: {message} (fix: create the namespace {namespace}, or set [coordination] lease_namespace to one that exists)"
    )]
    NamespaceMissing { namespace: String, name: String, message: String },
    /// 400 or 422: an admission policy or webhook (or a quota) refuses the Lease.
    #[error(
        "lease {namespace}/{name}: the apiserver refuses the Lease: {message} (fix: an admission policy, webhook or quota rejects it; allow kubecast's Leases in {namespace}, or set [coordination] lease_namespace elsewhere)"
    )]
    Refused { namespace: String, name: String, message: String },
    /// No answer, a timeout, 429 or 5xx: the apiserver is not reachable or failing now.
    #[error("lease {namespace}/{name}: the apiserver is not reachable or failing: {message} (retried)")]
    Unavailable { namespace: String, name: String, message: String },
}

impl LeaseError {
    /// The cause of `e`, met on Lease `namespace`/`name`.
    pub fn from_kube(namespace: &str, name: &str, e: &kube::Error) -> Self {
        let (namespace, name, message) = (namespace.to_string(), name.to_string(), in_words(e).to_string());
        match e {
            kube::Error::Api(s) if s.code == 401 || s.code == 403 => Self::Forbidden { namespace, name, message },
            kube::Error::Api(s) if s.code == 404 => Self::NamespaceMissing { namespace, name, message },
            kube::Error::Api(s) if s.code == 400 || s.code == 422 => Self::Refused { namespace, name, message },
            _ => Self::Unavailable { namespace, name, message },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LeaseError;

    fn api(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(&format!("leases.coordination.k8s.io \"k\" is {reason}"), reason)
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn each_cause_its_own_fix() {
        let forbidden = LeaseError::from_kube("ns", "k", &api(403, "Forbidden"));
        assert!(matches!(forbidden, LeaseError::Forbidden { .. }));
        assert!(forbidden.to_string().contains("grant get, watch, create and update"), "{forbidden}");
        let missing = LeaseError::from_kube("ns", "k", &api(404, "NotFound"));
        assert!(missing.to_string().contains("create the namespace ns"), "{missing}");
        let refused = LeaseError::from_kube("ns", "k", &api(422, "Invalid"));
        assert!(refused.to_string().contains("admission policy"), "{refused}");
        let busy = LeaseError::from_kube("ns", "k", &api(503, "ServiceUnavailable"));
        assert!(matches!(busy, LeaseError::Unavailable { .. }) && !busy.to_string().contains("grant"), "{busy}");
    }
}
