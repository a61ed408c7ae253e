//! cgroup → container id, pod UID, runtime and systemd unit: pure `&str →
//! value` parsers, table-tested with real-world lines from Docker,
//! containerd, CRI-O, Podman and systemd, on cgroup v1 and v2.

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
    let mut best = CgroupIdentity::default();
    for line in content.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_hierarchy), Some(_controllers), Some(path)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let identity = parse_cgroup_path(path);
        if identity.rank() > best.rank() {
            best = identity;
        }
    }
    best
}

/// One path segment, classified.
enum Segment {
    Pod(String),
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

/// Parses one cgroup path, walking from the root to the leaf.
///
/// Nesting is real: kind and k3d run Kubernetes inside Docker containers, so a
/// host sees `/docker/<node>/kubepods/...` or
/// `/system.slice/docker-<node>.scope/kubelet.slice/...`. The innermost pod and
/// container describe the process, so later segments overwrite earlier ones,
/// and entering a pod forgets any container seen above it (that was the node,
/// not the workload).
pub(crate) fn parse_cgroup_path(path: &str) -> CgroupIdentity {
    let path = path.trim();
    // The kernel appends this when the cgroup was removed while the process
    // still sat in it; the path before it is still the right one.
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);

    let mut identity = CgroupIdentity::default();
    let mut parent = "";
    for segment in path.split('/').filter(|s| !s.is_empty()) {
        match classify_segment(segment, parent) {
            Segment::Pod(uid) => {
                identity = CgroupIdentity {
                    pod_uid: Some(uid),
                    ..CgroupIdentity::default()
                };
            }
            Segment::Container(id, runtime) => {
                identity.container_id = Some(id);
                identity.runtime = runtime;
                identity.systemd_unit = None;
            }
            Segment::Unit(unit) => identity.systemd_unit = Some(unit),
            Segment::Other => {}
        }
        parent = segment;
    }
    if identity.container_id.is_some() {
        identity.systemd_unit = None;
    }
    identity
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

    if let Some(uid) = pod_uid_of_segment(segment) {
        return Segment::Pod(uid);
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

    #[test]
    fn parse_cgroup_table() {
        use Runtime::*;
        let none = ident(None, None, None, None);
        let id63_scope = format!("0::/system.slice/docker-{}.scope", &ID[..63]);
        let id65 = format!("0::/docker/{ID}0");
        let upper = format!("0::/docker/{}", ID.to_uppercase());
        let cases: Vec<(&str, &str, CgroupIdentity)> = vec![
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
                "k8s cgroupfs malformed pod uid keeps container",
                "0::/kubepods/burstable/podnot-a-uid/{ID}",
                ident(Some(ID), None, None, None),
            ),
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
            // --- malformed ---
            ("empty", "", none.clone()),
            ("only newlines", "\n\n\n", none.clone()),
            ("garbage", "hello world\x00\x01 ::: ", none.clone()),
            ("root v2", "0::/", none.clone()),
            ("root v1", "4:memory:/\n1:name=systemd:/", none.clone()),
            ("line without colons", "/docker/{ID}", none.clone()),
            ("one colon only", "0:/docker/{ID}", none.clone()),
            (
                "truncated id cgroupfs",
                "0::/docker/3f4e5d6c7b8a",
                none.clone(),
            ),
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
            ("65-hex id is not a container id", &id65, none.clone()),
            ("uppercase hex is not a container id", &upper, none.clone()),
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
                "colon inside path",
                "0::/weird:dir/docker-{ID}.scope",
                ident(Some(ID), None, Some(Docker), None),
            ),
            (
                "non-ascii garbage",
                "0::/☃/docker-💥.scope/pod☃/kubepods-pod💥.slice",
                ident(None, None, None, Some("docker-💥.scope")),
            ),
            (
                "bare .scope is not a unit",
                "0::/.scope/.service",
                none.clone(),
            ),
            (
                "short pod uid group",
                "0::/kubepods/burstable/pod7e6b1f2a-3c4d-4e5f-8a9b-0c1d2e3f4a5/{ID}",
                ident(Some(ID), None, None, None),
            ),
        ];
        for (name, input, expected) in cases {
            let got = parse_cgroup(&fill(input));
            assert_eq!(got, expected, "case {name:?}: input {input:?}");
        }
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
