//! The operations artifacts — alert rules, Kubernetes manifests, systemd
//! unit, Dockerfile, Grafana dashboard — checked with the tools that consume
//! them, so a broken manifest fails the tests instead of a deployment.
//!
//! Here, what needs no tool: the alerts' unit-test coverage, the Dockerfile,
//! the shipped config files read by the exporter, the dashboard's variables.
//! In `external` (`--features external-tools`), the checks by the tools
//! (each test panics with an install hint when its tool is missing, it
//! never skips):
//! - `promtool` (Debian/Ubuntu: `apt-get install -y prometheus`),
//! - `kubectl` (ships kustomize; works offline here),
//! - `systemd-analyze` (Debian/Ubuntu: `apt-get install -y systemd`),
//! - `sh` and `sed`.
//!
//! kustomize output is turned into JSON by `kubectl annotate --local -o
//! json` and read with serde_json.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpumem_exporter::testing::config::{self, Config, Overrides};

use crate::harness::{BIN, repo_file};

#[cfg(feature = "external-tools")]
mod external;

const ALERTS: [&str; 27] = [
    "GpuMemoryHigh",
    "GpuMemoryExhaustionPredicted",
    "GpuMemoryWillFillSoon",
    "GpuMemoryFillingFast",
    "GpuMemorySpikeWouldNotFit",
    "GpuTorchWillHitLimit",
    "GpuTorchLimitFillingFast",
    "GpuTorchMemoryLeak",
    "GpuProcessMemoryLeakSuspected",
    "GpuDown",
    "GpuMemExporterDown",
    "GpuMemExporterSamplesStale",
    "NvmlErrorsRising",
    "GpuTorchAllocRetriesRising",
    "GpuMemoryRowRemapPending",
    "GpuMemoryRowRemapFailed",
    "GpuUncorrectableEccErrors",
    "GpuXidCritical",
    "GpuAllocatedButIdle",
    "GpuMemoryHeldByDeadProcesses",
    "GpuMemoryHeldByOrphans",
    "GpuMemoryUnattributed",
    "GpuMemoryHeldIdle",
    "GpuWorkloadMemoryNearLimit",
    "GpuWorkloadMemoryLimitFillingFast",
    "GpuWorkloadMemoryOverGrantedShare",
    "GpuMemoryGrantsExceedTotal",
];

// ------------------------------------------------------------------ helpers

fn read(rel: &str) -> String {
    let path = repo_file(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Write `content` to `name` in `dir`.
fn write_in(dir: &tempfile::TempDir, name: &str, content: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, content).expect("write scratch file");
    path
}

/// GitHub's anchor (slug) for the text of a Markdown heading: lower case,
/// punctuation other than `-` and `_` removed, each space turned into `-`.
fn github_slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors GitHub gives the headings of a Markdown file: ATX headings
/// (`#` to `######` and a space) outside fenced code blocks, a repeated
/// slug numbered `-1`, `-2`, … as GitHub does.
fn heading_anchors(markdown: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    let mut fence: Option<&str> = None;
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(f) = fence {
            if trimmed.starts_with(f) {
                fence = None;
            }
            continue;
        }
        if indent < 4
            && let Some(f) = ["```", "~~~"].into_iter().find(|f| trimmed.starts_with(f))
        {
            fence = Some(f);
            continue;
        }
        let level = trimmed.chars().take_while(|c| *c == '#').count();
        let text = &trimmed[level..];
        if indent >= 4 || !(1..=6).contains(&level) || !(text.is_empty() || text.starts_with(' ')) {
            continue;
        }
        // An optional closing sequence of #s.
        let text = text.trim_end();
        let text = match text.trim_end_matches('#') {
            t if t.is_empty() || t.ends_with(' ') => t,
            _ => text,
        };
        let slug = github_slug(text);
        let mut anchor = slug.clone();
        let mut n = 0;
        while anchors.contains(&anchor) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
        anchors.insert(anchor);
    }
    anchors
}

