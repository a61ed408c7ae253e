//! The external programs the tests run (promtool, prometheus, python3,
//! kubectl, systemd-analyze, sh). A missing one is a loud failure with an
//! install hint, never a skip: a skipped check would silently turn a test
//! into a no-op.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use super::{output_text, repo};

fn install_hint(program: &str) -> &'static str {
    match program {
        "promtool" | "prometheus" => {
            "install it: `apt-get install -y prometheus` (Debian/Ubuntu) or the \
             prometheus release tarball from https://prometheus.io/download/"
        }
        "python3" => "install it: `apt-get install -y python3` (Debian/Ubuntu)",
        "kubectl" => {
            "install kubectl (it includes kustomize): https://kubernetes.io/docs/tasks/tools/ \
             or `apt-get install -y kubectl` from pkgs.k8s.io"
        }
        "systemd-analyze" => "install it: `apt-get install -y systemd` (Debian/Ubuntu)",
        "slowhttptest" | "sslscan" | "openssl" => {
            "install it: `apt-get install -y slowhttptest sslscan openssl` (Debian/Ubuntu; scripts/ci/test does)"
        }
        "faketime" => {
            "install it: `apt-get install -y faketime` (Debian/Ubuntu; scripts/ci/test does)"
        }
        _ => "install it and put it on PATH",
    }
}

/// `tool` if it runs (`tool --version`), else a loud failure saying how
/// to install it.
pub fn require_tool(tool: &'static str) -> &'static str {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "`{tool}` does not run; {}", install_hint(tool));
    tool
}

/// `program` if it is on PATH (for tools without a `--version`, such as
/// slowhttptest), else a loud failure saying how to install it.
pub fn require_on_path(program: &'static str) -> &'static str {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()));
    assert!(
        found,
        "`{program}` is not on PATH; {}",
        install_hint(program)
    );
    program
}

/// Runs `program args...` in the repository root, feeding `stdin`.
pub fn run_tool(program: &str, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .current_dir(repo())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "`{program}` is not installed, so this check cannot run; {}",
            install_hint(program)
        ),
        Err(e) => panic!("cannot start `{program}`: {e}"),
    };
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin was piped");
        pipe.write_all(input)
            .unwrap_or_else(|e| panic!("writing to `{program}`: {e}"));
    }
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for `{program}`: {e}"))
}

/// Like [`run_tool`], and panics with the tool's output unless it
/// succeeded; its stdout.
pub fn run_tool_ok(program: &str, args: &[&str], stdin: Option<&[u8]>) -> String {
    let out = run_tool(program, args, stdin);
    assert!(
        out.status.success(),
        "`{program} {}` failed ({}):\n{}",
        args.join(" "),
        out.status,
        output_text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kubectl kustomize <dir>`, as a list of objects. kustomize prints YAML
/// only; `kubectl annotate --local` reads it offline (no cluster, any kind)
/// and prints JSON. Removing an annotation nobody sets changes nothing.
pub fn kustomize(dir: &str) -> Vec<serde_json::Value> {
    let yaml = run_tool_ok("kubectl", &["kustomize", dir], None);
    let json = run_tool_ok(
        "kubectl",
        &[
            "annotate",
            "--local",
            "-f",
            "-",
            "gpumem-exporter.test/unused-",
            "-o",
            "json",
        ],
        Some(yaml.as_bytes()),
    );
    let mut objects = Vec::new();
    for value in serde_json::Deserializer::from_str(&json).into_iter::<serde_json::Value>() {
        let value = value.unwrap_or_else(|e| panic!("kubectl printed bad JSON ({e}):\n{json}"));
        if value["kind"].as_str() == Some("List") {
            objects.extend(value["items"].as_array().into_iter().flatten().cloned());
        } else {
            objects.push(value);
        }
    }
    assert!(!objects.is_empty(), "{dir} rendered no objects");
    objects
}

/// `promtool check metrics` finds nothing to say about this exposition.
pub fn assert_promtool_check_metrics_clean(exposition: &str) {
    let out = run_tool(
        "promtool",
        &["check", "metrics"],
        Some(exposition.as_bytes()),
    );
    let report = output_text(&out);
    assert!(
        out.status.success() && report.is_empty(),
        "promtool check metrics: {report}\n{exposition}"
    );
}

/// Python's `prometheus_client` parsers (the text 0.0.4 one and the strict
/// OpenMetrics one) read `text` and `openmetrics` without an error, and
/// find every sample line in them.
pub fn assert_strict_parsers_accept(text: &str, openmetrics: &str) {
    const SCRIPT: &str = r#"
import sys
try:
    from prometheus_client.parser import text_string_to_metric_families as text
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
except ImportError as e:
    sys.exit(f"IMPORT {e}")
body = sys.stdin.read()
t, o = body.split("\0")
print(sum(len(f.samples) for f in text(t)), sum(len(f.samples) for f in om(o)))
"#;
    let input = format!("{text}\0{openmetrics}");
    let out = run_tool(
        super::python::python3(),
        &["-c", SCRIPT],
        Some(input.as_bytes()),
    );
    let report = output_text(&out);
    assert!(
        !report.contains("IMPORT "),
        "python3 has no prometheus_client ({report}); install it: `apt-get install -y \
         python3-prometheus-client` (Debian/Ubuntu) or `python3 -m pip install prometheus-client`"
    );
    assert!(
        out.status.success(),
        "prometheus_client rejects the exposition:\n{report}"
    );
    let samples = |body: &str| {
        body.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .count()
    };
    let counts = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(
        counts,
        format!("{} {}", samples(text), samples(openmetrics)),
        "samples parsed (text, OpenMetrics) vs sample lines"
    );
}
