//! The librdkafka properties of the config (`[sink.kafka.properties]`,
//! `[checkpoint.kafka.properties]`): checked by librdkafka itself without connecting, and
//! errors about them told without their values (librdkafka's own message repeats the value,
//! which may be a password).

use std::collections::BTreeMap;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaConfRes;

use crate::model::Problem;
use crate::sink::secret;

/// Where users look properties up (the version bundled with kubecast).
const REFERENCE: &str =
    "librdkafka's CONFIGURATION.md (https://github.com/confluentinc/librdkafka/blob/v2.12.1/CONFIGURATION.md)";

/// What librdkafka says of each property on its own: a name it does not know, a value it does
/// not take. Nothing connects; files named by properties are read later, when the client is
/// made. Values that cannot be resolved (`${env:...}`, `${file:...}`) are reported elsewhere.
pub fn problems(section: &str, props: &BTreeMap<String, String>) -> Vec<Problem> {
    let mut out = Vec::new();
    for (k, v) in props {
        let Ok(value) = secret::resolve(v) else { continue };
        let mut one = ClientConfig::new();
        one.set(k, value);
        if let Err(e) = one.create_native_config() {
            let (message, fix) = told(&e);
            out.push(Problem::new(format!("{section}.\"{k}\""), message, fix));
        }
    }
    out
}

/// `e` without any property value: for a property librdkafka refused, what was wrong and the
/// fix; any other error as it is.
pub fn describe(e: &KafkaError) -> String {
    match e {
        KafkaError::ClientConfig(_, _, key, _) => {
            let (message, fix) = told(e);
            format!("property \"{key}\": {message} (fix: {fix})")
        }
        other => other.to_string(),
    }
}

fn told(e: &KafkaError) -> (String, String) {
    match e {
        KafkaError::ClientConfig(RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, ..) => (
            "librdkafka has no property of that name".to_string(),
            format!("check the name (spelling, dots) in {REFERENCE}"),
        ),
        KafkaError::ClientConfig(_, desc, _, value) => {
            // librdkafka may quote the value in its text: cut it out (a value of a few
            // characters only where quoted, not to cut into the property's name).
            let mut desc = desc.replace(&format!("\"{value}\""), "\"…\"");
            if value.len() >= 4 {
                desc = desc.replace(value.as_str(), "…");
            }
            (format!("librdkafka refuses its value: {desc}"), format!("see the values it takes in {REFERENCE}"))
        }
        other => (other.to_string(), "correct the property".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn unknown_names_and_refused_values_are_named_without_the_value() {
        let p = problems(
            "s",
            &props(&[
                ("ssl.key.pasword", "S3cr3t-typo"),
                ("linger.ms", "soon-S3cr3t"),
                ("queue.buffering.max.kbytes", "x"),
                ("acks", "all"),
                ("sasl.password", "S3cr3t-ok"),
            ]),
        );
        let keys: Vec<&str> = p.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["s.\"linger.ms\"", "s.\"queue.buffering.max.kbytes\"", "s.\"ssl.key.pasword\""]);
        assert!(
            p[1].message.contains("\"queue.buffering.max.kbytes\""),
            "a short value does not cut the name: {}",
            p[1]
        );
        for problem in &p {
            let text = problem.to_string();
            assert!(!text.contains("S3cr3t"), "{text}");
            assert!(text.contains("CONFIGURATION.md"), "{text}");
        }
        assert!(p[2].message.contains("no property of that name"), "{}", p[2]);
    }

    #[test]
    fn a_client_config_error_is_described_without_its_value() {
        let mut cc = ClientConfig::new();
        cc.set("ssl.key.pasword", "S3cr3t-value");
        let e = cc.create_native_config().err().expect("an unknown property");
        assert!(e.to_string().contains("S3cr3t-value"), "librdkafka's own text has the value: {e}");
        let told = describe(&e);
        assert!(!told.contains("S3cr3t"), "{told}");
        assert!(told.contains("\"ssl.key.pasword\"") && told.contains("fix:"), "{told}");
    }
}
