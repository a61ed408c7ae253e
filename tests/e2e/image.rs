//! The container image, built from the repository's Dockerfile and run as
//! the DaemonSet runs it.
//!
//! scripts/ci/build-image builds the image with buildah, pulling nothing:
//! the Dockerfile's runtime stage as written, its base
//! (gcr.io/distroless/cc-debian12:nonroot) assembled from Debian's
//! packages, its build stage stood in for by `--build-context build=DIR`
//! holding the binary built on the host by the stage's own cargo command.
//! The image is tagged with the DaemonSet's image reference and run by a
//! real Podman (runc, vfs; [`Podman`]) with the flags [`Spec::podman_args`]
//! derives from the DaemonSet that `kubectl kustomize deploy/kubernetes`
//! renders — the one source of what the container test runs. A field the
//! derivation does not know (a new securityContext setting, a volume
//! type, a probe kind) fails [`Spec::of`], so the manifest cannot move on
//! without the test running what it says.
//!
//! What stands in for the cluster, named in each flag's place:
//! - the NVIDIA container toolkit (runtimeClassName: nvidia): the fake NVML
//!   bind-mounted where the toolkit puts `libnvidia-ml.so.1` in a Debian
//!   image ([`TOOLKIT_NVML`]); the fake's scenario file and its variable
//!   are the only additions that are not the DaemonSet's;
//! - the kubelet: `KUBERNETES_SERVICE_HOST`/`_PORT` and the service
//!   account's token, CA and namespace at their fixed path, for the fake
//!   API server ([`FakeNode`]) that requires that token; `fieldRef:
//!   spec.nodeName` as [`cluster::NODE`]; the ConfigMap's files; hostPath
//!   volumes from this host, an empty directory for one this host lacks
//!   (the kubelet's pod-resources directory);
//! - the pod network: `--network host`, so the container port is the
//!   host's.
//!
//! The binary: `GPUMEM_IMAGE_BINARY` when set (scripts/ci/test builds it
//! with the Dockerfile's command before the tests), else build-image
//! builds it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::cluster::{self, FakeNode};
use crate::harness::podman::Podman;
use crate::harness::tools::{kustomize, require_tool};
use crate::harness::*;

/// Where the NVIDIA container toolkit mounts NVML in a Debian-based image:
/// the image's multiarch library directory, on the loader's default path.
const TOOLKIT_NVML: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
/// The same in the arm64 image.
const TOOLKIT_NVML_ARM64: &str = "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1";
/// qemu-user, mounted into the arm64 container as its entrypoint (this
/// host registers no binfmt handler, and the image stays as built).
const QEMU: &str = "/usr/bin/qemu-aarch64-static";
/// Where the kubelet mounts the service account (token, ca.crt, namespace).
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
const SA_TOKEN: &str = "image-e2e-service-account-token";
/// The fake NVML's scenario inside the container.
const SCENARIO_IN_CONTAINER: &str = "/fake-nvml/scenario.yaml";
/// The image's size budget: measured 35.0 MB (15.8 MB base + the release
/// binary), with room for the binary to grow; docs/deploying.md states it.
const SIZE_BUDGET_BYTES: u64 = 48_000_000;
const GPU: &str = "GPU-dddddddd-0000-0000-0000-000000000000";
const NAME: &str = "gpumem-exporter-image-e2e";

// ------------------------------------------------------------------ the DaemonSet

/// An environment variable of the container, as the manifest gives it.
#[derive(Debug, Clone, PartialEq)]
enum EnvValue {
    Value(String),
    /// `valueFrom.fieldRef.fieldPath: spec.nodeName`.
    NodeName,
}

/// Where a volume comes from.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// The rendered ConfigMap's files.
    ConfigMap(BTreeMap<String, String>),
    /// A host path, and its `type`.
    HostPath(String, String),
}

#[derive(Debug, Clone, PartialEq)]
struct Mount {
    volume: String,
    path: String,
    read_only: bool,
    source: Source,
}

#[derive(Debug, Clone, PartialEq)]
struct Probe {
    kind: &'static str,
    path: String,
    port: u16,
}

