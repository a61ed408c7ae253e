//! cgroup → container id, pod UID, runtime and systemd unit: pure `&str →
//! value` parsers, table-tested with real-world lines from Docker,
//! containerd, CRI-O, Podman and systemd, on cgroup v1 and v2, and with
//! forged ones.
//!
//! Architecture invariant: **a name counts only at its real place.** Any
//! process that can create cgroups (a systemd user manager delegates
//! `user@UID.service`; rootless Podman and privileged pods can too) can
//! name a directory `kubepods-pod<uid>.slice` or `cri-containerd-<id>.scope`
//! wherever it may write. So a pod is recognised only where the kubelet puts
//! it (`/kubepods…` at the top of the hierarchy, or inside a kind/k3d node
//! container at the top), a container only where its engine puts it, and
//! the first (outermost) match at such a place wins: whatever sits below a
//! container's cgroup is that container's own business, never another
//! container or pod. The owner of each directory is checked apart from this
//! ([`super::cgroupfs`]).

/// The container runtime named by a cgroup path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Runtime {
    Docker,
    Containerd,
    CriO,
    Podman,
}

/// Who a process belongs to, as far as its cgroup path tells.
///
/// `runtime` is only ever set together with `container_id`, and only when the
/// path names it: the cgroupfs driver under `kubepods` writes a bare id that
/// could come from any runtime. `systemd_unit` is only set when there is no
/// container: it answers "which service is this" for processes on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CgroupIdentity {
    pub container_id: Option<String>,
    pub pod_uid: Option<String>,
    pub runtime: Option<Runtime>,
    pub systemd_unit: Option<String>,
}

impl CgroupIdentity {
    /// Ranks how much a line told us, so that among cgroup v1 lines the most
    /// specific one wins (controllers such as `rdma` or `misc` often sit at
    /// the root while `memory` or `name=systemd` carry the container path).
    fn rank(&self) -> (bool, bool, bool) {
        (
            self.container_id.is_some(),
            self.pod_uid.is_some(),
            self.systemd_unit.is_some(),
        )
    }

    /// Whether the path named a container or a pod (what a forger wants).
    pub(crate) fn names_workload(&self) -> bool {
        self.container_id.is_some() || self.pod_uid.is_some()
    }
}

/// One line of `/proc/<pid>/cgroup`: `hierarchy-id:controllers:path`.
/// `controllers` is empty on the cgroup v2 line (`0::/path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CgroupLine<'a> {
    pub controllers: &'a str,
    pub path: &'a str,
}

/// The lines of a `/proc/<pid>/cgroup`; lines without two colons are
/// skipped.
pub(crate) fn lines(content: &str) -> impl Iterator<Item = CgroupLine<'_>> {
    content.lines().filter_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (Some(_hierarchy), Some(controllers), Some(path)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        Some(CgroupLine { controllers, path })
    })
}

/// What a whole `/proc/<pid>/cgroup` told: the identity, the line it came
/// from (whose directories the caller checks the owners of), and whether
/// some line named a pod or container only at a place where the kubelet
/// and the engines never put one (a forgery, or a nesting we do not know).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ParsedCgroup<'a> {
    pub identity: CgroupIdentity,
    pub line: Option<CgroupLine<'a>>,
    pub misplaced: bool,
    /// The first line that named a workload out of place.
    pub misplaced_line: Option<CgroupLine<'a>>,
}

/// Parses `/proc/<pid>/cgroup` into container id, pod UID, runtime and
/// systemd unit.
///
/// Each line is `hierarchy-id:controllers:path`: many lines on cgroup v1, one
/// `0::/path` line on v2, both on hybrid systems. Each path is parsed on its
/// own and the most informative line wins (first one on ties). Lines without
/// two colons are skipped; malformed input gives an empty identity, never a
/// panic.
pub(crate) fn parse_cgroup(content: &str) -> CgroupIdentity {
    parse_cgroup_lines(content).identity
}

/// [`parse_cgroup`], with the line the identity came from and whether a
/// workload was named out of place.
pub(crate) fn parse_cgroup_lines(content: &str) -> ParsedCgroup<'_> {
    let mut best = ParsedCgroup::default();
    let mut misplaced = None;
    for line in lines(content) {
        let identity = parse_cgroup_path(line.path);
        if !identity.names_workload() && misplaced.is_none() && names_workload_anywhere(line.path) {
            misplaced = Some(line);
        }
        if identity.rank() > best.identity.rank() {
            best.identity = identity;
            best.line = Some(line);
        }
    }
    if !best.identity.names_workload() {
        best.misplaced_line = misplaced;
        best.misplaced = misplaced.is_some();
    }
    best
}

