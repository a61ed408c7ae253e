//! The operations artifacts checked by the tools that consume them:
//! promtool, kubectl (kustomize), systemd-analyze, sh and sed, node and the
//! manifest validators (`--features external-tools`).

use serde_json::Value;

use super::*;
use crate::harness::output_text;
use crate::harness::tools::{kustomize as render, run_tool, run_tool_ok};

const IMAGE: &str = "ghcr.io/gpumem-exporter/gpumem-exporter:0.1.0";
const NAMESPACE: &str = "gpumem-exporter";
/// Where links into this repository's files start; the rest of such a
/// link is the file's path and maybe `#anchor`.
const REPO_BLOB: &str = "https://github.com/gpumem-exporter/gpumem-exporter/blob/main/";
/// Where the torch bridge's socket lives, on the node and in the pods.
const TORCH_SOCKET_DIR: &str = "/run/gpumem-exporter";

fn kinds(objects: &[Value]) -> BTreeSet<String> {
    objects
        .iter()
        .filter_map(|o| o["kind"].as_str())
        .map(str::to_string)
        .collect()
}

fn only<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected exactly one {kind}, got {}",
        found.len()
    );
    found[0]
}

/// The items of an array; none when `value` is not one.
fn list(value: &Value) -> &[Value] {
    value.as_array().map_or(&[], Vec::as_slice)
}

/// The item of an array whose `key` is `value`.
fn find_by<'a>(items: &'a Value, key: &str, value: &str) -> Option<&'a Value> {
    list(items).iter().find(|i| i[key].as_str() == Some(value))
}

/// The strings of an array; none when there is no array.
fn strings(value: Option<&Value>) -> Vec<String> {
    value
        .map_or(&[][..], list)
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect()
}

/// The file and the anchor that a link into this repository names
/// (`REPO_BLOB` + path + `#anchor`), checked: the file exists in this
/// checkout and has a heading with that anchor.
fn resolve_repo_link(url: &str) -> (String, String) {
    let rest = url
        .strip_prefix(REPO_BLOB)
        .unwrap_or_else(|| panic!("{url} does not start with {REPO_BLOB}"));
    let (path, anchor) = rest
        .split_once('#')
        .unwrap_or_else(|| panic!("{url} names no #anchor"));
    assert!(
        !path.is_empty()
            && !path
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == ".."),
        "{url}: {path:?} is not a plain path of a file"
    );
    let text = std::fs::read_to_string(repo_file(path))
        .unwrap_or_else(|e| panic!("{url}: {path} is not a file of this repository: {e}"));
    let anchors = heading_anchors(&text);
    assert!(
        anchors.contains(anchor),
        "{url}: {path} has no heading whose anchor is #{anchor}; its anchors: {anchors:?}"
    );
    (path.to_string(), anchor.to_string())
}