/// What the rendered DaemonSet says of how its one container runs.
#[derive(Debug, Clone)]
struct Spec {
    image: String,
    args: Vec<String>,
    runtime_class: String,
    host_pid: bool,
    user: u64,
    group: u64,
    read_only_root: bool,
    cap_drop: Vec<String>,
    cap_add: Vec<String>,
    no_new_privileges: bool,
    env: Vec<(String, EnvValue)>,
    port: u16,
    probes: Vec<Probe>,
    mounts: Vec<Mount>,
    memory_limit: String,
    cpu_limit: String,
}

/// Fails unless every key of `object` is one of `known`: a field the
/// container test would not run.
fn only_known(object: &Value, known: &[&str], at: &str) {
    let keys: Vec<&String> = object
        .as_object()
        .unwrap_or_else(|| panic!("{at}: not an object: {object}"))
        .keys()
        .collect();
    for k in keys {
        assert!(
            known.contains(&k.as_str()),
            "DaemonSet {at}.{k} is not run by the container test (tests/e2e/image.rs): teach Spec::of and Spec::podman_args what it means"
        );
    }
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("DaemonSet: no string at {pointer}"))
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|s| s.as_str().expect("a string").to_string())
        .collect()
}

impl Spec {
    /// The DaemonSet and ConfigMaps of a rendered kustomization.
    fn of(objects: &[Value]) -> Spec {
        let ds: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "DaemonSet")
            .collect();
        assert_eq!(ds.len(), 1, "one DaemonSet");
        let pod = &ds[0]["spec"]["template"]["spec"];
        only_known(
            pod,
            &[
                // Scheduling and identity: no part of how the container runs.
                "serviceAccountName",
                "priorityClassName",
                "affinity",
                "tolerations",
                // Run here.
                "runtimeClassName",
                "hostPID",
                "securityContext",
                "containers",
                "volumes",
            ],
            "spec.template.spec",
        );
        let pod_sc = &pod["securityContext"];
        only_known(
            pod_sc,
            &["runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"],
            "spec.template.spec.securityContext",
        );
        // Podman applies its default seccomp profile, the runtime's default.
        assert_eq!(
            pod_sc
                .pointer("/seccompProfile/type")
                .and_then(Value::as_str),
            Some("RuntimeDefault")
        );
        let containers = pod["containers"].as_array().expect("containers");
        assert_eq!(containers.len(), 1, "one container");
        let c = &containers[0];
        only_known(
            c,
            &[
                "name",
                "image",
                "args",
                "env",
                "ports",
                "livenessProbe",
                "readinessProbe",
                "resources",
                "securityContext",
                "volumeMounts",
            ],
            "containers[0]",
        );
        let sc = &c["securityContext"];
        only_known(
            sc,
            &[
                "runAsNonRoot",
                "runAsUser",
                "runAsGroup",
                "allowPrivilegeEscalation",
                "readOnlyRootFilesystem",
                "capabilities",
            ],
            "containers[0].securityContext",
        );
        if let Some(caps) = sc.get("capabilities") {
            only_known(
                caps,
                &["drop", "add"],
                "containers[0].securityContext.capabilities",
            );
        }
        let id = |key: &str| {
            sc.get(key)
                .or_else(|| pod_sc.get(key))
                .and_then(Value::as_u64)
                .unwrap_or_else(|| panic!("DaemonSet: no {key}"))
        };
        let (user, group) = (id("runAsUser"), id("runAsGroup"));
        let non_root = [sc, pod_sc]
            .iter()
            .any(|s| s["runAsNonRoot"].as_bool() == Some(true));
        assert!(!non_root || user != 0, "runAsNonRoot with runAsUser 0");

        let ports = c["ports"].as_array().expect("ports");
        assert_eq!(ports.len(), 1, "one container port");
        only_known(
            &ports[0],
            &["name", "containerPort", "protocol"],
            "ports[0]",
        );
        let port_name = str_at(&ports[0], "/name").to_string();
        let port = u16::try_from(ports[0]["containerPort"].as_u64().expect("containerPort"))
            .expect("a port");
        let resolve = |p: &Value| match p {
            Value::String(s) if *s == port_name => port,
            Value::Number(n) => u16::try_from(n.as_u64().expect("a port")).expect("a port"),
            other => panic!("probe port {other} is not the container's port"),
        };
        let mut probes = Vec::new();
        for (key, kind) in [
            ("livenessProbe", "liveness"),
            ("readinessProbe", "readiness"),
        ] {
            let p = &c[key];
            only_known(
                p,
                &[
                    "httpGet",
                    "initialDelaySeconds",
                    "periodSeconds",
                    "timeoutSeconds",
                    "failureThreshold",
                ],
                key,
            );
            only_known(&p["httpGet"], &["path", "port"], &format!("{key}.httpGet"));
            probes.push(Probe {
                kind,
                path: str_at(p, "/httpGet/path").to_string(),
                port: resolve(&p["httpGet"]["port"]),
            });
        }

