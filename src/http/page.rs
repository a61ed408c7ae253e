//! The live page at `/`: one HTML file, one script and one style sheet,
//! compiled into the binary (`page/`), served from this origin only. No
//! external asset, no inline script or style, no inline event handler, so
//! [`CSP`] can forbid everything else: the page works offline and behind
//! the same TLS and basic auth as `/metrics` (the browser sends the
//! credentials it was asked for with its same-origin requests).
//!
//! The script reads `api/v1/snapshot` every sample interval and
//! `api/v1/history` (the sparklines) at most once a second, and builds the
//! DOM with `textContent` only: process names and pod names are data from
//! the host, never markup.

/// Where the script and the style sheet are served (relative links in the
/// page, so a reverse proxy may mount the exporter under a prefix).
pub(crate) const SCRIPT_PATH: &str = "/page/app.js";
pub(crate) const STYLE_PATH: &str = "/page/style.css";

pub(crate) const SCRIPT: &str = include_str!("page/app.js");
pub(crate) const STYLE: &str = include_str!("page/style.css");
const INDEX: &str = include_str!("page/index.html");

/// Same-origin script, style, fetches and images (the favicon is a
/// `data:` URL); nothing else, not even in a frame.
pub(crate) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
frame-ancestors 'none'";

/// `/api/v1/history` serves at most this many seconds: the ring's size.
pub(crate) const MAX_HISTORY_SECONDS: u64 = crate::history::HISTORY_SECONDS as u64;

/// The page's HTML, with the metrics path (`--web.telemetry-path`) and the
/// version filled in.
pub(crate) fn index(telemetry_path: &str) -> bytes::Bytes {
    let html = INDEX
        .replace("{{metrics_path}}", &escape(telemetry_path))
        .replace("{{version}}", &escape(crate::expose::VERSION));
    bytes::Bytes::from(html)
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `seconds` of `/api/v1/history?seconds=N`: 1 to [`MAX_HISTORY_SECONDS`],
/// the whole ring when absent. Other parameters are ignored (a client's
/// cache buster); a bad or repeated `seconds` is the error text of a 400.
pub(crate) fn history_seconds(query: Option<&str>) -> Result<u64, String> {
    let mut seconds = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "seconds" {
            continue;
        }
        if seconds.is_some() {
            return Err("seconds is given more than once".into());
        }
        let n = value
            .parse::<u64>()
            .ok()
            .filter(|n| (1..=MAX_HISTORY_SECONDS).contains(n))
            .ok_or_else(|| {
                let shown: String = value.chars().take(32).collect();
                format!(
                    "seconds must be a whole number from 1 to {MAX_HISTORY_SECONDS}, not {shown:?}"
                )
            })?;
        seconds = Some(n);
    }
    Ok(seconds.unwrap_or(MAX_HISTORY_SECONDS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_seconds_from_the_query() {
        for (query, want) in [
            (None, Ok(600)),
            (Some(""), Ok(600)),
            (Some("seconds=600"), Ok(600)),
            (Some("seconds=1"), Ok(1)),
            (Some("_=1700000000&seconds=60"), Ok(60)),
            (Some("other"), Ok(600)),
        ] {
            assert_eq!(history_seconds(query), want, "{query:?}");
        }
        for query in [
            "seconds=0",
            "seconds=601",
            "seconds=-5",
            "seconds=1e3",
            "seconds=",
            "seconds",
            "seconds=99999999999999999999999",
            "seconds=60&seconds=60",
            "seconds=%36%30",
        ] {
            let err = history_seconds(Some(query));
            assert!(err.is_err(), "{query}: {err:?}");
        }
    }

    #[test]
    fn the_page_is_self_contained_and_small() {
        let html = index("/gpu/metrics\"><script>");
        let html = std::str::from_utf8(&html).unwrap_or_default();
        assert!(html.contains("href=\"/gpu/metrics&quot;&gt;&lt;script&gt;\""));
        assert!(!html.contains("{{"), "every placeholder filled");
        // The SVG namespace is a name, not a fetch.
        let script = SCRIPT.replace("'http://www.w3.org/2000/svg'", "");
        for asset in [html, &script, STYLE] {
            for external in ["http://", "https://", "//cdn", "@import", "url("] {
                assert!(!asset.contains(external), "{external} in an asset");
            }
        }
        // No inline script, style or event handler (the CSP forbids them).
        assert!(!html.contains("<style"));
        assert!(!html.contains(" style="));
        for (i, _) in html.match_indices(" on") {
            let rest = &html[i + 3..];
            let name = rest.find(|c: char| !c.is_ascii_lowercase()).unwrap_or(0);
            assert!(!rest[name..].starts_with('='), "inline handler at {i}");
        }
        assert!(!script.contains("innerHTML"), "textContent only");
        assert!(!script.contains(".style."), "no inline styles");
        assert_eq!(html.matches("<script").count(), 1);
        assert!(html.contains("<script src=\"page/app.js\" defer></script>"));
        let weight = html.len() + SCRIPT.len() + STYLE.len();
        assert!(weight <= 50 * 1024, "page weight {weight} bytes > 50 KB");
    }
}
