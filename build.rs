//! Stamps the git revision into the binary for gpumem_exporter_build_info.
fn main() {
    println!("cargo:rerun-if-env-changed=GPUMEM_EXPORTER_REVISION");
    // A build without .git (e.g. a container build) can pass the revision.
    if let Ok(rev) = std::env::var("GPUMEM_EXPORTER_REVISION")
        && !rev.trim().is_empty()
    {
        println!("cargo:rustc-env=GPUMEM_EXPORTER_REVISION={}", rev.trim());
        return;
    }
    let rev = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=GPUMEM_EXPORTER_REVISION={rev}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
}