        let mut env = Vec::new();
        for e in c["env"].as_array().into_iter().flatten() {
            only_known(e, &["name", "value", "valueFrom"], "env[]");
            let name = str_at(e, "/name").to_string();
            let value = match (e.get("value"), e.pointer("/valueFrom/fieldRef/fieldPath")) {
                (Some(v), None) => EnvValue::Value(v.as_str().expect("a string").to_string()),
                (None, Some(f)) if f == "spec.nodeName" => EnvValue::NodeName,
                other => panic!("env {name}: {other:?} is not run by the container test"),
            };
            env.push((name, value));
        }

        let config_maps: BTreeMap<&str, &Value> = objects
            .iter()
            .filter(|o| o["kind"] == "ConfigMap")
            .map(|o| (str_at(o, "/metadata/name"), &o["data"]))
            .collect();
        let volumes: BTreeMap<&str, &Value> = pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| (str_at(v, "/name"), v))
            .collect();
        let mut mounts = Vec::new();
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            only_known(m, &["name", "mountPath", "readOnly"], "volumeMounts[]");
            let volume = str_at(m, "/name").to_string();
            let v = volumes
                .get(volume.as_str())
                .unwrap_or_else(|| panic!("volumeMount {volume}: no such volume"));
            only_known(v, &["name", "configMap", "hostPath"], "volumes[]");
            let source = if let Some(cm) = v.get("configMap") {
                only_known(cm, &["name"], "volumes[].configMap");
                let name = str_at(cm, "/name");
                let data = config_maps
                    .get(name)
                    .unwrap_or_else(|| panic!("ConfigMap {name} is not rendered"))
                    .as_object()
                    .expect("ConfigMap data")
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().expect("a string").to_string()))
                    .collect();
                Source::ConfigMap(data)
            } else {
                let hp = &v["hostPath"];
                only_known(hp, &["path", "type"], "volumes[].hostPath");
                Source::HostPath(
                    str_at(hp, "/path").to_string(),
                    str_at(hp, "/type").to_string(),
                )
            };
            mounts.push(Mount {
                volume,
                path: str_at(m, "/mountPath").to_string(),
                read_only: m["readOnly"].as_bool().unwrap_or(false),
                source,
            });
        }
        let caps = |k: &str| strings(sc.pointer(&format!("/capabilities/{k}")));
        Spec {
            image: str_at(c, "/image").to_string(),
            args: strings(c.get("args")),
            runtime_class: pod["runtimeClassName"].as_str().unwrap_or("").to_string(),
            host_pid: pod["hostPID"].as_bool().unwrap_or(false),
            user,
            group,
            read_only_root: sc["readOnlyRootFilesystem"].as_bool().unwrap_or(false),
            cap_drop: caps("drop"),
            cap_add: caps("add"),
            no_new_privileges: sc["allowPrivilegeEscalation"].as_bool() == Some(false),
            env,
            port,
            probes,
            mounts,
            memory_limit: str_at(c, "/resources/limits/memory").to_string(),
            cpu_limit: str_at(c, "/resources/limits/cpu").to_string(),
        }
    }

    /// The `podman run` flags (before the image) that run the container as
    /// the DaemonSet does, on `node`; `nvml`: the library the toolkit would
    /// mount and where, or none. Volume sources are made under `dir`.
    fn podman_args(&self, node: &Node, nvml: Option<(&Path, &str)>, dir: &Path) -> Vec<String> {
        let mut a: Vec<String> = vec!["--network".into(), "host".into()];
        if self.host_pid {
            a.extend(["--pid".into(), "host".into()]);
        }
        a.push(format!("--user={}:{}", self.user, self.group));
        if self.read_only_root {
            // Kubernetes mounts no tmpfs of its own on a read-only root;
            // podman would (/tmp, /var/tmp, /run) without this.
            a.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
        }
        for c in &self.cap_drop {
            a.push(format!("--cap-drop={c}"));
        }
        for c in &self.cap_add {
            a.push(format!("--cap-add={c}"));
        }
        if self.no_new_privileges {
            a.push("--security-opt=no-new-privileges".into());
        }
        a.push(format!("--memory={}", podman_memory(&self.memory_limit)));
        a.push(format!("--cpus={}", podman_cpus(&self.cpu_limit)));
        for (k, v) in &self.env {
            let v = match v {
                EnvValue::Value(v) => v.clone(),
                EnvValue::NodeName => cluster::NODE.to_string(),
            };
            a.push(format!("--env={k}={v}"));
        }
        // The kubelet: the API service's variables and the service account.
        a.push("--env=KUBERNETES_SERVICE_HOST=127.0.0.1".into());
        a.push(format!("--env=KUBERNETES_SERVICE_PORT={}", node.api_port));
        a.push(format!(
            "--volume={}:{SERVICE_ACCOUNT}:ro",
            node.service_account.display()
        ));
        // The NVIDIA container toolkit (runtimeClassName: nvidia).
        assert_eq!(self.runtime_class, "nvidia", "runtimeClassName");
        if let Some((lib, at)) = nvml {
            a.push(format!("--volume={}:{at}:ro", lib.display()));
        }
        // The fake NVML's own input: not the DaemonSet's.
        a.push(format!(
            "--volume={}:{SCENARIO_IN_CONTAINER}:ro",
            node.scenario.display()
        ));
        a.push(format!("--env=FAKE_NVML_CONFIG={SCENARIO_IN_CONTAINER}"));
        for m in &self.mounts {
            let host = match &m.source {
                Source::ConfigMap(data) => {
                    let d = dir.join(format!("configmap-{}", m.volume));
                    std::fs::create_dir_all(&d).unwrap();
                    for (file, text) in data {
                        std::fs::write(d.join(file), text).unwrap();
                    }
                    d
                }
                Source::HostPath(path, kind) if Path::new(path).exists() => {
                    match kind.as_str() {
                        "File" => assert!(Path::new(path).is_file(), "{path}: type File"),
                        "Directory" => assert!(Path::new(path).is_dir(), "{path}: type Directory"),
                        other => panic!("hostPath type {other} is not run by the container test"),
                    }
                    PathBuf::from(path)
                }
                Source::HostPath(path, kind) => {
                    assert_eq!(kind, "Directory", "{path} is not on this host");
                    let d = dir.join(format!("hostpath-{}", m.volume));
                    std::fs::create_dir_all(&d).unwrap();
                    eprintln!(
                        "image e2e: hostPath {path} is not on this host: an empty directory stands in"
                    );
                    d
                }
            };
            let ro = if m.read_only { ":ro" } else { "" };
            a.push(format!("--volume={}:{}{ro}", host.display(), m.path));
        }
        a
    }

    /// Every mount point of the container: the DaemonSet's, the kubelet's
    /// and the toolkit's (when `nvml`), and the scenario.
    fn mount_points(&self, nvml: Option<&str>) -> BTreeSet<String> {
        let mut s: BTreeSet<String> = self.mounts.iter().map(|m| m.path.clone()).collect();
        s.insert(SERVICE_ACCOUNT.into());
        s.insert(SCENARIO_IN_CONTAINER.into());
        if let Some(at) = nvml {
            s.insert(at.into());
        }
        s
    }
}

