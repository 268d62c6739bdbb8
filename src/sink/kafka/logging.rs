//! librdkafka's log lines, as kubecast's (target `kubecast::kafka`), for every Kafka client
//! context of the sink (the producer's and the transactional one's).

use rdkafka::config::RDKafkaLogLevel;
use tracing::{debug, error, warn};

pub(super) fn log(level: RDKafkaLogLevel, fac: &str, msg: &str) {
    match level {
        RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
            error!(target: "kubecast::kafka", facility = fac, "{msg}")
        }
        RDKafkaLogLevel::Warning => warn!(target: "kubecast::kafka", facility = fac, "{msg}"),
        _ => debug!(target: "kubecast::kafka", facility = fac, "{msg}"),
    }
}