/// A YAML file's tree, every key and value as written.
fn yaml_tree(file: &str) -> Value {
    serde_saphyr::from_str(&read(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

#[test]
fn promtool_accepts_the_rule_file() {
    let out = run_tool_ok(
        "promtool",
        &["check", "rules", "deploy/prometheus/rules.yml"],
        None,
    );
    assert!(out.contains("SUCCESS"), "promtool check rules: {out}");
}

/// Both unit-test files: rules_test.yml (every minute) and
/// accounting_rules_test.yml (every hour: promtool ignores a group's own
/// `interval:`, so the hourly tiles have a file at their interval).
#[test]
fn rule_unit_tests_pass() {
    let out = run_tool(
        "promtool",
        &[
            "test",
            "rules",
            "deploy/prometheus/rules_test.yml",
            "deploy/prometheus/accounting_rules_test.yml",
        ],
        None,
    );
    let text = output_text(&out);
    assert!(
        out.status.success() && text.contains("SUCCESS"),
        "promtool test rules failed:\n{text}"
    );
}

#[test]
fn prometheusrule_is_generated_from_rules_yml() {
    let generated = run_tool_ok("sh", &["scripts/gen/prometheus-rule"], None);
    let committed = read("deploy/kubernetes/base/prometheusrule.yaml");
    assert!(
        generated == committed,
        "deploy/kubernetes/base/prometheusrule.yaml is out of date with \
         deploy/prometheus/rules.yml; run\n    \
         scripts/gen/prometheus-rule > deploy/kubernetes/base/prometheusrule.yaml"
    );
    // The generator copies rules.yml from `groups:` on, indented under spec.
    let rules = read("deploy/prometheus/rules.yml");
    let groups = &rules[rules.find("\ngroups:").expect("rules.yml has groups:") + 1..];
    let indented: String = groups
        .lines()
        .map(|l| {
            if l.is_empty() {
                "\n".to_string()
            } else {
                format!("  {l}\n")
            }
        })
        .collect();
    assert!(
        committed.ends_with(&format!("spec:\n{indented}")),
        "spec.groups of the PrometheusRule is not rules.yml's groups"
    );
}

/// Severity, summary, description and a runbook_url: a link to a heading
/// `Alert: <name>` of a Markdown file of this repository, which must exist
/// in this checkout with that heading.
#[test]
fn every_alert_has_severity_annotations_and_a_runbook() {
    let rule = render("deploy/kubernetes/base")
        .into_iter()
        .find(|o| o["kind"].as_str() == Some("PrometheusRule"))
        .expect("the base renders a PrometheusRule");
    let groups = list(rule.pointer("/spec/groups").expect("spec.groups"));
    let names: Vec<&str> = groups.iter().filter_map(|g| g["name"].as_str()).collect();
    assert_eq!(
        names,
        [
            "gpumem-exporter",
            "gpumem-exporter-rollups",
            "gpumem-exporter-accounting-hourly",
            "gpumem-exporter-accounting"
        ],
        "the alerts, then the fleet rollups, then the accounting tiles and their sums"
    );
    for g in &groups[1..] {
        assert!(
            list(&g["rules"])
                .iter()
                .all(|r| r["record"].as_str().is_some() && r.get("alert").is_none()),
            "group {} only records",
            g["name"]
        );
    }
    // The tiles are hourly increases evaluated once an hour; everything
    // else runs at Prometheus's global interval.
    let intervals: Vec<Option<&str>> = groups.iter().map(|g| g["interval"].as_str()).collect();
    assert_eq!(intervals, [None, None, Some("1h"), None], "group intervals");
    let mut seen = Vec::new();
    for r in list(&groups[0]["rules"]) {
        let Some(alert) = r["alert"].as_str() else {
            assert!(
                r["record"].as_str().is_some(),
                "a rule that is neither alert nor record"
            );
            continue;
        };
        seen.push(alert.to_string());
        let severity = r["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("warning" | "critical")),
            "{alert}: severity {severity:?}"
        );
        for key in ["summary", "description"] {
            let text = r["annotations"][key].as_str();
            assert!(
                text.is_some_and(|t| !t.trim().is_empty()),
                "{alert}: no {key}"
            );
        }
        let url = r["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{alert}: no runbook_url"));
        assert!(
            url.starts_with(REPO_BLOB),
            "{alert}: runbook_url {url} is not a link into this repository ({REPO_BLOB}...)"
        );
        let (file, anchor) = resolve_repo_link(url);
        assert_eq!(
            anchor,
            github_slug(&format!("Alert: {alert}")),
            "{alert}: runbook_url {url} must link to the heading `Alert: {alert}` (in {file})"
        );
        assert!(
            r["expr"].as_str().is_some() && r["for"].as_str().is_some(),
            "{alert}: expr and for"
        );
    }
    assert_eq!(seen, ALERTS, "alerts in the PrometheusRule");
}

/// Which kustomization is rendered: the DaemonSet differs only in the
/// container's privileges and the config file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Non-root, no capabilities, `processes.torch_bridge: false`.
    Plain,
    /// overlays/torch-bridge: the base's non-root uid and no capability,
    /// the socket's host directory mounted, `processes.torch_bridge: true`.
    TorchBridge,
    /// overlays/pod-resources: uid 0 without any capability (for the
    /// kubelet's socket), the base's config.
    PodResources,
}

/// The DaemonSet checks shared by the base and the overlays.
fn check_daemonset(objects: &[Value], variant: Variant) {
    let ds = only(objects, "DaemonSet");
    let ctx = "DaemonSet";
    assert_eq!(ds["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert_eq!(
        ds["spec"]["updateStrategy"]["type"].as_str(),
        Some("RollingUpdate")
    );
    assert_eq!(
        ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"].as_u64(),
        Some(1),
        "{ctx}: maxUnavailable"
    );
    let pod = ds.pointer("/spec/template/spec").expect("pod spec");
    assert_eq!(pod["hostPID"].as_bool(), Some(true), "hostPID");
    assert_eq!(
        pod["priorityClassName"].as_str(),
        Some("system-node-critical")
    );
    assert_eq!(pod["runtimeClassName"].as_str(), Some("nvidia"));

    // GPU nodes only.
    let terms = pod
        .pointer("/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms")
        .expect("required node affinity");
    assert!(!list(terms).is_empty(), "node selector terms");
    assert!(
        list(terms)
            .iter()
            .all(|t| list(&t["matchExpressions"]).iter().any(|e| {
                e["key"].as_str() == Some("nvidia.com/gpu.present")
                    && e["operator"].as_str() == Some("In")
                    && strings(e.get("values")) == ["true"]
            })),
        "every node selector term requires nvidia.com/gpu.present=true"
    );
    assert!(
        list(&pod["tolerations"])
            .iter()
            .any(|t| t["key"].as_str() == Some("nvidia.com/gpu")
                && t["operator"].as_str() == Some("Exists")
                && t.get("effect").is_none()),
        "toleration for the nvidia.com/gpu taint (Exists, any effect)"
    );

    // Non-root, locked down.
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let uid = pod["securityContext"]["runAsUser"].as_u64();
    assert!(
        uid.is_some_and(|u| u > 0),
        "fixed non-zero runAsUser, got {uid:?}"
    );
    // Not a uid other images share (distroless nonroot, nobody), nor one
    // of the host's regular users: the exporter's own.
    assert_eq!(uid, Some(60877), "the exporter's own uid");
    assert_eq!(
        pod["securityContext"]["runAsGroup"].as_u64(),
        Some(60877),
        "the exporter's own gid"
    );
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"].as_str(),
        Some("RuntimeDefault")
    );
    let containers = list(&pod["containers"]);
    assert_eq!(containers.len(), 1, "one container");
    let c = &containers[0];
    assert_eq!(c["image"].as_str(), Some(IMAGE));
    let sc = c.get("securityContext").expect("container securityContext");
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(strings(sc.pointer("/capabilities/drop")), ["ALL"]);
    assert_ne!(sc["privileged"].as_bool(), Some(true));
    match variant {
        Variant::Plain => {
            assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true));
            assert!(sc.get("runAsUser").is_none(), "the pod's uid (non-root)");
            assert!(
                sc.pointer("/capabilities/add").is_none(),
                "no added capabilities"
            );
        }
        Variant::TorchBridge => {
            // The same as the base: the socket needs no privilege.
            assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true));
            assert!(sc.get("runAsUser").is_none(), "the pod's uid (non-root)");
            assert!(
                sc.pointer("/capabilities/add").is_none(),
                "no added capabilities"
            );
            let mount = find_by(&c["volumeMounts"], "mountPath", TORCH_SOCKET_DIR)
                .expect("the bridge socket's directory is mounted");
            assert_ne!(
                mount["readOnly"].as_bool(),
                Some(true),
                "the exporter makes the socket"
            );
            let volume = find_by(&pod["volumes"], "name", mount["name"].as_str().unwrap())
                .expect("the socket's volume");
            assert_eq!(volume["hostPath"]["path"].as_str(), Some(TORCH_SOCKET_DIR));
            assert_eq!(
                volume["hostPath"]["type"].as_str(),
                Some("Directory"),
                "made on the node, owned by the exporter's uid (never by the kubelet as root)"
            );
        }
        Variant::PodResources => {
            assert_eq!(sc["runAsUser"].as_u64(), Some(0));
            assert_eq!(sc["runAsNonRoot"].as_bool(), Some(false));
            assert!(
                sc.pointer("/capabilities/add").is_none(),
                "uid 0 without added capabilities"
            );
        }
    }

    // The port named metrics is the exporter's default, and the probes use it.
    let ports = list(&c["ports"]);
    assert!(
        ports
            .iter()
            .any(|p| p["name"].as_str() == Some("metrics")
                && p["containerPort"].as_u64() == Some(9877)),
        "containerPort 9877 named metrics"
    );
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(c[probe]["httpGet"]["path"].as_str(), Some(path));
        assert_eq!(
            c[probe]["httpGet"]["port"].as_str(),
            Some("metrics"),
            "{probe} uses the port by name"
        );
    }

    // Environment.
    let env = |name: &str| find_by(&c["env"], "name", name);
    let node = env("NODE_NAME").expect("NODE_NAME env");
    assert_eq!(
        node["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("spec.nodeName"),
        "NODE_NAME from the downward API"
    );
    for (name, want) in [
        ("NVIDIA_VISIBLE_DEVICES", "all"),
        ("NVIDIA_DRIVER_CAPABILITIES", "utility"),
    ] {
        assert_eq!(
            env(name).and_then(|e| e["value"].as_str()),
            Some(want),
            "{name}"
        );
    }

    // Resources, as sized from the benchmark.
    for (path, want) in [
        ("/resources/requests/cpu", "10m"),
        ("/resources/requests/memory", "32Mi"),
        ("/resources/limits/cpu", "100m"),
        ("/resources/limits/memory", "160Mi"),
    ] {
        assert_eq!(
            c.pointer(path).and_then(Value::as_str),
            Some(want),
            "{path}"
        );
    }

    // Config from the generated ConfigMap, passed with --config.file.
    assert!(
        strings(c.get("args"))
            .contains(&"--config.file=/etc/gpumem-exporter/config.yaml".to_string()),
        "--config.file in args"
    );
    let mount = |path: &str| {
        find_by(&c["volumeMounts"], "mountPath", path)
            .unwrap_or_else(|| panic!("no volumeMount at {path}"))
    };
    let volume = |name: &str| {
        find_by(&pod["volumes"], "name", name).unwrap_or_else(|| panic!("no volume {name}"))
    };
    let config_mount = mount("/etc/gpumem-exporter");
    let config_volume = volume(config_mount["name"].as_str().unwrap());
    let cm_name = config_volume["configMap"]["name"]
        .as_str()
        .expect("configMap volume");
    let cm = objects
        .iter()
        .find(|o| {
            o["kind"].as_str() == Some("ConfigMap")
                && o["metadata"]["name"].as_str() == Some(cm_name)
        })
        .unwrap_or_else(|| panic!("ConfigMap {cm_name} is not rendered"));
    assert!(
        cm_name.starts_with("gpumem-exporter-config-"),
        "generated (hashed) name: {cm_name}"
    );
    let config = cm["data"]["config.yaml"].as_str().expect("config.yaml key");
    let (file, torch_bridge) = match variant {
        Variant::Plain | Variant::PodResources => ("deploy/kubernetes/base/config.yaml", false),
        Variant::TorchBridge => ("deploy/kubernetes/overlays/torch-bridge/config.yaml", true),
    };
    assert_eq!(config, read(file));
    assert_eq!(
        shipped_config(file).attribution.torch_bridge,
        torch_bridge,
        "processes.torch_bridge in the rendered config"
    );

    // The kubelet's pod-resources directory, read-only, and the config's
    // socket inside it.
    let podres = mount("/var/lib/kubelet/pod-resources");
    assert_eq!(
        podres["readOnly"].as_bool(),
        Some(true),
        "pod-resources read-only"
    );
    let podres_volume = volume(podres["name"].as_str().unwrap());
    assert_eq!(
        podres_volume["hostPath"]["path"].as_str(),
        Some("/var/lib/kubelet/pod-resources")
    );
    assert_eq!(
        podres_volume["hostPath"]["type"].as_str(),
        Some("Directory")
    );
    let socket = shipped_config(file)
        .pod_resources
        .expect("the pod-resources client is on")
        .socket;
    assert_eq!(
        socket,
        Path::new("/var/lib/kubelet/pod-resources/kubelet.sock"),
        "{file}: kubernetes.pod_resources_socket"
    );

    let passwd = mount("/host/etc/passwd");
    assert_eq!(passwd["readOnly"].as_bool(), Some(true));
    assert_eq!(
        volume(passwd["name"].as_str().unwrap())["hostPath"]["path"].as_str(),
        Some("/etc/passwd")
    );

    // Identity.
    let sa = pod["serviceAccountName"]
        .as_str()
        .expect("serviceAccountName");
    let account = only(objects, "ServiceAccount");
    assert_eq!(account["metadata"]["name"].as_str(), Some(sa));
    assert_eq!(account["metadata"]["namespace"].as_str(), Some(NAMESPACE));

    // RBAC: get/list/watch on pods and on ResourceSlices (DRA), get on
    // ResourceClaims (their consumed memory), nothing else.
    assert!(!kinds(objects).contains("Role") && !kinds(objects).contains("RoleBinding"));
    let role = only(objects, "ClusterRole");
    let rules = list(&role["rules"]);
    assert_eq!(rules.len(), 3, "three RBAC rules");
    let watch: &[&str] = &["get", "list", "watch"];
    for (rule, (group, resource, verbs)) in rules.iter().zip([
        ("", "pods", watch),
        ("resource.k8s.io", "resourceslices", watch),
        ("resource.k8s.io", "resourceclaims", &["get"][..]),
    ]) {
        assert_eq!(strings(rule.get("apiGroups")), [group]);
        assert_eq!(strings(rule.get("resources")), [resource]);
        assert_eq!(strings(rule.get("verbs")), verbs);
        assert!(rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none());
    }
    let binding = only(objects, "ClusterRoleBinding");
    assert_eq!(binding["roleRef"]["kind"].as_str(), Some("ClusterRole"));
    let role_name = role["metadata"]["name"].as_str().expect("ClusterRole name");
    assert_eq!(binding["roleRef"]["name"].as_str(), Some(role_name));
    let subjects = list(&binding["subjects"]);
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0]["kind"].as_str(), Some("ServiceAccount"));
    assert_eq!(subjects[0]["name"].as_str(), Some(sa));
    assert_eq!(subjects[0]["namespace"].as_str(), Some(NAMESPACE));

    // Headless Service with the named port.
    let svc = only(objects, "Service");
    assert_eq!(svc["spec"]["clusterIP"].as_str(), Some("None"));
    let port = &list(&svc["spec"]["ports"])[0];
    assert_eq!(port["name"].as_str(), Some("metrics"));
    assert_eq!(port["port"].as_u64(), Some(9877));
    assert_eq!(port["targetPort"].as_str(), Some("metrics"));
    let labels = ds
        .pointer("/spec/template/metadata/labels")
        .expect("pod labels");
    let selector = svc
        .pointer("/spec/selector")
        .and_then(Value::as_object)
        .expect("selector");
    assert!(!selector.is_empty(), "the Service selects pods by label");
    for (k, v) in selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "Service selector {k} matches the pods"
        );
    }

    // Everything namespaced lives in the gpumem-exporter namespace.
    for o in objects {
        let kind = o["kind"].as_str().unwrap_or("?");
        if !matches!(kind, "Namespace" | "ClusterRole" | "ClusterRoleBinding") {
            assert_eq!(
                o["metadata"]["namespace"].as_str(),
                Some(NAMESPACE),
                "{kind}"
            );
        }
    }
}