/// One path segment, classified.
enum Segment {
    Pod,
    Container(String, Option<Runtime>),
    Unit(String),
    Other,
}

/// Systemd scope prefixes of container runtimes. `crio-conmon-` and
/// `libpod-conmon-` scopes hold the conmon monitor, not the container; they
/// fall out naturally because `conmon-<id>` is not a 64-hex id.
const SCOPE_PREFIXES: [(&str, Runtime); 4] = [
    ("docker-", Runtime::Docker),
    ("cri-containerd-", Runtime::Containerd),
    ("crio-", Runtime::CriO),
    ("libpod-", Runtime::Podman),
];

/// The path's segments, the kernel's `(deleted)` suffix dropped.
fn segments(path: &str) -> Vec<&str> {
    let path = path.trim();
    // The kernel appends this when the cgroup was removed while the process
    // still sat in it; the path before it is still the right one.
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    path.split('/').filter(|s| !s.is_empty()).collect()
}

/// Parses one cgroup path, walking from the root to the leaf, accepting a
/// pod or container only at its real place:
///
/// - Kubernetes, cgroupfs driver: `/kubepods[/<qos>]/pod<uid>[/<id>]`;
///   systemd driver: `/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid>.slice[/<runtime>-<id>.scope]`
///   (`kubelet.slice/kubelet-kubepods…` under kind);
/// - a container outside Kubernetes: `/docker/<id>`,
///   `/system.slice/docker-<id>.scope`, `/machine.slice/libpod-<id>.scope`,
///   `/libpod_parent/libpod-<id>`, `/ecs/<task>/<id>`, or a container scope
///   anywhere inside a user's own manager (`/user.slice/user-<uid>.slice/user@<uid>.service/…`,
///   rootless engines: the owner check refuses those, as the user made them);
/// - nesting (kind, k3d): a Kubernetes hierarchy directly inside such a
///   container at the top describes the pod, not the node container.
///
/// Anything below the first container found is that container's own.
pub(crate) fn parse_cgroup_path(path: &str) -> CgroupIdentity {
    let segs = segments(path);
    let unit = innermost_unit(&segs);
    if let Some(identity) = kubernetes_at(&segs) {
        return identity;
    }
    if let Some((id, runtime, used)) = container_at(&segs) {
        // A kind or k3d node: the kubelet's hierarchy inside the node
        // container.
        if let Some(identity) = kubernetes_at(&segs[used..]) {
            return identity;
        }
        return CgroupIdentity {
            container_id: Some(id),
            runtime,
            ..CgroupIdentity::default()
        };
    }
    CgroupIdentity {
        systemd_unit: unit,
        ..CgroupIdentity::default()
    }
}

/// The innermost systemd unit of a path that names no container.
fn innermost_unit(segs: &[&str]) -> Option<String> {
    segs.iter().rev().find_map(|s| {
        let is_unit = [".service", ".scope"]
            .iter()
            .any(|suffix| s.strip_suffix(suffix).is_some_and(|s| !s.is_empty()));
        is_unit.then(|| (*s).to_owned())
    })
}

/// Whether any segment, anywhere, looks like a pod or a container: with
/// no workload at a real place, such a path is counted as misplaced.
pub(crate) fn names_workload_anywhere(path: &str) -> bool {
    let mut parent = "";
    segments(path).into_iter().any(|segment| {
        let found = matches!(
            classify_segment(segment, parent),
            Segment::Pod | Segment::Container(..)
        );
        parent = segment;
        found
    })
}

/// QoS classes below the kubelet's root (guaranteed pods sit directly in it).
const QOS: [&str; 2] = ["burstable", "besteffort"];