/// `96Mi` → `96m` (podman's suffixes are binary).
fn podman_memory(limit: &str) -> String {
    let (n, unit) = limit.split_at(
        limit
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(limit.len()),
    );
    match unit {
        "Mi" => format!("{n}m"),
        "Gi" => format!("{n}g"),
        other => panic!("memory limit unit {other:?} is not run by the container test"),
    }
}

/// `100m` → `0.1`.
fn podman_cpus(limit: &str) -> String {
    match limit.strip_suffix('m') {
        Some(milli) => format!("{}", milli.parse::<f64>().expect("millicores") / 1000.0),
        None => limit.to_string(),
    }
}

// ------------------------------------------------------------------ the node

/// What stands in for the node: the fake API server (which requires the
/// service account's token), the service account's files, the fake NVML's
/// scenario with a real host process on the GPU.
struct Node {
    fake: FakeNode,
    api_port: u16,
    service_account: PathBuf,
    scenario: PathBuf,
    holder: Child,
    _dir: tempfile::TempDir,
}

impl Node {
    fn start() -> Node {
        let fake = FakeNode::start(Vec::new());
        fake.api.state.lock().unwrap().require = Some(cluster::Accept {
            tokens: vec![SA_TOKEN.into()],
            client_cert: None,
        });
        let dir = tempfile::tempdir().unwrap();
        let sa = dir.path().join("serviceaccount");
        std::fs::create_dir_all(&sa).unwrap();
        std::fs::write(sa.join("token"), SA_TOKEN).unwrap();
        std::fs::write(sa.join("ca.crt"), &fake.api.pki.ca_pem).unwrap();
        std::fs::write(sa.join("namespace"), "gpumem-exporter").unwrap();
        // A host process holding GPU memory: seen through hostPID.
        let holder = Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        let scenario = dir.path().join("scenario.yaml");
        std::fs::write(
            &scenario,
            format!(
                "devices:\n  - uuid: {GPU}\n    name: NVIDIA H200\n    memory: {{total: 150754820096, reserved: 644939776, used: 4943839232}}\n    processes:\n      - {{pid: {}, used: 4934598656}}\n",
                holder.id()
            ),
        )
        .unwrap();
        // Readable by the container's uid through the bind mounts.
        for p in [&sa, dir.path()] {
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        let api_port = fake.api.addr.port();
        Node {
            fake,
            api_port,
            service_account: sa,
            scenario,
            holder,
            _dir: dir,
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

// ------------------------------------------------------------------ the image

/// Builds the image into `podman`'s storage, tagged `tag`: a manifest list
/// of the host's image and the arm64 one (`arm64_binary`); its output.
fn build_image(podman: &Podman, tag: &str, arm64_binary: &Path) -> String {
    require_tool("buildah");
    let mut cmd = Command::new(repo_file("scripts/ci/build-image"));
    cmd.arg("--storage")
        .arg(podman.dir())
        .args(["--tag", tag])
        .arg("--arm64-binary")
        .arg(arm64_binary);
    if let Some(bin) = std::env::var_os("GPUMEM_IMAGE_BINARY").filter(|b| !b.is_empty()) {
        cmd.arg("--binary").arg(bin);
    }
    let t = Instant::now();
    let out = cmd
        .current_dir(repo())
        .stdin(Stdio::null())
        .output()
        .expect("run build-image");
    assert!(
        out.status.success(),
        "scripts/ci/build-image: {}",
        output_text(&out)
    );
    eprintln!(
        "image e2e: built in {:.1} s\n{}",
        t.elapsed().as_secs_f64(),
        output_text(&out)
    );
    output_text(&out)
}

fn inspect(podman: &Podman, what: &str, name: &str) -> Value {
    let json = podman.ok(&[what, "inspect", name]);
    let v: Value = serde_json::from_str(&json).expect("inspect JSON");
    v[0].clone()
}

/// The labels of `gpumem_exporter_build_info`.
fn build_info(m: &Metrics) -> BTreeMap<String, String> {
    let found = m.find("gpumem_exporter_build_info", &[]);
    assert_eq!(found.len(), 1, "{}", m.text);
    found[0].0.clone()
}

/// `field` of /proc/<pid>/status.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn get(port: u16, path: &str) -> Response {
    http_get(([127, 0, 0, 1], port).into(), path, &[])
}

#[test]
fn the_image_runs_as_the_daemonset_runs_it() {
    // buildah's build and the arm64 image under qemu-user load the cores
    // for minutes: one heavy test at a time.
    let _one = heavy();
    let started = Instant::now();
    let spec = Spec::of(&kustomize("deploy/kubernetes"));
    let podman = Podman::new();
    let arm64 = crate::arm64::arm64_build();
    build_image(&podman, &spec.image, &arm64.join("gpumem-exporter"));
    let amd64_image = format!("{}-amd64", spec.image);
    let list: Value = serde_json::from_str(&podman.ok(&["manifest", "inspect", &spec.image]))
        .expect("manifest JSON");
    let platforms: BTreeSet<String> = list["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            format!(
                "{}/{}",
                str_at(m, "/platform/os"),
                str_at(m, "/platform/architecture")
            )
        })
        .collect();
    assert_eq!(
        platforms,
        BTreeSet::from(["linux/amd64".to_string(), "linux/arm64".to_string()]),
        "{} is a two-architecture manifest list: {list}",
        spec.image
    );

    // ---- the image: user, entrypoint, labels, size, layers
    let image = inspect(&podman, "image", &spec.image);
    let config = &image["Config"];
    assert_eq!(config["User"], "60877:60877", "{config}");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/gpumem-exporter"])
    );
    assert!(
        config["ExposedPorts"]
            .as_object()
            .is_some_and(|p| p.contains_key(&format!("{}/tcp", spec.port))),
        "EXPOSE is the DaemonSet's containerPort {}: {config}",
        spec.port
    );
    let labels = &image["Labels"];
    for key in ["source", "version", "revision", "licenses"] {
        let v = labels[format!("org.opencontainers.image.{key}")]
            .as_str()
            .unwrap_or("");
        assert!(!v.is_empty() && v != "unknown", "label {key}: {labels}");
    }
    assert_eq!(
        labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
    let size = image["Size"].as_u64().expect("Size");
    assert!(
        size <= SIZE_BUDGET_BYTES,
        "image {size} bytes is over its budget of {SIZE_BUDGET_BYTES} (docs/deploying.md)"
    );
    eprintln!(
        "image e2e: podman image inspect: user {}, entrypoint {}, size {size} bytes ({:.1} MB), labels {labels}",
        config["User"],
        config["Entrypoint"],
        size as f64 / 1e6
    );
    eprintln!(
        "image e2e: manifest list {}: {platforms:?}; layers of the amd64 image:\n{}",
        spec.image,
        podman.ok(&["image", "tree", &amd64_image])
    );
    eprintln!("{}", podman.ok(&["history", &amd64_image]));

    // ---- the container, as the DaemonSet runs it
    let node = Node::start();
    let scratch = tempfile::tempdir().unwrap();
    let mut run = vec!["run".to_string(), "-d".into(), format!("--name={NAME}")];
    run.extend(spec.podman_args(&node, Some((fake_nvml(), TOOLKIT_NVML)), scratch.path()));
    run.push(spec.image.clone());
    run.extend(spec.args.iter().cloned());
    let run: Vec<&str> = run.iter().map(String::as_str).collect();
    eprintln!("image e2e: podman {}", run.join(" "));
    podman.ok(&run);

    let readiness = spec
        .probes
        .iter()
        .find(|p| p.kind == "readiness")
        .expect("readinessProbe");
    wait_for(
        Duration::from_secs(30),
        "/readyz 200 from the container",
        || {
            let listening = std::net::TcpStream::connect(("127.0.0.1", readiness.port)).is_ok();
            (listening && get(readiness.port, &readiness.path).status == 200).then_some(())
        },
    );
    for p in &spec.probes {
        let r = get(p.port, &p.path);
        assert_eq!(r.status, 200, "{} probe {}:{}", p.kind, p.port, p.path);
    }
    let page = get(spec.port, "/");
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .unwrap_or("")
            .starts_with("text/html"),
        "/"
    );

