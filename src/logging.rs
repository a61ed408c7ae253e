//! `tracing` setup: logfmt (default) or JSON lines on stderr.

use std::fmt::{self, Write as _};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::config::{Log, LogFormat, LogLevel};

pub fn init(cfg: &Log) {
    let filter = tracing_subscriber::EnvFilter::new(directives(cfg.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cfg.format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Logfmt => builder.event_format(Logfmt).try_init(),
    };
}

/// The filter: the exporter's own events at `level`, other crates' from
/// warn up, except kube-rs's (`kube_client`, `kube_runtime`), which only
/// show at debug and trace. kube-client logs every failed request at error
/// ("failed with error client error (Connect)") and every dropped watch
/// body at warn, without saying which request, and without a limit: during
/// an API server restart that is a line per retry. The exporter reports
/// those failures itself, once per kind with a suppressed count
/// ("kubernetes pod watcher"), and counts every one in
/// `gpumem_exporter_kubernetes_errors_total`.
fn directives(level: LogLevel) -> String {
    let own = level.as_str();
    let kube = match level {
        LogLevel::Debug | LogLevel::Trace => own,
        LogLevel::Error | LogLevel::Warn | LogLevel::Info => "off",
    };
    format!("warn,kube_client={kube},kube_runtime={kube},gpumem_exporter={own}")
}

/// `ts=… level=… msg="…" key=value …`, one event per line.
struct Logfmt;

impl<S, N> FormatEvent<S, N> for Logfmt
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut v = Fields::default();
        event.record(&mut v);
        write!(
            w,
            "ts={} level={} msg={}",
            rfc3339(SystemTime::now()),
            meta.level().as_str().to_ascii_lowercase(),
            quote(&v.message)
        )?;
        w.write_str(&v.rest)?;
        writeln!(w)
    }
}

#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            let _ = write!(self.rest, " {}={}", field.name(), quote(value));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

/// Quote a logfmt value when it needs it.
fn quote(s: &str) -> String {
    if !s.is_empty()
        && !s
            .chars()
            .any(|c| c == ' ' || c == '"' || c == '=' || c.is_control())
    {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// UTC RFC 3339 with milliseconds, without a date-time dependency.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        sod / 3600,
        (sod % 3600) / 60,
        sod % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_967_358_123);
        assert_eq!(rfc3339(t), "2026-11-29T15:49:18.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn kube_rs_lines_only_at_debug_and_trace() {
        for (level, want) in [
            (
                LogLevel::Error,
                "warn,kube_client=off,kube_runtime=off,gpumem_exporter=error",
            ),
            (
                LogLevel::Warn,
                "warn,kube_client=off,kube_runtime=off,gpumem_exporter=warn",
            ),
            (
                LogLevel::Info,
                "warn,kube_client=off,kube_runtime=off,gpumem_exporter=info",
            ),
            (
                LogLevel::Debug,
                "warn,kube_client=debug,kube_runtime=debug,gpumem_exporter=debug",
            ),
            (
                LogLevel::Trace,
                "warn,kube_client=trace,kube_runtime=trace,gpumem_exporter=trace",
            ),
        ] {
            assert_eq!(directives(level), want);
            // Each is a filter tracing-subscriber accepts.
            assert!(
                tracing_subscriber::EnvFilter::try_new(want).is_ok(),
                "{want}"
            );
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(quote("plain"), "plain");
        assert_eq!(quote(""), "\"\"");
        assert_eq!(quote("a b"), "\"a b\"");
        assert_eq!(quote("say \"hi\"\n"), "\"say \\\"hi\\\"\\n\"");
    }
}