/// The NetworkPolicy covers the exporter's pods, both ways: in, only pods
/// labelled as Prometheus and only on the metrics port; out, only the API
/// server's ports and DNS to the cluster's resolver.
fn check_network_policy(objects: &[Value]) {
    let np = only(objects, "NetworkPolicy");
    let ds = only(objects, "DaemonSet");
    let pod_labels = ds
        .pointer("/spec/template/metadata/labels")
        .and_then(Value::as_object)
        .expect("pod labels");
    let selects = np
        .pointer("/spec/podSelector/matchLabels")
        .and_then(Value::as_object)
        .expect("podSelector.matchLabels");
    assert!(!selects.is_empty(), "the policy selects by label");
    for (k, v) in selects {
        assert_eq!(
            pod_labels.get(k),
            Some(v),
            "podSelector {k} matches the pods"
        );
    }
    assert_eq!(
        strings(np.pointer("/spec/policyTypes")),
        ["Ingress", "Egress"],
        "both directions are restricted"
    );
    let ingress = list(&np["spec"]["ingress"]);
    assert_eq!(ingress.len(), 1, "one ingress rule");
    let from = list(&ingress[0]["from"]);
    assert!(!from.is_empty(), "ingress names who may come in");
    for peer in from {
        assert!(
            peer.pointer("/podSelector/matchLabels").is_some() && peer.get("ipBlock").is_none(),
            "ingress from selected pods only: {peer}"
        );
    }
    let ports = list(&ingress[0]["ports"]);
    let container_ports = list(
        &ds.pointer("/spec/template/spec/containers/0/ports")
            .cloned()
            .unwrap_or(Value::Null),
    )
    .to_vec();
    assert_eq!(ports.len(), 1, "one port in");
    assert_eq!(ports[0]["port"].as_str(), Some("metrics"));
    assert!(
        container_ports
            .iter()
            .any(|p| p["name"].as_str() == Some("metrics") && p["containerPort"] == 9877),
        "the metrics port is the container's 9877"
    );
    let mut out_ports: Vec<(u64, String)> = list(&np["spec"]["egress"])
        .iter()
        .flat_map(|r| list(&r["ports"]).to_vec())
        .map(|p| {
            (
                p["port"].as_u64().expect("numeric egress port"),
                p["protocol"].as_str().unwrap_or("TCP").to_string(),
            )
        })
        .collect();
    out_ports.sort();
    let want: Vec<(u64, String)> = [(53, "TCP"), (53, "UDP"), (443, "TCP"), (6443, "TCP")]
        .map(|(p, s)| (p, s.to_string()))
        .to_vec();
    assert_eq!(out_ports, want, "out: the API server and DNS only");
    for rule in list(&np["spec"]["egress"]) {
        assert!(
            !list(&rule["ports"]).is_empty(),
            "every egress rule names its ports"
        );
    }
}

