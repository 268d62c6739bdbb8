//! What a response means for the event, as Knative's data plane decides it: 2xx accepted;
//! 404, 408, 409, 429 and 5xx retried (with `Retry-After` on 429 and 503 honoured, capped);
//! 401 and 403 a set-up mistake (the receiver refuses kubecast itself, not this event: held,
//! never dead-lettered); 3xx a URL that moved (held too: every event would be redirected);
//! any other status the event's own (the dead letter, with the status and the start of the
//! body).

use std::time::{Duration, SystemTime};

use crate::model::Refusal;

/// The decision for one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    /// Retried; after at least this long when the receiver said so (`Retry-After`).
    Retry(Option<Duration>),
    /// Every event would get this answer: held until the operator fixes it.
    Refused(Refusal),
    /// This event will never be accepted: the dead letter.
    DeadLetter,
}

/// The verdict on `status`, with the response's `Retry-After` value (if any), honoured up to
/// `cap` (zero: ignored), at `now` (for an HTTP date).
pub fn verdict(status: u16, retry_after: Option<&str>, cap: Duration, now: SystemTime) -> Verdict {
    match status {
        200..=299 => Verdict::Accepted,
        429 | 503 => Verdict::Retry(
            retry_after.and_then(|v| parse_retry_after(v, now)).map(|d| d.min(cap)).filter(|d| !d.is_zero()),
        ),
        404 | 408 | 409 | 500..=599 => Verdict::Retry(None),
        401 | 403 => Verdict::Refused(Refusal::HttpNotAuthorized),
        300..=399 => Verdict::Refused(Refusal::HttpRedirect),
        // 1xx as a final answer, 400, 413 and the other 4xx.
        _ => Verdict::DeadLetter,
    }
}

/// `Retry-After`: seconds, or an HTTP date (RFC 9110); `None` when it is neither.
fn parse_retry_after(v: &str, now: SystemTime) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_secs(60);

    fn v(status: u16) -> Verdict {
        verdict(status, None, CAP, SystemTime::now())
    }

    #[test]
    fn statuses_as_knative_reads_them() {
        for s in [200, 201, 202, 204, 299] {
            assert_eq!(v(s), Verdict::Accepted, "{s}");
        }
        for s in [404, 408, 409, 429, 500, 502, 503, 504, 599] {
            assert_eq!(v(s), Verdict::Retry(None), "{s}");
        }
        for s in [400, 402, 405, 410, 411, 413, 415, 422, 100, 199] {
            assert_eq!(v(s), Verdict::DeadLetter, "{s}");
        }
        assert_eq!(v(401), Verdict::Refused(Refusal::HttpNotAuthorized));
        assert_eq!(v(403), Verdict::Refused(Refusal::HttpNotAuthorized));
        assert_eq!(v(301), Verdict::Refused(Refusal::HttpRedirect));
        assert_eq!(v(308), Verdict::Refused(Refusal::HttpRedirect));
    }

    #[test]
    fn retry_after_is_honoured_on_429_and_503_up_to_the_cap() {
        let now = SystemTime::now();
        assert_eq!(verdict(503, Some("7"), CAP, now), Verdict::Retry(Some(Duration::from_secs(7))));
        assert_eq!(verdict(429, Some(" 3 "), CAP, now), Verdict::Retry(Some(Duration::from_secs(3))));
        assert_eq!(verdict(429, Some("3600"), CAP, now), Verdict::Retry(Some(CAP)), "capped");
        assert_eq!(verdict(429, Some("3"), Duration::ZERO, now), Verdict::Retry(None), "a cap of 0 ignores it");
        assert_eq!(verdict(500, Some("7"), CAP, now), Verdict::Retry(None), "only 429 and 503");
        assert_eq!(verdict(503, Some("soon"), CAP, now), Verdict::Retry(None), "unreadable: the backoff decides");
        let at = now + Duration::from_secs(20);
        let date = httpdate::fmt_http_date(at);
        let Verdict::Retry(Some(d)) = verdict(503, Some(&date), CAP, now) else { panic!("a date is read") };
        assert!(d <= Duration::from_secs(20) && d >= Duration::from_secs(18), "{d:?}");
        let past = httpdate::fmt_http_date(now - Duration::from_secs(20));
        assert_eq!(verdict(503, Some(&past), CAP, now), Verdict::Retry(None), "a date in the past: at once");
    }
}
