//! Every dashboard query and rule expression answered the same by
//! VictoriaMetrics as by Prometheus. VictoriaMetrics holds exactly the
//! samples Prometheus scraped (its remote write; recorded series and ALERTS
//! are left out of it, so those in VictoriaMetrics are vmalert's own), so
//! both are asked at one instant, a few seconds back (both have every
//! sample up to it), and must answer:
//!
//! - the same series: the same label sets, but for `__name__`, which
//!   MetricsQL keeps after `*_over_time` and a few other functions where
//!   PromQL drops it; and a series Prometheus answers with NaN (a
//!   `histogram_quantile` of all-zero rates: the hung exporter) may be
//!   absent from VictoriaMetrics, which leaves NaN out of its answers;
//! - the same values, by what the expression reads ([`Class`]): equal to
//!   1e-9 relative or [`EXACT_ABS`] absolute (`time() - x` on Unix
//!   timestamps: VictoriaMetrics keeps a float to about 15 significant
//!   digits, so a stored 1.8e9 s timestamp comes back a few µs off — 1.9 µs
//!   was seen) for instant selectors; within [`WINDOW_REL`] relative
//!   (or [`WINDOW_ABS`] absolute, for values near 0) for a range window of
//!   the test's length (the 10 s `$__rate_interval`, `*_over_time`) or a
//!   recorded series. MetricsQL's rate takes the last sample before the
//!   window as its start and does not extrapolate to the window's edges as
//!   PromQL does, so over 10 s at a 1 s scrape the two differ by about a
//!   sample in ten; recorded series are evaluated by two rule engines at
//!   their own instants. For `rate`, `increase`, `deriv`, `delta` or
//!   `predict_linear` over a window longer than the test has run (every
//!   series is younger than it), only the series are compared: MetricsQL
//!   counts a counter that started inside the window from 0, PromQL
//!   extrapolates from its first sample (NvmlErrorsRising's increase over
//!   10m reads 216 against 153), by design of each; so for an expression
//!   over a recorded series whose rule is such a window (the accounting
//!   rollups' day and week sums of hourly `increase()` tiles: 6.7 GiB-hours
//!   against 4.7).
//!
//! A round with a mismatch is retried at a later instant (a sample may be
//! in flight); three in a row fail the test, with the table.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use serde_json::Value;

use super::{Targets, dashboard_queries, rules, variables};
use crate::harness::fleet::VmStack;
use crate::harness::prom::{Prometheus, QueryApi, QueryResult, grafana_substitute, metric_names};
use crate::harness::unix_now;

/// The absolute slack of an instant selector's value (seconds, for
/// `time() - timestamp`): see the module doc.
const EXACT_ABS: f64 = 1e-5;

/// Relative tolerance for windowed expressions and recorded series.
const WINDOW_REL: f64 = 0.25;
/// Absolute tolerance beside it, for values near 0 (a rate of a few per
/// second, a share, a slope that is 0 on one side and 1e-3 on the other).
const WINDOW_ABS: f64 = 1e-3;

/// A series' labels but `__name__`, as one sortable key.
fn key(series: &Value) -> String {
    let mut labels = series["metric"].as_object().cloned().unwrap_or_default();
    labels.remove("__name__");
    Value::Object(labels).to_string()
}

fn value(series: &Value) -> f64 {
    // A vector element's value, or a scalar's.
    let v = if series["value"].is_array() {
        &series["value"][1]
    } else {
        &series[1]
    };
    v.as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

fn by_labels(q: &QueryResult) -> BTreeMap<String, f64> {
    q.result.iter().map(|s| (key(s), value(s))).collect()
}

/// How an expression's values are compared.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Class {
    /// Instant selectors only: equal (float rounding aside).
    Exact,
    /// A window of the test's length or a recorded series: the tolerance.
    Windowed,
    /// An extrapolating function over a window longer than the series'
    /// history: the series only.
    SeriesOnly,
}

/// Range windows in `expr` ("10s", "15m", "1h"), in seconds.
fn windows(expr: &str) -> Vec<f64> {
    expr.split('[')
        .skip(1)
        .filter_map(|w| w.split([']', ':']).next())
        .filter_map(|w| {
            let (n, unit) = w.split_at(w.find(|c: char| !c.is_ascii_digit())?);
            let n: f64 = n.parse().ok()?;
            Some(match unit {
                "s" => n,
                "m" => n * 60.0,
                "h" => n * 3600.0,
                "d" => n * 86400.0,
                _ => return None,
            })
        })
        .collect()
}

/// The class of `expr`; `records` holds each recording rule's expression,
/// so an expression over a recorded series takes that record's class when
/// it is SeriesOnly (a 7-day sum of hourly `increase()` tiles carries the
/// tiles' difference).
fn class(expr: &str, records: &BTreeMap<String, String>) -> Class {
    let extrapolating = ["rate(", "increase(", "deriv(", "delta(", "predict_linear("]
        .iter()
        .any(|f| expr.contains(f));
    let reads_series_only = metric_names(expr).iter().any(|n| {
        records
            .get(n)
            .is_some_and(|e| e != expr && class(e, records) == Class::SeriesOnly)
    });
    // Longer than the test's data (it has run for under two minutes).
    if reads_series_only || (extrapolating && windows(expr).iter().any(|w| *w >= 120.0)) {
        Class::SeriesOnly
    } else if expr.contains('[') || metric_names(expr).iter().any(|n| n.contains(':')) {
        Class::Windowed
    } else {
        Class::Exact
    }
}