#[test]
fn kustomize_base_renders_a_locked_down_daemonset() {
    let objects = render("deploy/kubernetes");
    let want: BTreeSet<String> = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Service",
        "DaemonSet",
        "NetworkPolicy",
        "ServiceMonitor",
        "PrometheusRule",
    ]
    .map(String::from)
    .into();
    assert_eq!(kinds(&objects), want);
    check_daemonset(&objects, Variant::Plain);
    check_network_policy(&objects);

    let sm = only(&objects, "ServiceMonitor");
    let endpoints = list(&sm["spec"]["endpoints"]);
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0]["port"].as_str(), Some("metrics"));
    assert_eq!(endpoints[0]["path"].as_str(), Some("/metrics"));
    let relabel = list(&endpoints[0]["relabelings"]);
    assert!(
        relabel.iter().any(|r| strings(r.get("sourceLabels"))
            == ["__meta_kubernetes_pod_node_name"]
            && r["targetLabel"].as_str() == Some("node")),
        "ServiceMonitor relabels the pod's node name to `node`"
    );
    let dropped = relabel
        .iter()
        .find(|r| r["action"].as_str() == Some("labeldrop"))
        .and_then(|r| r["regex"].as_str())
        .expect("labeldrop of the operator's target labels");
    for label in ["namespace", "pod", "container"] {
        assert!(
            dropped.split('|').any(|l| l == label),
            "target label {label} would clash with the exporter's process label"
        );
    }
    let svc = only(&objects, "Service");
    let match_labels = sm
        .pointer("/spec/selector/matchLabels")
        .and_then(Value::as_object)
        .expect("matchLabels");
    assert!(
        !match_labels.is_empty(),
        "the ServiceMonitor selects by label"
    );
    for (k, v) in match_labels {
        assert_eq!(
            svc.pointer("/metadata/labels").and_then(|l| l.get(k)),
            Some(v),
            "ServiceMonitor selects the Service"
        );
    }
}