/// The pod (and its container) of a Kubernetes hierarchy starting at
/// `segs[0]`, in either cgroup driver's layout; `None` when `segs` does not
/// start with the kubelet's root or strays from its layout.
fn kubernetes_at(segs: &[&str]) -> Option<CgroupIdentity> {
    let first = *segs.first()?;
    let (pod_uid, rest, systemd) = if first == "kubepods" {
        // cgroupfs driver.
        let mut i = 1;
        if segs.get(i).is_some_and(|s| QOS.contains(s)) {
            i += 1;
        }
        let uid = segs.get(i)?.strip_prefix("pod").filter(|u| is_pod_uid(u))?;
        (uid.to_owned(), &segs[i + 1..], false)
    } else {
        // systemd driver: `kubepods.slice`, or kind's
        // `kubelet.slice/kubelet-kubepods.slice`.
        let (prefix, mut i) = match segs {
            ["kubepods.slice", ..] => ("kubepods", 1),
            ["kubelet.slice", "kubelet-kubepods.slice", ..] => ("kubelet-kubepods", 2),
            ["kubelet-kubepods.slice", ..] => ("kubelet-kubepods", 1),
            _ => return None,
        };
        let mut parent = prefix.to_owned();
        if let Some(qos) = QOS
            .iter()
            .find(|q| segs.get(i) == Some(&format!("{prefix}-{q}.slice").as_str()))
        {
            parent = format!("{prefix}-{qos}");
            i += 1;
        }
        let escaped = segs
            .get(i)?
            .strip_suffix(".slice")?
            .strip_prefix(parent.as_str())?
            .strip_prefix("-pod")?;
        let uid = escaped.replace('_', "-");
        if !is_pod_uid(&uid) {
            return None;
        }
        (uid, &segs[i + 1..], true)
    };
    let mut identity = CgroupIdentity {
        pod_uid: Some(pod_uid),
        ..CgroupIdentity::default()
    };
    // The container is the pod's child; anything below it is its own.
    if let Some(child) = rest.first() {
        match (systemd, classify_segment(child, "")) {
            (false, Segment::Container(id, None)) | (true, Segment::Container(id, Some(_)))
                if is_kubelet_runtime(child, systemd) =>
            {
                identity.runtime = if systemd { runtime_of(child) } else { None };
                identity.container_id = Some(id);
            }
            (_, Segment::Unit(unit)) => identity.systemd_unit = Some(unit),
            _ => {}
        }
    }
    Some(identity)
}

/// Under the cgroupfs driver the kubelet's child is the bare id; under the
/// systemd driver a CRI runtime's scope (Podman is not a CRI runtime).
fn is_kubelet_runtime(segment: &str, systemd: bool) -> bool {
    if !systemd {
        return is_container_id(segment);
    }
    matches!(
        runtime_of(segment),
        Some(Runtime::Containerd | Runtime::CriO | Runtime::Docker)
    )
}

fn runtime_of(segment: &str) -> Option<Runtime> {
    let stem = segment.strip_suffix(".scope").unwrap_or(segment);
    SCOPE_PREFIXES
        .iter()
        .find(|(prefix, _)| stem.strip_prefix(prefix).is_some_and(is_container_id))
        .map(|(_, runtime)| *runtime)
}

/// A container outside Kubernetes at its engine's place, with the number
/// of segments its path took.
fn container_at(segs: &[&str]) -> Option<(String, Option<Runtime>, usize)> {
    let scope = |s: &str, want: Runtime, suffix: bool| -> Option<String> {
        let stem = if suffix { s.strip_suffix(".scope")? } else { s };
        SCOPE_PREFIXES.iter().find_map(|(prefix, runtime)| {
            let id = stem.strip_prefix(prefix)?;
            (*runtime == want && is_container_id(id)).then(|| id.to_owned())
        })
    };
    match segs {
        ["docker", id, ..] if is_container_id(id) => {
            Some(((*id).to_owned(), Some(Runtime::Docker), 2))
        }
        ["system.slice", s, ..] => {
            scope(s, Runtime::Docker, true).map(|id| (id, Some(Runtime::Docker), 2))
        }
        ["machine.slice", s, ..] => {
            scope(s, Runtime::Podman, true).map(|id| (id, Some(Runtime::Podman), 2))
        }
        ["libpod_parent", s, ..] => {
            scope(s, Runtime::Podman, false).map(|id| (id, Some(Runtime::Podman), 2))
        }
        ["ecs", _task, id, ..] if is_container_id(id) => Some(((*id).to_owned(), None, 3)),
        ["user.slice", user, manager, rest @ ..] if is_user_manager(user, manager) => {
            rest.iter().enumerate().find_map(|(i, s)| {
                let stem = s.strip_suffix(".scope")?;
                // Rootless engines: Podman and Docker.
                SCOPE_PREFIXES.iter().find_map(|(prefix, runtime)| {
                    let id = stem.strip_prefix(prefix)?;
                    (matches!(runtime, Runtime::Podman | Runtime::Docker) && is_container_id(id))
                        .then(|| (id.to_owned(), Some(*runtime), i + 4))
                })
            })
        }
        _ => None,
    }
}

