//! Every collector's families read by `promtool check metrics`
//! (`--features external-tools`).

use std::time::Duration;

use super::{H200, g, scenario, start, with};
use crate::harness::tools::assert_promtool_check_metrics_clean;

/// With every collector on, the Xid counters counted and a process's
/// utilisation samples served, promtool finds nothing to say.
#[test]
fn promtool_check_metrics_is_clean_with_every_collector() {
    let sc = crate::harness::Scenario::new(&scenario("79, 48, 79"));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &["--collector.process_utilization"]);
    crate::harness::wait_for(
        Duration::from_secs(5),
        "three Xids counted and a process's utilisation",
        || {
            let m = ex.metrics();
            let xids = m.get(
                "gpu_xid_errors_total",
                &with(g("0", H200), &[("xid", "79")]),
            );
            let busy = m.find("gpu_process_sm_utilization_ratio", &[("pid", "4300001")]);
            (xids == Some(2.0) && !busy.is_empty()).then_some(())
        },
    );
    assert_promtool_check_metrics_clean(&ex.get("/metrics").body);
}