#[test]
fn plain_annotations_overlay_swaps_operator_objects_for_annotations() {
    let objects = render("deploy/kubernetes/overlays/plain-annotations");
    let kinds = kinds(&objects);
    assert!(
        !kinds.contains("ServiceMonitor") && !kinds.contains("PrometheusRule"),
        "{kinds:?}"
    );
    check_daemonset(&objects, Variant::Plain);
    check_network_policy(&objects);
    let ds = only(&objects, "DaemonSet");
    let ann = ds
        .pointer("/spec/template/metadata/annotations")
        .expect("pod annotations");
    assert_eq!(ann["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(ann["prometheus.io/port"].as_str(), Some("9877"));
    assert_eq!(ann["prometheus.io/path"].as_str(), Some("/metrics"));
}

/// overlays/torch-bridge: the base, with no capability and the base's
/// non-root uid (checked in `check_daemonset`), the node's
/// /run/gpumem-exporter mounted for the bridge socket, and the config file
/// replaced by one that differs from the base's only in
/// `processes.torch_bridge: true` and the socket's path, which is in that
/// directory. The node's tmpfiles line makes the directory owned by the
/// DaemonSet's uid; the example training pod mounts it read-only, with no
/// privilege.
#[test]
fn torch_bridge_overlay_grants_no_capability() {
    let base = render("deploy/kubernetes");
    let objects = render("deploy/kubernetes/overlays/torch-bridge");
    assert_eq!(kinds(&objects), kinds(&base), "same kinds as the base");
    check_daemonset(&objects, Variant::TorchBridge);
    assert_eq!(
        objects
            .iter()
            .filter(|o| o["kind"].as_str() == Some("ConfigMap"))
            .count(),
        1,
        "the overlay's config replaces the base's (behavior: replace)"
    );
    // Nothing else changes: every other object is the base's.
    let others: Vec<&Value> = base
        .iter()
        .filter(|o| !matches!(o["kind"].as_str(), Some("DaemonSet" | "ConfigMap")))
        .collect();
    assert!(
        !others.is_empty(),
        "the base renders more than the DaemonSet"
    );
    for o in others {
        assert!(
            objects.contains(o),
            "{} {:?} differs from the base's",
            o["kind"].as_str().unwrap_or("?"),
            o["metadata"]["name"].as_str()
        );
    }
    // The two config files stay in step: the same keys and values but one,
    // as written and as the exporter reads them.
    let base = "deploy/kubernetes/base/config.yaml";
    let overlay = "deploy/kubernetes/overlays/torch-bridge/config.yaml";
    let without_torch_bridge = |file: &str| {
        let mut tree = yaml_tree(file);
        let processes = tree["processes"].as_object_mut().expect("processes:");
        assert!(
            processes.remove("torch_bridge").is_some(),
            "{file}: processes.torch_bridge is set"
        );
        processes.remove("torch_bridge_socket");
        tree
    };
    assert_eq!(
        without_torch_bridge(overlay),
        without_torch_bridge(base),
        "overlays/torch-bridge/config.yaml must equal base/config.yaml except processes.torch_bridge and torch_bridge_socket"
    );
    let mut read_as = shipped_config(overlay);
    let socket = read_as.attribution.torch_bridge_socket.clone();
    assert_eq!(
        socket.as_deref().and_then(|p| p.parent()),
        Some(Path::new(TORCH_SOCKET_DIR)),
        "the socket is in the mounted directory"
    );
    read_as.attribution.torch_bridge = false;
    read_as.attribution.torch_bridge_socket = shipped_config(base).attribution.torch_bridge_socket;
    assert_eq!(
        read_as,
        shipped_config(base),
        "the exporter reads the overlay's config as the base's, the torch bridge aside"
    );

    // The node's directory: owned by the DaemonSet's uid and gid, 0755.
    let ds = only(&objects, "DaemonSet");
    let pod_sc = &ds["spec"]["template"]["spec"]["securityContext"];
    let (uid, gid) = (pod_sc["runAsUser"].as_u64(), pod_sc["runAsGroup"].as_u64());
    let tmpfiles = read("deploy/kubernetes/overlays/torch-bridge/tmpfiles.conf");
    let lines: Vec<Vec<&str>> = tmpfiles
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 1, "one tmpfiles line: {lines:?}");
    let line = &lines[0];
    assert_eq!(&line[..3], ["d", TORCH_SOCKET_DIR, "0755"], "{line:?}");
    assert_eq!(
        line[3].parse::<u64>().ok(),
        uid,
        "tmpfiles owner = runAsUser"
    );
    assert_eq!(
        line[4].parse::<u64>().ok(),
        gid,
        "tmpfiles group = runAsGroup"
    );

    // The example training pod: the directory read-only, no privilege.
    let example = yaml_tree("deploy/kubernetes/overlays/torch-bridge/training-pod.yaml");
    let spec = &example["spec"];
    assert_ne!(spec["hostPID"].as_bool(), Some(true));
    let c = &list(&spec["containers"])[0];
    let mount = find_by(&c["volumeMounts"], "mountPath", TORCH_SOCKET_DIR).expect("mounted");
    assert_eq!(mount["readOnly"].as_bool(), Some(true));
    assert_eq!(
        strings(c.pointer("/securityContext/capabilities/drop")),
        ["ALL"]
    );
    assert!(c.pointer("/securityContext/capabilities/add").is_none());
    assert_eq!(
        c["securityContext"]["allowPrivilegeEscalation"].as_bool(),
        Some(false)
    );
    let volume = find_by(&spec["volumes"], "name", mount["name"].as_str().unwrap()).unwrap();
    assert_eq!(volume["hostPath"]["path"].as_str(), Some(TORCH_SOCKET_DIR));
}

/// overlays/pod-resources: the base, with the container as uid 0 and no
/// capability at all (checked in `check_daemonset`); nothing else changes.
#[test]
fn pod_resources_overlay_runs_as_uid_0_without_capabilities() {
    let base = render("deploy/kubernetes");
    let objects = render("deploy/kubernetes/overlays/pod-resources");
    assert_eq!(kinds(&objects), kinds(&base), "same kinds as the base");
    check_daemonset(&objects, Variant::PodResources);
    for o in base
        .iter()
        .filter(|o| o["kind"].as_str() != Some("DaemonSet"))
    {
        assert!(
            objects.contains(o),
            "{} {:?} differs from the base's",
            o["kind"].as_str().unwrap_or("?"),
            o["metadata"]["name"].as_str()
        );
    }
}

#[test]
fn grafana_dashboard_is_valid_and_complete() {
    let text = read("grafana/gpumem-exporter.json");
    let dash: Value = serde_json::from_str(&text).expect("one JSON document");
    assert!(
        dash["schemaVersion"].as_u64().is_some_and(|v| v >= 39),
        "schemaVersion >= 39"
    );

    let var = |name: &str| {
        find_by(&dash["templating"]["list"], "name", name)
            .unwrap_or_else(|| panic!("no template variable {name}"))
    };
    assert_eq!(var("datasource")["type"].as_str(), Some("datasource"));
    assert_eq!(var("datasource")["query"].as_str(), Some("prometheus"));
    for (name, query) in [
        ("instance", "label_values(gpu_info, instance)"),
        (
            "gpu",
            "label_values(gpu_info{instance=~\"$instance\"}, gpu)",
        ),
    ] {
        assert_eq!(var(name)["definition"].as_str(), Some(query), "${name}");
    }
    for name in ["instance", "gpu", "namespace", "pod", "slurm_job"] {
        let v = var(name);
        assert_eq!(v["type"].as_str(), Some("query"));
        assert_eq!(v["multi"].as_bool(), Some(true), "${name} multi");
        assert_eq!(v["includeAll"].as_bool(), Some(true), "${name} all");
    }
    for name in ["namespace", "pod", "slurm_job"] {
        assert!(
            var(name)["definition"]
                .as_str()
                .is_some_and(|d| d.contains("gpu_process_memory_used_bytes")),
            "${name} from gpu_process_memory_used_bytes"
        );
    }

    let allowed: BTreeSet<String> = [
        "instance",
        "gpu",
        "namespace",
        "pod",
        "slurm_job",
        "__rate_interval",
    ]
    .map(String::from)
    .into();
    let mut ids = BTreeSet::new();
    let mut exprs = Vec::new();
    let panels = list(&dash["panels"]);
    assert!(!panels.is_empty(), "the dashboard has panels");
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("?").to_string();
        let id = panel["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        assert!(panel.get("gridPos").is_some(), "{title}: gridPos");
        let kind = panel["type"].as_str().unwrap_or("?");
        if kind == "row" {
            continue;
        }
        assert!(
            matches!(kind, "timeseries" | "table" | "stat"),
            "{title}: panel type {kind}"
        );
        let unit = panel["fieldConfig"]["defaults"]["unit"].as_str();
        assert!(unit.is_some_and(|u| !u.is_empty()), "{title}: no unit");
        assert_eq!(
            panel["datasource"]["uid"].as_str(),
            Some("${datasource}"),
            "{title}"
        );
        let targets = list(&panel["targets"]);
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("{title}: target without expr"));
            let used = variables(expr);
            assert!(
                used.is_subset(&allowed),
                "{title}: variables {used:?} in {expr}"
            );
            exprs.push((title.clone(), expr.to_string()));
        }
    }

    // Every metric of the exporter is on the dashboard.
    for metric in [
        "gpu_info",
        "gpu_memory_total_bytes",
        "gpu_memory_used_bytes",
        "gpu_memory_free_bytes",
        "gpu_memory_reserved_bytes",
        "gpu_up",
        "gpu_process_memory_used_bytes",
        "gpu_process_info",
        "gpu_memory_used_peak_bytes",
        "gpu_process_memory_used_peak_bytes",
        "gpu_driver_info",
        "gpumem_exporter_build_info",
        "gpumem_exporter_sample_duration_seconds_bucket",
        "gpumem_exporter_last_sample_timestamp_seconds",
        "gpumem_exporter_nvml_errors_total",
        "gpu_process_torch_allocated_bytes",
        "gpu_process_torch_reserved_bytes",
        "gpu_process_torch_alloc_retries_total",
        "gpu_process_torch_ooms_total",
        "gpumem_exporter_torch_reports_dropped_total",
        "gpu_allocation_info",
        "gpumem_exporter_slurm_job_mapping_errors_total",
        "gpu_memory_stale_bytes",
        "gpu_process_stale_info",
        "gpu_memory_unattributed_bytes",
        "gpu_mig_memory_unattributed_bytes",
        "gpu_memory_idle_held_bytes",
        "gpu_process_idle_seconds",
        "gpu_workload_memory_idle_byte_seconds_total",
        "gpu_workload_memory_limit_bytes",
        "gpu_workload_memory_used_bytes",
        "gpumem_exporter_limit_sources",
    ] {
        assert!(
            exprs
                .iter()
                .any(|(_, e)| e.contains(&format!("{metric}{{"))),
            "no panel queries {metric}"
        );
    }

    // Every expression is valid PromQL once Grafana substituted the
    // variables: promtool parses them as recording rules.
    assert!(!exprs.is_empty(), "the dashboard has queries");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (title, expr)) in exprs.iter().enumerate() {
        let substituted = expr
            .replace("$__rate_interval", "1m")
            .replace("$instance", "10.0.0.1:9877|ws-1:9877")
            .replace("$gpu", ".*")
            .replace("$namespace", ".*")
            .replace("$pod", ".*")
            .replace("$slurm_job", ".*");
        rules.push_str(&format!(
            "      # {}\n      - record: dashboard:expr_{i}\n        expr: {}\n",
            title.replace('\n', " "),
            serde_json::to_string(&substituted).unwrap()
        ));
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let file = write_in(&scratch, "dashboard-exprs.yml", &rules);
    let out = run_tool(
        "promtool",
        &["check", "rules", file.to_str().unwrap()],
        None,
    );
    assert!(
        out.status.success(),
        "dashboard expressions are not valid PromQL:\n{}",
        output_text(&out)
    );
}

