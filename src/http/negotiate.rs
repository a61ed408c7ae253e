//! Content negotiation: which exposition format (`Accept`) and whether to
//! gzip (`Accept-Encoding`). Hand-written because both are a few lines of
//! q-value parsing and the HTTP crates we use do not offer it.

use crate::expose::Format;

/// OpenMetrics when the `Accept` header lists
/// `application/openmetrics-text` with a q-value that is positive and
/// not lower than the best other acceptable type; the classic text
/// format otherwise (also for a missing or malformed header).
pub(crate) fn format(accept: Option<&str>) -> Format {
    let Some(accept) = accept else {
        return Format::Text;
    };
    let mut om_q: f32 = -1.0;
    let mut other_q: f32 = -1.0;
    for range in accept.split(',') {
        let mut parts = range.split(';');
        let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let mut q: f32 = 1.0;
        for p in parts {
            if let Some((k, v)) = p.split_once('=')
                && k.trim().eq_ignore_ascii_case("q")
            {
                q = v
                    .trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|q| q.is_finite())
                    .unwrap_or(0.0);
            }
        }
        if media == "application/openmetrics-text" {
            om_q = om_q.max(q);
        } else if !media.is_empty() {
            other_q = other_q.max(q);
        }
    }
    if om_q > 0.0 && om_q >= other_q {
        Format::OpenMetrics
    } else {
        Format::Text
    }
}

/// True when the `Accept-Encoding` header accepts gzip (q > 0).
pub(crate) fn accepts_gzip(accept_encoding: Option<&str>) -> bool {
    accept_encoding.is_some_and(|h| {
        h.split(',').any(|part| {
            let mut it = part.split(';');
            let coding = it.next().unwrap_or("").trim();
            let q = it
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map(|(_, v)| v.trim().parse::<f32>().unwrap_or(0.0))
                .unwrap_or(1.0);
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && q > 0.0
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_negotiation() {
        for (h, want) in [
            (None, false),
            (Some("gzip"), true),
            (Some("gzip, deflate, br"), true),
            (Some("deflate"), false),
            (Some("gzip;q=0"), false),
            (Some("*"), true),
            (Some("identity, gzip;q=0.5"), true),
            (Some(";;,"), false),
        ] {
            assert_eq!(accepts_gzip(h), want, "{h:?}");
        }
    }

    #[test]
    fn negotiation() {
        let cases = [
            (None, Format::Text),
            (Some(""), Format::Text),
            (Some("text/plain"), Format::Text),
            (Some("*/*"), Format::Text),
            (Some("application/openmetrics-text"), Format::OpenMetrics),
            // What Prometheus 2.x sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                Format::OpenMetrics,
            ),
            (
                Some("text/plain;q=1,application/openmetrics-text;q=0.5"),
                Format::Text,
            ),
            (Some("application/openmetrics-text;q=0"), Format::Text),
            (Some("application/openmetrics-text;q=abc"), Format::Text),
            (Some(";;;,,,==="), Format::Text),
        ];
        for (accept, want) in cases {
            assert_eq!(format(accept), want, "{accept:?}");
        }
    }
}