    // Sampled through the toolkit's library; the holder seen in the host's
    // /proc (hostPID) as the host's user (/host/etc/passwd); the pod
    // watcher in-cluster with the service account's token.
    let holder = node.holder.id().to_string();
    let m = wait_for(
        Duration::from_secs(20),
        "the holder named and the pods synced",
        || {
            let r = get(spec.port, "/metrics");
            let m = Metrics::parse(&r.body);
            let named = m
                .find("gpu_process_info", &[("pid", &holder)])
                .first()
                .is_some_and(|(l, _)| l.get("process").map(String::as_str) == Some("sleep"));
            (named && m.get("gpumem_exporter_kubernetes_synced", &[]) == Some(1.0)).then_some(m)
        },
    );
    assert_eq!(
        m.get("gpu_memory_used_bytes", &[("gpu", "0"), ("uuid", GPU)]),
        Some(4943839232.0)
    );
    let info = &m.find("gpu_process_info", &[("pid", &holder)])[0].0;
    assert_eq!(info["user"], "root", "{info:?}");
    let used = m.find("gpu_process_memory_used_bytes", &[("pid", &holder)]);
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].1, 4934598656.0);
    let amd64_gpu = crate::arm64::gpu_families(&get(spec.port, "/metrics").body);
    let bi = build_info(&m);
    assert_eq!(
        bi["version"],
        labels["org.opencontainers.image.version"].as_str().unwrap()
    );
    assert_eq!(
        bi["revision"],
        labels["org.opencontainers.image.revision"]
            .as_str()
            .unwrap()
    );
    {
        let state = node.fake.api.state.lock().unwrap();
        assert!(
            state.refused.is_empty(),
            "the API refused: {:?}",
            state.refused
        );
        assert!(!state.lists.is_empty(), "the pod watcher listed");
    }

    // ---- what the running container is: the DaemonSet's settings
    let ctr = inspect(&podman, "container", NAME);
    assert_eq!(ctr["ImageName"], spec.image.as_str(), "image reference");
    assert_eq!(
        ctr["Config"]["User"],
        format!("{}:{}", spec.user, spec.group)
    );
    assert_eq!(ctr["HostConfig"]["ReadonlyRootfs"], spec.read_only_root);
    let mounted: BTreeSet<String> = ctr["Mounts"]
        .as_array()
        .expect("Mounts")
        .iter()
        .map(|m| m["Destination"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        mounted,
        spec.mount_points(Some(TOOLKIT_NVML)),
        "mount points"
    );
    for m in &spec.mounts {
        let found = ctr["Mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["Destination"] == m.path.as_str())
            .unwrap();
        assert_eq!(
            found["RW"], !m.read_only,
            "{}: read-only {}",
            m.path, m.read_only
        );
    }
    let env: BTreeSet<String> = strings(ctr.pointer("/Config/Env")).into_iter().collect();
    for (k, v) in &spec.env {
        let v = match v {
            EnvValue::Value(v) => v.clone(),
            EnvValue::NodeName => cluster::NODE.into(),
        };
        assert!(env.contains(&format!("{k}={v}")), "env {k}={v}: {env:?}");
    }
    let pid: u32 = ctr["State"]["Pid"].as_u64().expect("a pid") as u32;
    let ids = format!("{0} {0} {0} {0}", spec.user);
    assert_eq!(status_field(pid, "Uid"), ids);
    assert_eq!(
        status_field(pid, "Gid"),
        format!("{0} {0} {0} {0}", spec.group)
    );
    if spec.cap_drop.iter().any(|c| c == "ALL") && spec.cap_add.is_empty() {
        for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(status_field(pid, set), "0000000000000000", "{set}");
        }
    }
    assert_eq!(
        status_field(pid, "NoNewPrivs"),
        if spec.no_new_privileges { "1" } else { "0" }
    );
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root = mountinfo
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .expect("the root mount");
    let root_ro = root
        .split_whitespace()
        .nth(5)
        .is_some_and(|o| o.split(',').any(|x| x == "ro"));
    assert_eq!(root_ro, spec.read_only_root, "{root}");

    // ---- SIGTERM: exit 0 within a second
    let t = Instant::now();
    podman.ok(&["kill", "--signal", "TERM", NAME]);
    let code = podman.ok(&["wait", NAME]);
    let stopped = t.elapsed();
    assert_eq!(code, "0", "exit status after SIGTERM");
    assert!(
        stopped < Duration::from_secs(1),
        "stopped {stopped:?} after SIGTERM"
    );
    let logs = output_text(&podman.run(&["logs", NAME]));
    for line in logs.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("log line is not JSON (log.format: json): {e}: {line}"));
        assert_ne!(v["level"], "ERROR", "{line}");
    }
    assert!(logs.contains("\"signal\":\"SIGTERM\""), "{logs}");
    podman.ok(&["rm", NAME]);

    // ---- no library mounted: one line naming it, a non-zero exit
    let mut run = vec!["run".to_string(), format!("--name={NAME}-nolib")];
    run.extend(spec.podman_args(&node, None, scratch.path()));
    run.push(spec.image.clone());
    run.extend(spec.args.iter().cloned());
    let run: Vec<&str> = run.iter().map(String::as_str).collect();
    let out = podman.run(&run);
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit status without the library: {}",
        output_text(&out)
    );
    let errors: Vec<String> = output_text(&out)
        .lines()
        .filter(|l| l.contains("\"level\":\"ERROR\""))
        .map(str::to_string)
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {}", output_text(&out));
    assert!(errors[0].contains(TOOLKIT_NVML), "{}", errors[0]);
    assert!(
        errors[0].contains("libnvidia-ml.so.1: cannot open shared object file"),
        "{}",
        errors[0]
    );

    // ---- the arm64 image of the list, run the same way under qemu-user:
    // the emulator mounted and made the entrypoint (no binfmt handler on
    // this host), the binary and its arguments after it.
    let name = format!("{NAME}-arm64");
    let arm64_lib = arm64.join("libfake_nvml.so");
    let mut run = vec![
        "run".to_string(),
        "-d".into(),
        format!("--name={name}"),
        "--arch=arm64".into(),
    ];
    run.extend(spec.podman_args(
        &node,
        Some((&arm64_lib, TOOLKIT_NVML_ARM64)),
        scratch.path(),
    ));
    run.push(format!("--volume={QEMU}:{QEMU}:ro"));
    run.push(format!("--entrypoint={QEMU}"));
    run.push(spec.image.clone());
    run.push("/gpumem-exporter".into());
    run.extend(spec.args.iter().cloned());
    let run: Vec<&str> = run.iter().map(String::as_str).collect();
    let t = Instant::now();
    podman.ok(&run);
    let arm = inspect(&podman, "container", &name);
    let arm_image = inspect(&podman, "image", str_at(&arm, "/Image"));
    assert_eq!(
        arm_image["Architecture"], "arm64",
        "the arm64 instance of the list"
    );
    wait_for(
        Duration::from_secs(60),
        "/readyz 200 from the arm64 container",
        || {
            let listening = std::net::TcpStream::connect(("127.0.0.1", readiness.port)).is_ok();
            (listening && get(readiness.port, &readiness.path).status == 200).then_some(())
        },
    );
    let arm_ready = t.elapsed();
    let arm_gpu = wait_for(Duration::from_secs(20), "the arm64 GPU families", || {
        let body = get(spec.port, "/metrics").body;
        let gpu = crate::arm64::gpu_families(&body);
        (gpu == amd64_gpu).then_some(gpu)
    });
    let t = Instant::now();
    podman.ok(&["kill", "--signal", "TERM", &name]);
    let code = podman.ok(&["wait", &name]);
    let arm_stopped = t.elapsed();
    assert_eq!(code, "0", "arm64 exit status after SIGTERM");

    eprintln!(
        "image e2e: /metrics, the probes and / answered; SIGTERM → exit 0 in {:.0} ms; without NVML: {}",
        stopped.as_secs_f64() * 1e3,
        errors[0],
    );
    eprintln!(
        "image e2e: arm64 image under qemu-user: ready {:.1} s after run, {} GPU-family lines equal to the amd64 container's, SIGTERM → exit 0 in {:.0} ms; total {:.1} s",
        arm_ready.as_secs_f64(),
        arm_gpu.lines().count(),
        arm_stopped.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
}