fn unit_settings(unit: &str) -> Vec<(String, String)> {
    unit.lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('[')
        })
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

#[test]
fn systemd_unit_is_sandboxed_and_verifies() {
    let unit = read("deploy/systemd/gpumem-exporter.service");
    let settings = unit_settings(&unit);
    let all = |key: &str| -> Vec<&str> {
        settings
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    let one = |key: &str| -> &str {
        let v = all(key);
        assert_eq!(v.len(), 1, "{key}= set once, got {v:?}");
        v[0]
    };
    assert_eq!(
        one("ExecStart"),
        "/usr/local/bin/gpumem-exporter --config.file=/etc/gpumem-exporter/config.yaml"
    );
    assert_eq!(one("Restart"), "on-failure");
    assert!(
        all("DynamicUser") == ["yes"] || all("User").iter().any(|u| !u.is_empty() && *u != "root"),
        "DynamicUser=yes or a dedicated User="
    );
    for (key, want) in [
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("NoNewPrivileges", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("CapabilityBoundingSet", ""),
        ("LockPersonality", "yes"),
        ("MemoryDenyWriteExecute", "yes"),
        ("RestrictRealtime", "yes"),
        ("SystemCallArchitectures", "native"),
        ("DevicePolicy", "closed"),
    ] {
        assert_eq!(one(key), want, "{key}");
    }
    let devices = all("DeviceAllow");
    for want in [
        "/dev/nvidiactl rw",
        "char-nvidia rw",
        "char-nvidia-frontend rw",
    ] {
        assert!(
            devices.contains(&want),
            "DeviceAllow={want} missing: {devices:?}"
        );
    }
    // Things that would break NVML or hide the processes to describe.
    assert!(
        !all("PrivateDevices").contains(&"yes"),
        "PrivateDevices=yes hides /dev/nvidia*"
    );
    // Unset, ProtectProc= is "default".
    let protect_proc = match all("ProtectProc") {
        set if set.is_empty() => vec!["default"],
        set => set,
    };
    assert!(
        protect_proc
            .iter()
            .all(|v| *v == "default" || *v == "ptraceable"),
        "ProtectProc must not hide other users' /proc/<pid>: {protect_proc:?}"
    );
    assert!(!all("ProcSubset").contains(&"pid"), "ProcSubset=pid");

    // systemd's own parser: warnings go to stderr with exit code 0, so
    // demand silence. The binary is not installed here: verify a copy whose
    // ExecStart points at /bin/true (ExecStart itself is checked above).
    let copy = unit.replace(
        "ExecStart=/usr/local/bin/gpumem-exporter ",
        "ExecStart=/bin/true ",
    );
    let scratch = tempfile::tempdir().expect("tempdir");
    let path = write_in(&scratch, "gpumem-exporter.service", &copy);
    let out = run_tool("systemd-analyze", &["verify", path.to_str().unwrap()], None);
    let text = output_text(&out);
    assert!(
        out.status.success() && text.trim().is_empty(),
        "systemd-analyze verify complains about the unit:\n{text}"
    );
}

/// The shipped unit as `systemd-analyze` can load it here: the binary is
/// not installed, so ExecStart points at /bin/true (ExecStart itself is
/// checked in `systemd_unit_is_sandboxed_and_verifies`).
fn unit_for_analysis() -> String {
    read("deploy/systemd/gpumem-exporter.service").replace(
        "ExecStart=/usr/local/bin/gpumem-exporter ",
        "ExecStart=/bin/true ",
    )
}

/// The capability lines `systemd-analyze security --offline=yes` marks as
/// exposed (`✗ CapabilityBoundingSet=~CAP_…`, `✗ AmbientCapabilities=`).
fn exposed_capabilities(unit: &std::path::Path) -> Vec<String> {
    let out = run_tool_ok(
        "systemd-analyze",
        &["security", "--offline=yes", unit.to_str().unwrap()],
        None,
    );
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("✗ "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|s| {
            s.starts_with("CapabilityBoundingSet=") || s.starts_with("AmbientCapabilities=")
        })
        .map(str::to_string)
        .collect()
}

/// deploy/systemd/torch-bridge.conf, the drop-in for the torch bridge,
/// only makes the runtime directory the socket lives in (owned by the
/// unit's dynamic user, 0755) and grants no capability, as systemd itself
/// reads it: `systemd-analyze verify` of the unit with the drop-in in its
/// `.d` folder is silent (and does read that folder: an unknown key there
/// draws a warning), and `systemd-analyze security --offline=yes` finds no
/// capability exposed, with the drop-in as without it. The socket's
/// default path is in that directory.
#[test]
fn systemd_torch_bridge_drop_in_grants_no_capability() {
    let conf = read("deploy/systemd/torch-bridge.conf");
    let sections: Vec<&str> = conf
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('['))
        .collect();
    assert_eq!(sections, ["[Service]"], "torch-bridge.conf sections");
    assert_eq!(
        unit_settings(&conf),
        [
            (
                "RuntimeDirectory".to_string(),
                "gpumem-exporter".to_string()
            ),
            ("RuntimeDirectoryMode".to_string(), "0755".to_string()),
        ],
        "torch-bridge.conf settings"
    );
    let shipped = shipped_config("deploy/systemd/config.yaml").attribution;
    assert_eq!(
        shipped.torch_bridge_socket.as_deref(),
        Some(Path::new("/run/gpumem-exporter/bridge.sock")),
        "the shipped config's socket is in the runtime directory"
    );

    let scratch = tempfile::tempdir().expect("tempdir");
    let unit = write_in(&scratch, "gpumem-exporter.service", &unit_for_analysis());
    assert_eq!(
        exposed_capabilities(&unit),
        Vec::<String>::new(),
        "the unit alone exposes no capability"
    );

    let dropins = scratch.path().join("gpumem-exporter.service.d");
    std::fs::create_dir_all(&dropins).expect("create the drop-in folder");
    let verify = |conf: &str| -> String {
        std::fs::write(dropins.join("torch-bridge.conf"), conf).expect("write the drop-in");
        let out = run_tool("systemd-analyze", &["verify", unit.to_str().unwrap()], None);
        let text = output_text(&out);
        assert!(
            out.status.success(),
            "systemd-analyze verify failed:\n{text}"
        );
        text
    };
    let control = verify(&format!("{conf}GpumemExporterTestUnknownKey=1\n"));
    assert!(
        control.contains("torch-bridge.conf") && control.contains("GpumemExporterTestUnknownKey"),
        "systemd-analyze verify did not read the drop-in folder:\n{control}"
    );
    let text = verify(&conf);
    assert!(
        text.trim().is_empty(),
        "systemd-analyze verify complains about the unit with the drop-in:\n{text}"
    );
    assert_eq!(
        exposed_capabilities(&unit),
        Vec::<String>::new(),
        "the unit with the drop-in exposes no capability"
    );
}

/// deploy/systemd/tls.conf hands the TLS key (and certificate) to the
/// exporter as systemd credentials (`LoadCredential=`), and the web config
/// it starts with, deploy/systemd/web-config.yml, reads them from the unit's
/// credentials directory; `systemd-analyze verify` of the unit with the
/// drop-in is silent.
#[test]
fn systemd_tls_drop_in_loads_the_key_as_a_credential() {
    let conf = read("deploy/systemd/tls.conf");
    let settings = unit_settings(&conf);
    let credentials: Vec<(String, String)> = settings
        .iter()
        .filter(|(k, _)| k == "LoadCredential")
        .filter_map(|(_, v)| v.split_once(':'))
        .map(|(name, path)| (name.to_string(), path.to_string()))
        .collect();
    let exec: Vec<&String> = settings
        .iter()
        .filter(|(k, _)| k == "ExecStart")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(exec.len(), 2, "ExecStart= reset, then set: {exec:?}");
    assert!(exec[0].is_empty());
    assert!(
        exec[1].contains("--web.config.file=/etc/gpumem-exporter/web-config.yml"),
        "{}",
        exec[1]
    );
    let web = yaml_tree("deploy/systemd/web-config.yml");
    let dir = "/run/credentials/gpumem-exporter.service/";
    for key in ["key_file", "cert_file"] {
        let path = web["tls_server_config"][key].as_str().expect(key);
        let name = path
            .strip_prefix(dir)
            .unwrap_or_else(|| panic!("{key} {path} is not in {dir}"));
        assert!(
            credentials
                .iter()
                .any(|(n, src)| n == name && src.starts_with('/')),
            "{key}: no LoadCredential={name}:/… in tls.conf ({credentials:?})"
        );
    }

    let scratch = tempfile::tempdir().expect("tempdir");
    let unit = write_in(&scratch, "gpumem-exporter.service", &unit_for_analysis());
    let dropins = scratch.path().join("gpumem-exporter.service.d");
    std::fs::create_dir_all(&dropins).expect("create the drop-in folder");
    std::fs::write(
        dropins.join("tls.conf"),
        conf.replace(
            "ExecStart=/usr/local/bin/gpumem-exporter ",
            "ExecStart=/bin/true ",
        ),
    )
    .expect("write the drop-in");
    let out = run_tool("systemd-analyze", &["verify", unit.to_str().unwrap()], None);
    let text = output_text(&out);
    assert!(
        out.status.success() && text.trim().is_empty(),
        "systemd-analyze verify complains about the unit with tls.conf:\n{text}"
    );
}

/// Kubernetes versions the rendered manifests are validated against: the
/// oldest the deployment docs support, and the newest kubernetes-validate
/// bundles.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

/// Every kustomization a user may apply.
const KUSTOMIZATIONS: [&str; 4] = [
    "deploy/kubernetes",
    "deploy/kubernetes/overlays/plain-annotations",
    "deploy/kubernetes/overlays/torch-bridge",
    "deploy/kubernetes/overlays/pod-resources",
];

/// Where scripts/ci/install-manifest-validators put the validators.
fn validators() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_file("target"));
    let dir = if target.is_absolute() {
        target
    } else {
        repo_file(&target.to_string_lossy())
    }
    .join("manifest-validators");
    assert!(
        dir.join("venv/bin/kubernetes-validate").is_file()
            && dir
                .join("node/node_modules/@kubernetes-models/prometheus-operator/package.json")
                .is_file(),
        "the manifest validators are not installed in {}; run scripts/ci/install-manifest-validators \
         (scripts/ci/test does; needs python3-venv, nodejs and npm)",
        dir.display()
    );
    dir
}

