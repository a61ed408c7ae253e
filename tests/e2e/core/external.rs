//! The served exposition read by the tools that consume it: `promtool
//! check metrics` and the strict parsers of Python's prometheus_client
//! (`--features external-tools`).

use std::time::Duration;

use super::scenario;
use crate::harness::tools::{assert_promtool_check_metrics_clean, assert_strict_parsers_accept};
use crate::harness::*;

#[test]
fn promtool_check_metrics_is_clean() {
    let me = std::process::id();
    let sc = Scenario::new(&scenario(me, true, "null"));
    let ex = Exporter::start(&sc, &[]);
    // Make sure errors are present too, so the counter family has samples.
    sc.write(&scenario(me, true, "gpu_lost"));
    wait_for(Duration::from_secs(5), "an error sample", || {
        ex.metrics()
            .text
            .contains("gpumem_exporter_nvml_errors_total{")
            .then_some(())
    });
    assert_promtool_check_metrics_clean(&ex.get("/metrics").body);
}

/// The strict parsers of Python's prometheus_client read the served bodies
/// (text and OpenMetrics), every sample of them.
#[test]
fn strict_parsers_accept_the_served_bodies() {
    let me = std::process::id();
    let sc = Scenario::new(&scenario(me, true, "null"));
    let ex = Exporter::start(&sc, &[]);
    let text = ex.metrics().text;
    let om = http_get(
        ex.addr,
        "/metrics",
        &[("Accept", "application/openmetrics-text;version=1.0.0")],
    )
    .body;
    assert_strict_parsers_accept(&text, &om);
}