fn same_value(a: f64, b: f64, class: Class) -> bool {
    if a.is_nan() || b.is_nan() {
        return a.is_nan() && b.is_nan();
    }
    if a == b {
        return true;
    }
    let (d, scale) = ((a - b).abs(), a.abs().max(b.abs()));
    match class {
        Class::Exact => d <= 1e-9 * scale || d <= EXACT_ABS,
        Class::Windowed => d <= WINDOW_REL * scale || d <= WINDOW_ABS,
        Class::SeriesOnly => true,
    }
}

/// One expression's comparison: None when the same, else what differs;
/// and the largest relative difference of the values it matched.
fn compare(p: &QueryResult, v: &QueryResult, class: Class) -> (Option<String>, f64) {
    let (p, v) = (by_labels(p), by_labels(v));
    let only_p: Vec<&String> = p
        .iter()
        .filter(|(k, a)| !v.contains_key(*k) && !a.is_nan())
        .map(|(k, _)| k)
        .collect();
    let only_v: Vec<&String> = v.keys().filter(|k| !p.contains_key(*k)).collect();
    if !only_p.is_empty() || !only_v.is_empty() {
        return (
            Some(format!(
                "series only in Prometheus: {only_p:?}; only in VictoriaMetrics: {only_v:?}"
            )),
            0.0,
        );
    }
    let mut worst = 0.0f64;
    for (k, a) in &p {
        let Some(&b) = v.get(k) else { continue };
        if a.is_finite() && b.is_finite() && *a != b {
            worst = worst.max((a - b).abs() / a.abs().max(b.abs()));
        }
        if !same_value(*a, b, class) {
            return (
                Some(format!("{k}: Prometheus {a}, VictoriaMetrics {b}")),
                worst,
            );
        }
    }
    (None, worst)
}

/// Every panel query (the variables at "All" and at a selection) and every
/// rule expression, in Prometheus and in VictoriaMetrics at one instant.
pub(super) fn same_answers(prom: &Prometheus, vm: &VmStack, t: &Targets) {
    let mut exprs: Vec<(String, String)> = Vec::new();
    for (title, ref_id, expr) in dashboard_queries() {
        for (pass, vars) in ["all", "sel"].into_iter().zip(variables(t)) {
            let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
            exprs.push((
                format!("panel {title} [{ref_id}] ({pass})"),
                grafana_substitute(&expr, &vars),
            ));
        }
    }
    let mut records = BTreeMap::new();
    for rule in rules() {
        if let Some(r) = &rule.record {
            records.insert(r.clone(), rule.expr.clone());
        }
        let name = rule.alert.or(rule.record).unwrap_or_default();
        exprs.push((format!("rule {name}"), rule.expr));
    }
    let mut last = String::new();
    for attempt in 1..=3 {
        // Both have every sample up to a few seconds ago: Prometheus's
        // remote write sends within 200 ms, VictoriaMetrics shows a sample
        // 1 s after it arrived (-search.latencyOffset=1s).
        let at = (unix_now() - 4.0).floor();
        let mut report = String::from(
            "\n  same   series  max rel diff  (Prometheus and VictoriaMetrics at one instant)\n",
        );
        let (mut failed, mut exact, mut within, mut series_only) = (0, 0, 0, 0);
        let mut worst_window = 0.0f64;
        for (name, expr) in &exprs {
            let p = prom.query_at(expr, at);
            let v = QueryApi::query_at(vm, expr, at);
            assert!(p.ok(), "{name}: Prometheus rejects {expr}: {:?}", p.error);
            assert!(
                v.ok(),
                "{name}: VictoriaMetrics rejects\n    {expr}\n{:?}",
                v.error
            );
            let class = class(expr, &records);
            let (problem, worst) = compare(&p, &v, class);
            if class == Class::Windowed {
                worst_window = worst_window.max(worst);
            }
            match &problem {
                None if class == Class::SeriesOnly => series_only += 1,
                None if worst == 0.0 => exact += 1,
                None => within += 1,
                Some(_) => failed += 1,
            }
            report.push_str(&format!(
                "{:>6} {:>8}  {:>12.2e}  {:<10} {name}{}\n",
                if problem.is_none() { "ok" } else { "DIFF" },
                p.result.len(),
                worst,
                format!("{class:?}"),
                problem
                    .map(|p| format!("\n                -> {p}"))
                    .unwrap_or_default()
            ));
        }
        report.push_str(&format!(
            "{} expressions: {exact} the same to the bit, {within} within the tolerance \
             (largest relative difference of a windowed one: {worst_window:.2e}; allowed \
             {WINDOW_REL} or {WINDOW_ABS} absolute), {series_only} the same series (long \
             extrapolating windows), {failed} different\n",
            exprs.len()
        ));
        if failed == 0 {
            let _ = writeln!(std::io::stderr(), "{report}");
            return;
        }
        last = format!("attempt {attempt} at {at}:{report}");
        std::thread::sleep(Duration::from_secs(2));
    }
    panic!(
        "VictoriaMetrics answers differently from Prometheus:\n{last}\n{}",
        QueryApi::log(vm)
    );
}