fn is_custom_resource(o: &Value) -> bool {
    o["apiVersion"].as_str() == Some("monitoring.coreos.com/v1")
}

/// Problems kubernetes-validate (strict) finds in `objects` at `version`:
/// one line per object that is not "passed", a missing schema included.
fn kubernetes_validate(dir: &Path, objects: &[&Value], version: &str) -> Vec<String> {
    let scratch = tempfile::tempdir().expect("tempdir");
    let docs: Vec<String> = objects.iter().map(|o| o.to_string()).collect();
    let file = write_in(&scratch, "objects.yaml", &docs.join("\n---\n"));
    let bin = dir.join("venv/bin/kubernetes-validate");
    let out = run_tool(
        bin.to_str().unwrap(),
        &["--strict", "-k", version, file.to_str().unwrap()],
        None,
    );
    let text = output_text(&out);
    let passed = text
        .lines()
        .filter(|l| l.starts_with("INFO ") && l.contains(" passed for resource "))
        .count();
    let mut problems: Vec<String> = text
        .lines()
        .filter(|l| !(l.starts_with("INFO ") && l.contains(" passed for resource ")))
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if passed != objects.len() && problems.is_empty() {
        problems.push(format!(
            "{passed} of {} objects passed:\n{text}",
            objects.len()
        ));
    }
    if !out.status.success() && problems.is_empty() {
        problems.push(format!("exit status {}:\n{text}", out.status));
    }
    problems
}

