//! Bad input: every file in tests/config-corpus/*.yaml is a malformed
//! config; the binary must refuse it with exactly the one line in the
//! matching .err file (`{file}` stands for the path), exit code 2, and no
//! panic or backtrace. To add a case, add NN-name.yaml and NN-name.err.

use std::path::Path;
use std::process::Command;

use crate::harness::{BIN, repo_file};

fn run(config: &Path) -> (Option<i32>, String) {
    let out = Command::new(BIN)
        .args([
            "--config.file",
            config.to_str().unwrap(),
            "--nvml.library",
            "/nonexistent",
        ])
        .env_remove("NODE_NAME")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        // No kubeconfig either: not KUBECONFIG, not ~/.kube/config.
        .env_remove("KUBECONFIG")
        .env("HOME", "/nonexistent")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn every_malformed_config_gets_its_exact_error() {
    let dir = repo_file("tests/config-corpus");
    let mut cases: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    cases.sort();
    assert!(cases.len() >= 30, "the corpus has {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let want = std::fs::read_to_string(case.with_extension("err"))
            .unwrap_or_else(|_| panic!("{} has no .err file", case.display()))
            .replace("{file}", case.to_str().unwrap());
        let (code, err) = run(case);
        let name = case.file_name().unwrap().to_string_lossy();
        if code != Some(2) {
            failures.push(format!("{name}: exit {code:?}, want 2: {err}"));
        } else if err != want {
            failures.push(format!("{name}:\n  got  {err:?}\n  want {want:?}"));
        } else if err.contains("panicked") || err.contains("backtrace") || err.lines().count() != 1
        {
            failures.push(format!("{name}: not one clean line: {err}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// A config file larger than the 1 MiB limit is refused before parsing.
#[test]
fn huge_config_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.yaml");
    let line = "# padding padding padding padding padding padding padding padding\n";
    std::fs::write(&path, line.repeat((2 << 20) / line.len())).unwrap();
    let (code, err) = run(&path);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("is larger than the 1048576-byte limit"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1);
}

/// A path that is a directory, and one that does not exist.
#[test]
fn unreadable_config_paths() {
    let (code, err) = run(Path::new("/"));
    assert_eq!(code, Some(2));
    assert!(err.contains("config file /: not a regular file"), "{err}");
    let (code, err) = run(Path::new("/nonexistent/gpumem.yaml"));
    assert_eq!(code, Some(2));
    assert!(
        err.contains("/nonexistent/gpumem.yaml: cannot read"),
        "{err}"
    );
}