/// The environment a shipped config file runs in: the DaemonSet's for
/// the Kubernetes ones (in-cluster API variables, NODE_NAME from the
/// downward API), a plain host's (none of those) for the others.
fn shipped_env(file: &str) -> &'static [(&'static str, &'static str)] {
    if file.starts_with("deploy/kubernetes/") {
        &IN_CLUSTER
    } else {
        &[]
    }
}

const IN_CLUSTER: [(&str, &str); 3] = [
    ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
    ("KUBERNETES_SERVICE_PORT", "443"),
    ("NODE_NAME", "gpu-node-1"),
];

/// The shipped config files, and whether each turns the torch bridge on:
/// off where the exporter lacks the capabilities it needs, on where they
/// are granted.
const SHIPPED_CONFIGS: [(&str, bool); 3] = [
    ("deploy/kubernetes/base/config.yaml", false),
    ("deploy/kubernetes/overlays/torch-bridge/config.yaml", true),
    ("deploy/systemd/config.yaml", false),
];

/// A config file as the exporter reads it, in the environment it is
/// shipped for (see [`shipped_env`]); its error when the exporter would
/// refuse it (an unknown key, a bad value).
fn load_config(path: &Path, env: &[(&str, &str)]) -> Result<Config, String> {
    let lookup = |key: &str| {
        env.iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
    };
    config::load(Some(path), &Overrides::default(), &lookup).map_err(|e| e.to_string())
}

/// A shipped config file as the exporter reads it; panics with the
/// exporter's error when it would refuse the file.
fn shipped_config(file: &str) -> Config {
    load_config(&repo_file(file), shipped_env(file))
        .unwrap_or_else(|e| panic!("the exporter refuses {file}: {e}"))
}

fn alert_names_in_rules_yml() -> Vec<String> {
    read("deploy/prometheus/rules.yml")
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
        .map(|n| n.trim().to_string())
        .collect()
}

// ------------------------------------------------------------------ alert rules

/// Each alert has a unit test where it fires and one where it must stay
/// silent (`exp_alerts: []`).
#[test]
fn every_alert_is_tested_firing_and_silent() {
    let names = alert_names_in_rules_yml();
    assert_eq!(names, ALERTS, "alerts in rules.yml");
    let tests = read("deploy/prometheus/rules_test.yml");
    let lines: Vec<&str> = tests
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut fires = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line.strip_prefix("alertname:") else {
            continue;
        };
        let name = name.trim().to_string();
        match (lines.get(i + 1).copied(), lines.get(i + 2).copied()) {
            (Some("exp_alerts: []"), _) => silent.insert(name),
            (Some("exp_alerts:"), Some(next)) if next.starts_with("- exp_labels:") => {
                fires.insert(name)
            }
            other => panic!("rules_test.yml: unexpected lines after `{line}`: {other:?}"),
        };
    }
    for alert in ALERTS {
        assert!(
            fires.contains(alert),
            "no rules_test.yml case where {alert} fires"
        );
        assert!(
            silent.contains(alert),
            "no rules_test.yml case where {alert} stays silent"
        );
    }
}

/// Each recording rule is named (in backticks) in docs/runbooks.md, where
/// the rules are documented, and a promtool unit test (either file)
/// evaluates it by name.
#[test]
fn every_recording_rule_is_documented_and_tested() {
    let records: Vec<String> = read("deploy/prometheus/rules.yml")
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record:"))
        .map(|n| n.trim().to_string())
        .collect();
    assert!(
        records.len() > 40,
        "recording rules in rules.yml: {records:?}"
    );
    let docs = read("docs/runbooks.md");
    let tests = read("deploy/prometheus/rules_test.yml")
        + &read("deploy/prometheus/accounting_rules_test.yml");
    let tested = |name: &str| {
        tests.lines().any(|l| {
            l.trim()
                .strip_prefix("- expr:")
                .or_else(|| l.trim().strip_prefix("expr:"))
                .is_some_and(|e| {
                    e.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                        .any(|tok| tok == name)
                })
        })
    };
    for name in &records {
        assert!(
            docs.contains(&format!("`{name}`")),
            "{name}: not in docs/runbooks.md"
        );
        assert!(tested(name), "{name}: no promtool test evaluates it");
    }
}