/// `user-<uid>.slice` / `user@<uid>.service`: a user's own systemd manager.
fn is_user_manager(slice: &str, manager: &str) -> bool {
    let uid = slice
        .strip_prefix("user-")
        .and_then(|s| s.strip_suffix(".slice"));
    uid.is_some_and(|u| {
        !u.is_empty()
            && u.bytes().all(|b| b.is_ascii_digit())
            && manager == format!("user@{u}.service")
    })
}

fn classify_segment(segment: &str, parent: &str) -> Segment {
    // cgroupfs driver: the id is the whole segment (`/docker/<id>`,
    // `/kubepods/burstable/pod<uid>/<id>`).
    if is_container_id(segment) {
        let runtime = (parent == "docker").then_some(Runtime::Docker);
        return Segment::Container(segment.to_owned(), runtime);
    }

    // systemd driver: `<runtime>-<id>.scope`; Podman's cgroupfs manager uses
    // the same name without `.scope`.
    let stem = segment.strip_suffix(".scope").unwrap_or(segment);
    for (prefix, runtime) in SCOPE_PREFIXES {
        if let Some(id) = stem.strip_prefix(prefix)
            && is_container_id(id)
        {
            return Segment::Container(id.to_owned(), Some(runtime));
        }
    }

    if pod_uid_of_segment(segment).is_some() {
        return Segment::Pod;
    }

    let is_unit = [".service", ".scope"]
        .iter()
        .any(|suffix| segment.strip_suffix(suffix).is_some_and(|s| !s.is_empty()));
    if is_unit {
        return Segment::Unit(segment.to_owned());
    }
    Segment::Other
}

/// The pod UID a segment names, in either kubelet cgroup driver's spelling:
/// cgroupfs `pod<uid>`, or systemd `kubepods-<qos>-pod<uid>.slice` /
/// `kubepods-pod<uid>.slice` (also prefixed `kubelet-` under kind).
///
/// In systemd slice names `-` means nesting (`a-b.slice` is a child of
/// `a.slice`), so the kubelet escapes the UID's dashes as underscores there;
/// they are turned back into dashes so both drivers give the UID that
/// `kubectl get pod -o jsonpath='{.metadata.uid}'` shows.
fn pod_uid_of_segment(segment: &str) -> Option<String> {
    if let Some(uid) = segment.strip_prefix("pod")
        && is_pod_uid(uid)
    {
        return Some(uid.to_owned());
    }
    let stem = segment.strip_suffix(".slice")?;
    let (_, escaped) = stem.rsplit_once("-pod")?;
    let uid = escaped.replace('_', "-");
    is_pod_uid(&uid).then_some(uid)
}

/// The container id's form is the pod index's key, so it is defined there.
pub(crate) use crate::kube::index::is_container_id;