/// The derivation refuses what it would not run: a setting added to the
/// DaemonSet's securityContext, a volume of another type, a probe of
/// another kind each fail [`Spec::of`] with the field's name.
#[test]
fn a_daemonset_setting_the_container_test_does_not_run_fails_it() {
    let objects = kustomize("deploy/kubernetes");
    let ds = objects
        .iter()
        .position(|o| o["kind"] == "DaemonSet")
        .unwrap();
    // The rendered DaemonSet itself is accepted.
    let spec = Spec::of(&objects);
    assert_eq!(spec.image, "ghcr.io/gpumem-exporter/gpumem-exporter:0.1.0");
    assert_eq!((spec.user, spec.group, spec.port), (60877, 60877, 9877));
    let cases: [(&str, &str, Value); 4] = [
        (
            "/spec/template/spec/containers/0/securityContext",
            "privileged",
            Value::Bool(true),
        ),
        ("/spec/template/spec", "hostNetwork", Value::Bool(true)),
        (
            "/spec/template/spec/volumes/0",
            "emptyDir",
            serde_json::json!({}),
        ),
        (
            "/spec/template/spec/containers/0/livenessProbe",
            "exec",
            serde_json::json!({"command": ["true"]}),
        ),
    ];
    for (at, key, value) in cases {
        let mut changed = objects.clone();
        changed[ds]
            .pointer_mut(at)
            .and_then(Value::as_object_mut)
            .unwrap_or_else(|| panic!("{at}"))
            .insert(key.into(), value);
        let err = std::panic::catch_unwind(|| Spec::of(&changed))
            .expect_err("an unknown setting is refused");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains(&format!(".{key} is not run by the container test")),
            "{at}.{key}: {msg}"
        );
    }
}