// ------------------------------------------------------------------ kubernetes

// ------------------------------------------------------------------ grafana

/// The `$variables` an expression uses.
fn variables(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        rest = &rest[i + 1..];
        let braced = rest.starts_with('{');
        let body = if braced { &rest[1..] } else { rest };
        let name: String = body
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

// ------------------------------------------------------------------ systemd

// ------------------------------------------------------------------ docker

#[test]
fn dockerfile_builds_a_nonroot_glibc_image() {
    let dockerfile = read("Dockerfile");
    let lines: Vec<&str> = dockerfile.lines().map(str::trim).collect();
    for want in [
        "FROM rust:1-bookworm AS build",
        "FROM gcr.io/distroless/cc-debian12:nonroot",
        "EXPOSE 9877",
        "ENTRYPOINT [\"/gpumem-exporter\"]",
    ] {
        assert!(lines.contains(&want), "Dockerfile: missing `{want}`");
    }
    assert!(dockerfile.contains("cargo build --release --locked -p gpumem-exporter"));
    assert!(
        lines.contains(&"USER 60877:60877"),
        "Dockerfile: USER 60877:60877 (the exporter's own uid, not distroless' shared 65532)"
    );
    // The image's OCI labels; its version is Cargo.toml's.
    for label in ["source", "version", "revision", "licenses"] {
        assert!(
            dockerfile.contains(&format!("org.opencontainers.image.{label}=")),
            "Dockerfile: label org.opencontainers.image.{label}"
        );
    }
    assert!(
        lines.contains(
            &format!("ARG GPUMEM_EXPORTER_VERSION={}", env!("CARGO_PKG_VERSION")).as_str()
        ),
        "Dockerfile: ARG GPUMEM_EXPORTER_VERSION={} (Cargo.toml's version)",
        env!("CARGO_PKG_VERSION")
    );
    let ignore = read(".dockerignore");
    let ignored: Vec<&str> = ignore.lines().map(str::trim).collect();
    for want in ["target/", ".dev/", ".git"] {
        assert!(ignored.contains(&want), ".dockerignore: {want}");
    }
}

/// The config files shipped for Kubernetes and systemd use only keys the
/// exporter knows: its own config loader reads them (it rejects unknown
/// keys, as the control case shows), each in the environment it is shipped
/// for.
#[test]
fn shipped_config_files_use_known_keys() {
    for (file, torch_bridge) in SHIPPED_CONFIGS {
        let config = shipped_config(file);
        assert_eq!(
            config.attribution.torch_bridge, torch_bridge,
            "{file}: processes.torch_bridge"
        );
        // Control: the same file with one key the exporter does not know.
        let scratch = tempfile::tempdir().expect("tempdir");
        let typo = write_in(
            &scratch,
            "config.yaml",
            &format!("{}gpumem_test_unknown_key: 1\n", read(file)),
        );
        let err = load_config(&typo, shipped_env(file))
            .expect_err("a config file with an unknown key is refused");
        assert!(
            err.contains("unknown field `gpumem_test_unknown_key`"),
            "{file} plus an unknown key: {err}"
        );
    }
}

/// The real exporter accepts the shipped config files: with a valid config
/// and no NVML library it stops with exit code 1 (NVML not loadable), while
/// a config error is exit code 2. Each file runs in the environment it is
/// shipped for: the DaemonSet's (in-cluster API variables, NODE_NAME from the
/// downward API) or a plain host's (none of those).
#[test]
fn exporter_accepts_the_shipped_config_files() {
    for (file, _) in SHIPPED_CONFIGS {
        let mut cmd = Command::new(BIN);
        for (key, _) in IN_CLUSTER {
            cmd.env_remove(key);
        }
        cmd.envs(shipped_env(file).iter().copied());
        let mut child = cmd
            .arg(format!("--config.file={}", repo_file(file).display()))
            .args([
                "--nvml.library=/nonexistent/libnvidia-ml.so.1",
                "--web.listen-address=127.0.0.1:0",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run gpumem-exporter");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while child.try_wait().expect("wait").is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{file}: gpumem-exporter did not exit within 30s without NVML");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().expect("collect output");
        assert_eq!(
            out.status.code(),
            Some(1),
            "{file}: expected exit 1 (NVML missing) after the config was accepted; stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn github_slug_of_headings() {
    assert_eq!(github_slug(" Alert: GpuMemoryHigh"), "alert-gpumemoryhigh");
    assert_eq!(
        github_slug("Real or cache? (PyTorch allocator)"),
        "real-or-cache-pytorch-allocator"
    );
    assert_eq!(github_slug("`top_n` and min-bytes"), "top_n-and-min-bytes");
    assert_eq!(github_slug("a  b"), "a--b");
    let md = "# Title\n\n```sh\n# not a heading\n```\n## Alert: GpuDown ##\n#nospace\n    # indented code\n## Title\n";
    assert_eq!(
        heading_anchors(md),
        ["alert-gpudown", "title", "title-1"]
            .map(String::from)
            .into()
    );
}

#[test]
fn dashboard_variables_are_found() {
    assert_eq!(
        variables("rate(x{instance=~\"$instance\"}[$__rate_interval]) ${gpu}"),
        ["__rate_interval", "gpu", "instance"]
            .map(String::from)
            .into()
    );
}

// ------------------------------------------------------------------ schemas

/// The folders ARCHITECTURE.md's code map names under `src/` and
/// `tests/e2e/`: each row's folder, and the subfolders its text names in
/// backticks (`utilization/`), relative to it.
fn code_map_folders(markdown: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let rows = markdown
        .lines()
        .filter(|l| l.starts_with("| `src/") || l.starts_with("| `tests/e2e/"));
    for line in rows {
        let cells: Vec<&str> = line.split(" | ").collect();
        let path = cells[0].trim_start_matches("| ").trim_matches('`');
        out.insert(path.trim_end_matches('/').to_string());
        let rest = cells[1..].join(" | ");
        for (i, tok) in rest.split('`').enumerate() {
            if i % 2 == 1 && tok.ends_with('/') && !tok.contains(' ') && !tok.contains('{') {
                out.insert(format!("{path}{}", tok.trim_end_matches('/')));
            }
        }
    }
    out
}

fn folders_under(dir: &Path, root: &Path, out: &mut BTreeSet<String>) {
    let rel = dir.strip_prefix(root).expect("under the repo");
    out.insert(rel.to_string_lossy().into_owned());
    for e in std::fs::read_dir(dir).expect("read a folder") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            folders_under(&p, root, out);
        }
    }
}

#[test]
fn the_code_map_names_every_folder() {
    let named = code_map_folders(&read("ARCHITECTURE.md"));
    let root = repo_file("");
    let mut present = BTreeSet::new();
    folders_under(&root.join("src"), &root, &mut present);
    folders_under(&root.join("tests/e2e"), &root, &mut present);
    let missing: Vec<_> = present.difference(&named).collect();
    let gone: Vec<_> = named.difference(&present).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "ARCHITECTURE.md's code map: folders not named {missing:?}; named but not folders of src/ or tests/e2e/ {gone:?}"
    );
    let size = read("ARCHITECTURE.md").len();
    assert!(
        size <= 12_288,
        "ARCHITECTURE.md is {size} bytes, over 12 KiB"
    );
}

/// The operator's pages stay what an operator does: the reasoning and the
/// runs behind them live in docs/evidence/, so these two stay under 20 KiB.
#[test]
fn deploying_and_security_stay_operator_pages() {
    for page in ["docs/deploying.md", "docs/security.md"] {
        let size = read(page).len();
        assert!(
            size <= 20_480,
            "{page} is {size} bytes, over 20 KiB: move reasoning and measurements to docs/evidence/"
        );
    }
}
