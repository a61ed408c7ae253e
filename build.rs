//! Stamps the git revision into the binary for gpumem_exporter_build_info,
//! and generates the kubelet pod-resources v1 gRPC client from
//! proto/podresources/v1/api.proto: protox parses the proto in pure Rust
//! (no protoc), tonic-prost-build writes the code. The exporter includes
//! the client only (`OUT_DIR/podres-client/v1.rs`); the end-to-end tests'
//! fake kubelet includes client and server (`OUT_DIR/podres-server/v1.rs`).

use std::path::PathBuf;

const PROTO: &str = "proto/podresources/v1/api.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    revision();
    println!("cargo:rerun-if-changed={PROTO}");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    for (dir, server) in [("podres-client", false), ("podres-server", true)] {
        let fds = protox::compile([PROTO], ["proto"])?;
        let dir = out.join(dir);
        std::fs::create_dir_all(&dir)?;
        tonic_prost_build::configure()
            .build_client(true)
            .build_server(server)
            .build_transport(false)
            .out_dir(&dir)
            .compile_fds(fds)?;
    }
    Ok(())
}

fn revision() {
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