/// A UUID in its 36-character 8-4-4-4-12 hex form, which is what Kubernetes
/// pod UIDs are.
pub(crate) fn is_pod_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const ID: &str = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899";
    const NODE: &str = "aaaabbbbccccddddeeeeffff0000111122223333444455556666777788889999";
    pub(crate) const UID: &str = "7e6b1f2a-3c4d-4e5f-8a9b-0c1d2e3f4a5b";
    const UID_: &str = "7e6b1f2a_3c4d_4e5f_8a9b_0c1d2e3f4a5b";

    pub(crate) fn ident(
        container: Option<&str>,
        pod: Option<&str>,
        runtime: Option<Runtime>,
        unit: Option<&str>,
    ) -> CgroupIdentity {
        CgroupIdentity {
            container_id: container.map(str::to_owned),
            pod_uid: pod.map(str::to_owned),
            runtime,
            systemd_unit: unit.map(str::to_owned),
        }
    }

    /// Replaces `{ID}`, `{NODE}`, `{UID}`, `{UID_}` in a template.
    pub(crate) fn fill(template: &str) -> String {
        template
            .replace("{ID}", ID)
            .replace("{NODE}", NODE)
            .replace("{UID_}", UID_)
            .replace("{UID}", UID)
    }

    fn none() -> CgroupIdentity {
        ident(None, None, None, None)
    }

    /// Parses each case's input (a `fill` template) and compares it with
    /// the identity wanted.
    fn check_cgroup_cases(cases: &[(&str, &str, CgroupIdentity)]) {
        for (name, input, expected) in cases {
            let got = parse_cgroup(&fill(input));
            assert_eq!(&got, expected, "case {name:?}: input {input:?}");
        }
    }

    #[test]
    fn parse_cgroup_docker_and_podman() {
        use Runtime::*;
        check_cgroup_cases(&[
            // --- Docker ---
            (
                "docker cgroupfs v1, many controllers",
                "12:pids:/docker/{ID}\n11:memory:/docker/{ID}\n4:cpu,cpuacct:/docker/{ID}\n\
                 1:name=systemd:/docker/{ID}\n0::/system.slice/containerd.service\n",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "docker systemd v2",
                "0::/system.slice/docker-{ID}.scope\n",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "docker systemd v1",
                "9:memory:/system.slice/docker-{ID}.scope\n1:name=systemd:/system.slice/docker-{ID}.scope\n",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "rootless docker v2",
                "0::/user.slice/user-1000.slice/user@1000.service/user.slice/docker-{ID}.scope",
                ident(Some(ID), None, Some(Docker), None),
            ),
            // --- Podman ---
            (
                "podman rootful",
                "0::/machine.slice/libpod-{ID}.scope",
                ident(Some(ID), None, Some(Podman), None),
            ),
            (
                "podman rootful with container subgroup",
                "0::/machine.slice/libpod-{ID}.scope/container",
                ident(Some(ID), None, Some(Podman), None),
            ),
            (
                "podman rootless",
                "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope",
                ident(Some(ID), None, Some(Podman), None),
            ),
            (
                "podman conmon is not a container",
                "0::/machine.slice/libpod-conmon-{ID}.scope",
                ident(None, None, None, Some(&fill("libpod-conmon-{ID}.scope"))),
            ),
            (
                "podman cgroupfs manager",
                "0::/libpod_parent/libpod-{ID}",
                ident(Some(ID), None, Some(Podman), None),
            ),
        ]);
    }

    #[test]
    fn parse_cgroup_kubernetes_cgroupfs_driver() {
        check_cgroup_cases(&[
            // --- Kubernetes, cgroupfs driver ---
            (
                "k8s cgroupfs burstable v1",
                "11:memory:/kubepods/burstable/pod{UID}/{ID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{ID}",
                ident(Some(ID), Some(UID), None, None),
            ),
            (
                "k8s cgroupfs guaranteed",
                "0::/kubepods/pod{UID}/{ID}",
                ident(Some(ID), Some(UID), None, None),
            ),
            (
                "k8s cgroupfs besteffort (containerd / k3s)",
                "0::/kubepods/besteffort/pod{UID}/{ID}",
                ident(Some(ID), Some(UID), None, None),
            ),
            (
                "k8s cgroupfs pod level only (no container)",
                "0::/kubepods/burstable/pod{UID}",
                ident(None, Some(UID), None, None),
            ),
            (
                "k8s cgroupfs malformed pod uid: nothing at its place",
                "0::/kubepods/burstable/podnot-a-uid/{ID}",
                none(),
            ),
        ]);
    }

    #[test]
    fn parse_cgroup_kubernetes_systemd_driver() {
        use Runtime::*;
        check_cgroup_cases(&[
            // --- Kubernetes, systemd driver ---
            (
                "k8s systemd burstable containerd v2",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{ID}.scope",
                ident(Some(ID), Some(UID), Some(Containerd), None),
            ),
            (
                "k8s systemd besteffort cri-o v1",
                "12:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{ID}.scope\n\
                 1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{ID}.scope",
                ident(Some(ID), Some(UID), Some(CriO), None),
            ),
            (
                "k8s systemd guaranteed",
                "0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope",
                ident(Some(ID), Some(UID), Some(Containerd), None),
            ),
            (
                "k8s systemd cri-o conmon is not the container",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{ID}.scope",
                ident(None, Some(UID), None, Some(&fill("crio-conmon-{ID}.scope"))),
            ),
            (
                "k8s systemd dockershim",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{ID}.scope",
                ident(Some(ID), Some(UID), Some(Docker), None),
            ),
            (
                "k8s systemd pod slice only",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
                ident(None, Some(UID), None, None),
            ),
            (
                "k8s systemd pod slice with dashes also accepted",
                "0::/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{ID}.scope",
                ident(Some(ID), Some(UID), Some(Containerd), None),
            ),
            (
                "k8s systemd cri-o with container subgroup",
                "0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope/container",
                ident(Some(ID), Some(UID), Some(CriO), None),
            ),
        ]);
    }

    #[test]
    fn parse_cgroup_nested_kind_and_k3d() {
        use Runtime::*;
        check_cgroup_cases(&[
            // --- nested (kind, k3d) ---
            (
                "kind seen from host, systemd",
                "0::/system.slice/docker-{NODE}.scope/kubelet.slice/kubelet-kubepods.slice/\
                 kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope",
                ident(Some(ID), Some(UID), Some(Containerd), None),
            ),
            (
                "kind seen from inside the node (cgroup namespace)",
                "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/\
                 kubelet-kubepods-burstable-pod{UID_}.slice/cri-containerd-{ID}.scope",
                ident(Some(ID), Some(UID), Some(Containerd), None),
            ),
            (
                "k3d seen from host, cgroupfs",
                "0::/docker/{NODE}/kubepods/burstable/pod{UID}/{ID}",
                ident(Some(ID), Some(UID), None, None),
            ),
            (
                "pod under a docker node forgets the node container",
                "0::/docker/{NODE}/kubepods/besteffort/pod{UID}",
                ident(None, Some(UID), None, None),
            ),
            (
                "kind node's own containerd",
                "0::/system.slice/docker-{NODE}.scope/system.slice/containerd.service",
                ident(Some(NODE), None, Some(Docker), None),
            ),
        ]);
    }

    #[test]
    fn parse_cgroup_host_processes() {
        use Runtime::*;
        check_cgroup_cases(&[
            // --- host processes ---
            (
                "systemd service",
                "0::/system.slice/nvidia-persistenced.service\n",
                ident(None, None, None, Some("nvidia-persistenced.service")),
            ),
            (
                "user session",
                "0::/user.slice/user-1000.slice/session-3.scope",
                ident(None, None, None, Some("session-3.scope")),
            ),
            (
                "user service: innermost unit wins",
                "0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service",
                ident(None, None, None, Some("jupyter.service")),
            ),
            (
                "v1 session, root controllers first",
                "12:devices:/user.slice\n11:rdma:/\n5:memory:/user.slice/user-1000.slice/session-3.scope\n\
                 1:name=systemd:/user.slice/user-1000.slice/session-3.scope\n0::/user.slice/user-1000.slice/session-3.scope",
                ident(None, None, None, Some("session-3.scope")),
            ),
            (
                "pid 1",
                "0::/init.scope",
                ident(None, None, None, Some("init.scope")),
            ),
            (
                "v1: later line carries the id",
                "13:misc:/\n12:rdma:/\n10:memory:/docker/{ID}\n",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "hybrid: container beats unit",
                "0::/system.slice/foo.service\n1:name=systemd:/docker/{ID}",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "ECS-like cgroupfs: id without runtime",
                "0::/ecs/task-1234/{ID}",
                ident(Some(ID), None, None, None),
            ),
        ]);
    }

    #[test]
    fn parse_cgroup_malformed() {
        use Runtime::*;
        let id63_scope = format!("0::/system.slice/docker-{}.scope", &ID[..63]);
        let id65 = format!("0::/docker/{ID}0");
        let upper = format!("0::/docker/{}", ID.to_uppercase());
        check_cgroup_cases(&[
            // --- malformed ---
            ("empty", "", none()),
            ("only newlines", "\n\n\n", none()),
            ("garbage", "hello world\x00\x01 ::: ", none()),
            ("root v2", "0::/", none()),
            ("root v1", "4:memory:/\n1:name=systemd:/", none()),
            ("line without colons", "/docker/{ID}", none()),
            ("one colon only", "0:/docker/{ID}", none()),
            ("truncated id cgroupfs", "0::/docker/3f4e5d6c7b8a", none()),
            (
                "63-hex id in scope is a unit, not a container",
                &id63_scope,
                ident(
                    None,
                    None,
                    None,
                    Some(&format!("docker-{}.scope", &ID[..63])),
                ),
            ),
            ("65-hex id is not a container id", &id65, none()),
            ("uppercase hex is not a container id", &upper, none()),
            (
                "trailing whitespace and CRLF",
                "0::/system.slice/docker-{ID}.scope  \r\n\n",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "deleted cgroup",
                "0::/kubepods/burstable/pod{UID}/{ID} (deleted)\n",
                ident(Some(ID), Some(UID), None, None),
            ),
            (
                "colon inside path: a scope out of place is only a unit",
                "0::/weird:dir/docker-{ID}.scope",
                ident(None, None, None, Some(&fill("docker-{ID}.scope"))),
            ),
            (
                "non-ascii garbage",
                "0::/☃/docker-💥.scope/pod☃/kubepods-pod💥.slice",
                ident(None, None, None, Some("docker-💥.scope")),
            ),
            ("bare .scope is not a unit", "0::/.scope/.service", none()),
            (
                "short pod uid group",
                "0::/kubepods/burstable/pod7e6b1f2a-3c4d-4e5f-8a9b-0c1d2e3f4a5/{ID}",
                none(),
            ),
        ]);
    }

    const VICTIM: &str = "0b6e2f51-3c1d-4a8e-9f7b-2d4c6e8a0b1c";
    const VICTIM_: &str = "0b6e2f51_3c1d_4a8e_9f7b_2d4c6e8a0b1c";

    /// `fill`, and `{VICTIM}`, `{VICTIM_}` (a victim pod's uid) and `{VID}`
    /// (a victim container's id).
    fn fill_forged(template: &str) -> String {
        fill(template)
            .replace("{VICTIM_}", VICTIM_)
            .replace("{VICTIM}", VICTIM)
            .replace("{VID}", &"e".repeat(64))
    }

    /// (name, input, identity, misplaced)
    fn check_forged_cases(cases: &[(&str, &str, CgroupIdentity, bool)]) {
        for (name, input, expected, misplaced) in cases {
            let input = fill_forged(input);
            let got = parse_cgroup_lines(&input);
            assert_eq!(&got.identity, expected, "case {name:?}: input {input:?}");
            assert_eq!(got.misplaced, *misplaced, "case {name:?} misplaced");
        }
    }

    /// Forged paths: a pod or container named where the kubelet and the
    /// engines never put one (a user's delegated subtree, a service's
    /// cgroup, another cgroup namespace) gives no workload and is flagged
    /// misplaced.
    #[test]
    fn forged_paths_name_nothing() {
        check_forged_cases(&[
            (
                "user manager: a kubepods tree of the user's own",
                "0::/user.slice/user-65534.slice/user@65534.service/app.slice/kubepods.slice/\
                 kubepods-pod{VICTIM_}.slice/cri-containerd-{VID}.scope",
                ident(
                    None,
                    None,
                    None,
                    Some(&fill_forged("cri-containerd-{VID}.scope")),
                ),
                true,
            ),
            (
                "user manager: a bare pod slice",
                "0::/user.slice/user-65534.slice/user@65534.service/kubepods-besteffort-pod{VICTIM_}.slice",
                ident(None, None, None, Some("user@65534.service")),
                true,
            ),
            (
                "user session: a cgroupfs-driver pod below a scope",
                "0::/user.slice/user-1000.slice/session-4.scope/kubepods/pod{VICTIM}/{VID}",
                ident(None, None, None, Some("session-4.scope")),
                true,
            ),
            (
                "kubepods below a service is not the kubelet's",
                "0::/system.slice/evil.service/kubepods.slice/kubepods-pod{VICTIM_}.slice/cri-containerd-{VID}.scope",
                ident(
                    None,
                    None,
                    None,
                    Some(&fill_forged("cri-containerd-{VID}.scope")),
                ),
                true,
            ),
            (
                "relative to another cgroup namespace",
                "0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{VICTIM_}.slice/cri-containerd-{VID}.scope",
                ident(
                    None,
                    None,
                    None,
                    Some(&fill_forged("cri-containerd-{VID}.scope")),
                ),
                true,
            ),
        ]);
    }

    /// A kubepods tree of the wrong shape names no container: a pod slice
    /// out of its QoS parent, an engine's scope the kubelet never makes.
    #[test]
    fn forged_kubelet_layouts_name_no_container() {
        check_forged_cases(&[
            (
                "a qos pod slice directly under kubepods.slice",
                "0::/kubepods.slice/kubepods-burstable-pod{VICTIM_}.slice/cri-containerd-{VID}.scope",
                ident(
                    None,
                    None,
                    None,
                    Some(&fill_forged("cri-containerd-{VID}.scope")),
                ),
                true,
            ),
            (
                "a pod slice whose name is not its parent's child",
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-burstable-pod{VICTIM_}.slice",
                ident(None, None, None, None),
                true,
            ),
            (
                "podman's scope is no CRI container of a pod",
                "0::/kubepods.slice/kubepods-pod{VICTIM_}.slice/libpod-{VID}.scope",
                ident(None, Some(VICTIM), None, None),
                false,
            ),
            (
                "machine.slice holds Podman, not Docker",
                "0::/machine.slice/docker-{VID}.scope",
                ident(None, None, None, Some(&fill_forged("docker-{VID}.scope"))),
                true,
            ),
        ]);
    }

    /// Names nested below a real container (a privileged container's own
    /// cgroup) never override it.
    #[test]
    fn names_below_a_real_container_never_override_it() {
        use Runtime::*;
        check_forged_cases(&[
            (
                "privileged pod nests a victim's container below its own",
                "0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope/\
                 kubepods.slice/kubepods-pod{VICTIM_}.slice/cri-containerd-{VID}.scope",
                ident(Some(ID), Some(UID), Some(Containerd), None),
                false,
            ),
            (
                "cgroupfs driver: a victim's id below the real container",
                "0::/kubepods/burstable/pod{UID}/{ID}/{VID}",
                ident(Some(ID), Some(UID), None, None),
                false,
            ),
            (
                "docker container nests a kubepods tree (no kind node layout)",
                "0::/system.slice/docker-{NODE}.scope/init.scope/kubepods/pod{VICTIM}/{VID}",
                ident(Some(NODE), None, Some(Docker), None),
                false,
            ),
            (
                "v1: a forged line does not beat a real one",
                "12:memory:/user.slice/user-65534.slice/user@65534.service/kubepods/pod{VICTIM}/{VID}\n\
                 1:name=systemd:/system.slice/docker-{ID}.scope\n",
                ident(Some(ID), None, Some(Docker), None),
                false,
            ),
        ]);
    }

    /// The line an identity came from is the one whose owners are checked.
    #[test]
    fn the_line_of_the_identity_is_kept() {
        let text = fill(
            "13:misc:/\n12:memory:/kubepods/burstable/pod{UID}/{ID}\n0::/system.slice/containerd.service\n",
        );
        let got = parse_cgroup_lines(&text);
        assert_eq!(
            got.line,
            Some(CgroupLine {
                controllers: "memory",
                path: &fill("/kubepods/burstable/pod{UID}/{ID}"),
            })
        );
        assert_eq!(parse_cgroup_lines("0::/\n").line, None);
    }

    /// Every prefix of real-world inputs, cut at every char boundary, parses
    /// without panicking (a truncated read of /proc must be harmless).
    #[test]
    fn parse_cgroup_never_panics_on_prefixes() {
        let inputs = [
            fill(
                "12:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{ID}.scope\n\
                 0::/docker/{NODE}/kubepods/pod{UID}/{ID}\n",
            ),
            fill("0::/☃/libpod-{ID}.scope 💥 (deleted)"),
        ];
        for input in &inputs {
            for (cut, _) in input.char_indices() {
                let _ = parse_cgroup(&input[..cut]);
            }
        }
        // Pseudo-random bytes over an alphabet rich in separators.
        let alphabet = b"0:/-_.abcdefpodkubepods.slicescope\n ";
        let mut state: u32 = 12345;
        for _ in 0..2000 {
            let s: String = (0..64)
                .map(|_| {
                    state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    alphabet[(state >> 16) as usize % alphabet.len()] as char
                })
                .collect();
            let _ = parse_cgroup(&s);
        }
    }

    #[test]
    fn id_validators() {
        let container_cases = [
            (ID, true),
            ("", false),
            (&ID[..63], false),
            ("g".repeat(64).leak() as &str, false),
            (ID.to_uppercase().leak() as &str, false),
        ];
        for (input, expected) in container_cases {
            assert_eq!(is_container_id(input), expected, "{input:?}");
        }
        let uid_cases = [
            (UID, true),
            ("7E6B1F2A-3C4D-4E5F-8A9B-0C1D2E3F4A5B", true),
            (UID_, false),
            ("", false),
            ("7e6b1f2a-3c4d-4e5f-8a9b", false),
            ("7e6b1f2a-3c4d-4e5f-8a9b-0c1d2e3f4a5b-", false),
            ("7e6b1f2a3-c4d-4e5f-8a9b-0c1d2e3f4a5b", false),
            ("ze6b1f2a-3c4d-4e5f-8a9b-0c1d2e3f4a5b", false),
        ];
        for (input, expected) in uid_cases {
            assert_eq!(is_pod_uid(input), expected, "{input:?}");
        }
    }
}
