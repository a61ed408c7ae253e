//! An OpenMetrics recording after each way a recording ends: regrouped
//! after a clean stop (`--duration`, SIGINT, SIGTERM, the command's exit),
//! so the strict parser (`prometheus_client.openmetrics.parser`) reads it
//! and promtool still backfills every sample; as written after SIGKILL,
//! which promtool backfills and the strict parser refuses
//! (`--features external-tools`: python3 with prometheus_client, promtool).

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::*;
use crate::harness::python::python3;
use crate::harness::tools::run_tool;

/// How a recording is ended.
#[derive(Debug, Clone, Copy)]
enum End {
    Duration,
    Signal(&'static str),
    CommandExits,
}

/// The sample lines of an OpenMetrics text (every line but comments).
fn sample_lines(text: &str) -> usize {
    text.lines().filter(|l| !l.starts_with('#')).count()
}

/// `prometheus_client`'s strict OpenMetrics parser on `path`: the number
/// of samples it read, or its error.
fn strict_parse(path: &std::path::Path) -> Result<usize, String> {
    const SCRIPT: &str = r#"
import sys
try:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
except ImportError as e:
    sys.exit(f"IMPORT {e}")
text = open(sys.argv[1]).read()
try:
    print(sum(len(f.samples) for f in om(text)))
except ValueError as e:
    print(f"REFUSED {e}")
"#;
    let out = run_tool(python3(), &["-c", SCRIPT, path_str(path)], None);
    let report = output_text(&out);
    assert!(
        !report.contains("IMPORT "),
        "python3 has no prometheus_client ({report}); install it: `apt-get install -y \
         python3-prometheus-client` (Debian/Ubuntu) or `python3 -m pip install prometheus-client`"
    );
    assert!(out.status.success(), "python3: {report}");
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match said.strip_prefix("REFUSED ") {
        Some(e) => Err(e.to_string()),
        None => Ok(said.parse().unwrap_or_else(|_| panic!("a count: {said}"))),
    }
}

/// promtool backfills `path` into blocks under `data`; the number of
/// samples `promtool tsdb dump` finds in them.
fn backfilled_samples(path: &std::path::Path, data: &std::path::Path) -> usize {
    let made = run_tool(
        "promtool",
        &[
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            path_str(path),
            path_str(data),
        ],
        None,
    );
    assert!(made.status.success(), "promtool: {}", output_text(&made));
    // `tsdb dump` opens the folder as a database, which has a WAL; the
    // backfill writes blocks only.
    std::fs::create_dir_all(data.join("wal")).unwrap();
    let dump = run_tool("promtool", &["tsdb", "dump", path_str(data)], None);
    assert!(
        dump.status.success(),
        "promtool dump: {}",
        output_text(&dump)
    );
    String::from_utf8_lossy(&dump.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .count()
}

/// Record `run.om` in a folder of its own on one GPU with a real process
/// (so process families are in it), ended as `end` says; returns the
/// folder and the file.
fn record_until(end: End, sc: &Scenario) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let om = dir.path().join("run.om");
    let mut args = vec!["-o", path_str(&om), "--sample-interval", "200ms"];
    match end {
        End::Duration => args.extend(["--duration", "1500ms"]),
        End::Signal(_) => {}
        End::CommandExits => args.extend(["--", "sh", "-c", "sleep 1.5; exit 0"]),
    }
    let child = record(sc, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn record");
    if let End::Signal(sig) = end {
        wait_for(Duration::from_secs(20), "full samples written", || {
            let t = std::fs::read_to_string(&om).ok()?;
            (t.matches("\ngpu_process_memory_used_bytes{").count() >= 4).then_some(())
        });
        send_signal(&child, sig);
    }
    let out = wait_output(child, Duration::from_secs(30));
    assert_ok(&out, &format!("record ended by {end:?}"));
    (dir, om)
}

/// After every clean stop the file is strict OpenMetrics — each family
/// once (one `# TYPE`), one `# EOF`, accepted by the strict parser with
/// every sample line read — and promtool backfills every sample of it;
/// nothing is left beside it.
#[test]
fn openmetrics_is_strict_after_each_clean_stop() {
    let procs = Sleepers::new(1);
    let sc = Scenario::new(&scenario(30_000_000_017, &[(procs.pid(0), 25_000_000_023)]));
    for end in [
        End::Duration,
        End::Signal("INT"),
        End::Signal("TERM"),
        End::CommandExits,
    ] {
        let (dir, om) = record_until(end, &sc);
        let text = std::fs::read_to_string(&om).unwrap();
        assert!(text.ends_with("\n# EOF\n"), "{end:?}: ends with # EOF");
        assert_eq!(text.matches("# EOF").count(), 1, "{end:?}");
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let unique: BTreeSet<&str> = types.iter().copied().collect();
        assert_eq!(types.len(), unique.len(), "{end:?}: each family once");
        assert!(
            unique.contains("# TYPE gpu_process_memory_used_bytes gauge"),
            "{end:?}: full samples in it"
        );
        let lines = sample_lines(&text);
        let used = text
            .lines()
            .filter(|l| l.starts_with("gpu_memory_used_bytes{"))
            .count();
        assert!(used >= 5, "{end:?}: {used} memory samples");
        assert_eq!(
            strict_parse(&om),
            Ok(lines),
            "{end:?}: the strict parser reads every sample line"
        );
        let data = dir.path().join("data");
        assert_eq!(
            backfilled_samples(&om, &data),
            lines,
            "{end:?}: promtool backfills every sample"
        );
        std::fs::remove_dir_all(&data).unwrap();
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let mut left = left;
        left.sort();
        // The recording and `record`'s summary beside it (docs/record.md).
        assert_eq!(
            left,
            ["run.om", "run.om.summary.json"],
            "{end:?}: no temporary file left"
        );
    }
}

/// A recorder killed with SIGKILL never regroups: the file is what it was
/// at its last sample, one block per sample ending in `# EOF`, which
/// promtool backfills (every sample) and the strict parser refuses, as
/// docs/record.md says.
#[test]
fn a_killed_recorder_leaves_a_promtool_valid_file() {
    let procs = Sleepers::new(1);
    let sc = Scenario::new(&scenario(1 << 30, &[(procs.pid(0), 1 << 29)]));
    let dir = tempfile::tempdir().unwrap();
    let om = dir.path().join("run.om");
    let mut child = record(&sc, &["-o", path_str(&om), "--sample-interval", "200ms"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn record");
    wait_for(Duration::from_secs(20), "full samples written", || {
        let t = std::fs::read_to_string(&om).ok()?;
        (t.matches("\ngpu_process_memory_used_bytes{").count() >= 4).then_some(())
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&om).unwrap();
    assert!(text.ends_with("\n# EOF\n"), "ends with # EOF");
    assert!(
        text.matches("# TYPE gpu_info gauge").count() >= 2,
        "one block per sample"
    );
    let e = strict_parse(&om).expect_err("the strict parser refuses a file as written");
    assert!(e.contains("Clashing name"), "{e}");
    let data = dir.path().join("data");
    assert_eq!(backfilled_samples(&om, &data), sample_lines(&text));
}
