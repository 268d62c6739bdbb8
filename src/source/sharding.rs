//! The requests of a shard's streams: the apiserver's `shardSelector` query parameter on the
//! lists and watches (kube's `ListParams` and `WatchParams` do not carry it), and a list page
//! read with its `metadata.shardInfo`, which says whether the apiserver applied it (see
//! [`crate::model::shard`]).

use kube::api::{Api, ListParams};
use serde::Deserialize;

use crate::model::{RawObject, Shard};

/// The query parameter of the apiserver's server-side sharded list and watch.
pub const SHARD_SELECTOR_PARAM: &str = "shardSelector";

/// Adds `name=value` (URL-encoded) to the request's query.
pub fn add_query<B>(request: &mut http::Request<B>, name: &str, value: &str) -> Result<(), kube::Error> {
    let uri = request.uri().to_string();
    let encoded: String = url::form_urlencoded::Serializer::new(String::new()).append_pair(name, value).finish();
    let sep = match uri.find('?') {
        None => "?",
        Some(at) if at + 1 == uri.len() || uri.ends_with('&') => "",
        Some(_) => "&",
    };
    let next = format!("{uri}{sep}{encoded}");
    *request.uri_mut() = next.parse().map_err(|e: http::uri::InvalidUri| {
        kube::Error::BuildRequest(kube::core::request::Error::Validation(format!("{name}: {e}")))
    })?;
    Ok(())
}

/// One page of a list.
#[derive(Debug, Deserialize)]
pub struct Page {
    pub metadata: PageMeta,
    #[serde(default)]
    pub items: Option<Vec<RawObject>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PageMeta {
    #[serde(default)]
    pub resource_version: Option<String>,
    #[serde(default, rename = "continue")]
    pub continue_: Option<String>,
    /// Present when the apiserver applied a shard selector: the selector it applied.
    #[serde(default)]
    pub shard_info: Option<ShardInfo>,
}

#[derive(Debug, Deserialize)]
pub struct ShardInfo {
    #[serde(default)]
    pub selector: String,
}

impl Page {
    /// Whether the apiserver applied exactly `shard`'s selector to this page.
    pub fn filtered_for(&self, shard: &Shard) -> bool {
        self.metadata
            .shard_info
            .as_ref()
            .and_then(|i| crate::model::shard::parse_selector(&i.selector))
            .is_some_and(|ranges| crate::model::shard::applies_exactly(&ranges, shard))
    }
}

/// `GET <resource>?<list params>[&shardSelector=...]`: one page, as the apiserver sent it.
pub async fn list_page(api: &Api<RawObject>, lp: &ListParams, shard: Option<&Shard>) -> Result<Page, kube::Error> {
    let mut request = kube::core::Request::new(api.resource_url()).list(lp).map_err(kube::Error::BuildRequest)?;
    if let Some(s) = shard {
        add_query(&mut request, SHARD_SELECTOR_PARAM, &s.selector())?;
    }
    request.extensions_mut().insert("list");
    api.clone().into_client().request::<Page>(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selector_is_added_url_encoded_to_any_query() {
        let s = Shard::new(3, 4).unwrap();
        for (uri, want_sep) in [("/api/v1/pods", "?"), ("/api/v1/pods?", ""), ("/api/v1/pods?watch=true", "&")] {
            let mut r = http::Request::get(uri).body(()).unwrap();
            add_query(&mut r, SHARD_SELECTOR_PARAM, &s.selector()).unwrap();
            let got = r.uri().to_string();
            let query = got.split_once('?').map(|(_, q)| q).unwrap_or_default();
            let pairs: Vec<(String, String)> = url::form_urlencoded::parse(query.as_bytes()).into_owned().collect();
            assert!(pairs.contains(&("shardSelector".into(), s.selector())), "{got}");
            assert!(got.starts_with(&format!("{uri}{want_sep}shardSelector=")), "{got}");
        }
    }

    #[test]
    fn a_page_says_whether_the_apiserver_applied_the_shard() {
        let s = Shard::new(1, 2).unwrap();
        let page = |meta: &str| -> Page {
            serde_json::from_str(&format!(r#"{{"kind":"PodList","metadata":{meta},"items":[]}}"#)).unwrap()
        };
        let applied = page(&format!(r#"{{"resourceVersion":"5","shardInfo":{{"selector":"{}"}}}}"#, s.selector()));
        assert!(applied.filtered_for(&s));
        assert!(!applied.filtered_for(&Shard::new(0, 2).unwrap()));
        let ignored = page(r#"{"resourceVersion":"5","continue":"abc"}"#);
        assert!(!ignored.filtered_for(&s));
        assert_eq!(ignored.metadata.continue_.as_deref(), Some("abc"));
    }
}