/// Problems the CRD-schema validators find in `objects` (ServiceMonitor,
/// PrometheusRule).
fn custom_resources_validate(dir: &Path, objects: &[&Value]) -> Vec<String> {
    let scratch = tempfile::tempdir().expect("tempdir");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
    let file = write_in(&scratch, "objects.json", &list.to_string());
    let modules = dir.join("node/node_modules");
    let out = run_tool(
        "node",
        &[
            "scripts/ci/validate-custom-resources.mjs",
            modules.to_str().unwrap(),
            file.to_str().unwrap(),
        ],
        None,
    );
    let text = output_text(&out);
    let mut problems: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with("ok "))
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let ok = text.lines().filter(|l| l.starts_with("ok ")).count();
    if (ok != objects.len() || !out.status.success()) && problems.is_empty() {
        problems.push(format!(
            "{ok} of {} valid ({}):\n{text}",
            objects.len(),
            out.status
        ));
    }
    problems
}

/// Every rendered manifest — the base and each overlay — is valid against
/// the Kubernetes API's schemas (kubernetes-validate, strict: an unknown
/// field is an error) at the oldest and newest supported version, and the
/// ServiceMonitor and PrometheusRule against prometheus-operator's CRD
/// schemas. Offline: no cluster. The controls show both validators refuse
/// a broken object.
#[test]
fn rendered_manifests_validate_against_the_api_schemas() {
    let dir = validators();
    let mut checked = 0;
    for kustomization in KUSTOMIZATIONS {
        let objects = render(kustomization);
        let (custom, core): (Vec<&Value>, Vec<&Value>) =
            objects.iter().partition(|o| is_custom_resource(o));
        assert!(!core.is_empty(), "{kustomization}: no core objects");
        for version in KUBERNETES_VERSIONS {
            let problems = kubernetes_validate(&dir, &core, version);
            assert!(
                problems.is_empty(),
                "{kustomization} against Kubernetes {version}:\n{}",
                problems.join("\n")
            );
        }
        if !custom.is_empty() {
            let problems = custom_resources_validate(&dir, &custom);
            assert!(
                problems.is_empty(),
                "{kustomization}, custom resources:\n{}",
                problems.join("\n")
            );
        }
        checked += objects.len();
    }
    assert!(checked >= 30, "only {checked} objects checked");
    // The torch bridge's example training pod, too.
    let example = yaml_tree("deploy/kubernetes/overlays/torch-bridge/training-pod.yaml");
    for version in KUBERNETES_VERSIONS {
        let problems = kubernetes_validate(&dir, &[&example], version);
        assert!(
            problems.is_empty(),
            "training-pod.yaml against Kubernetes {version}:\n{}",
            problems.join("\n")
        );
    }

    // Controls: a wrong type, an unknown field, a CR of the wrong shape.
    let base = render("deploy/kubernetes");
    let mut ds = only(&base, "DaemonSet").clone();
    ds["spec"]["template"]["spec"]["hostPID"] = Value::from("yes");
    let mut svc = only(&base, "Service").clone();
    svc["spec"]["clusterIp"] = Value::from("None");
    for (what, broken) in [("hostPID: \"yes\"", &ds), ("spec.clusterIp", &svc)] {
        let problems = kubernetes_validate(&dir, &[broken], KUBERNETES_VERSIONS[0]);
        assert!(
            problems.iter().any(|p| p.starts_with("ERROR ")),
            "kubernetes-validate let {what} through: {problems:?}"
        );
    }
    let mut sm = only(&base, "ServiceMonitor").clone();
    sm["spec"]["endpoints"][0]["port"] = Value::from(9877);
    let mut rule = only(&base, "PrometheusRule").clone();
    rule["spec"]["groups"][0]["rules"][1]
        .as_object_mut()
        .expect("a rule")
        .remove("expr");
    for (what, broken) in [("a numeric port name", &sm), ("a rule without expr", &rule)] {
        let problems = custom_resources_validate(&dir, &[broken]);
        assert!(
            problems.iter().any(|p| p.starts_with("INVALID ")),
            "the CRD schema let {what} through: {problems:?}"
        );
    }
}
