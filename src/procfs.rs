//! `/proc/<pid>` readers and the pure parsers behind them: comm, owner, start
//! time, command line, and cgroup → container id / pod UID / systemd unit.
//!
//! Everything here is std-only, and every parser is a plain `&str → value`
//! function, so attribution (pid → user, container, pod) is table-tested with
//! real-world lines from Docker, containerd, CRI-O, Podman and systemd, on
//! cgroup v1 and v2, without a kernel, a container runtime or a GPU.
//!
//! Readers return `Option` rather than errors: a process can exit between the
//! moment NVML reports its pid and the moment we read `/proc`, and that race is
//! normal operation, not a failure worth reporting.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where `/proc` lives. Production uses `/proc` (or a host mount such as
/// `/host/proc` when running in a container with `hostPID`); tests point it at
/// a temporary directory laid out like `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcRoot {
    root: PathBuf,
}

impl Default for ProcRoot {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl ProcRoot {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    fn pid_file(&self, pid: u32, name: &str) -> PathBuf {
        self.root.join(pid.to_string()).join(name)
    }

    /// Reads a file lossily: process names and arguments are bytes, not
    /// necessarily UTF-8, and one odd byte must not hide the whole process.
    fn read_lossy(&self, pid: u32, name: &str) -> Option<String> {
        let bytes = fs::read(self.pid_file(pid, name)).ok()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Whether `/proc/<pid>` exists, i.e. the process is still alive (or a
    /// zombie) in the pid namespace this root shows.
    pub fn exists(&self, pid: u32) -> bool {
        self.root.join(pid.to_string()).is_dir()
    }

    /// `/proc/<pid>/comm`: the kernel's 15-byte process name, newline trimmed.
    pub fn comm(&self, pid: u32) -> Option<String> {
        let comm = self.read_lossy(pid, "comm")?;
        Some(comm.trim_end_matches('\n').to_owned())
    }

    /// Real uid of the process, from `/proc/<pid>/status`.
    pub fn uid(&self, pid: u32) -> Option<u32> {
        parse_status_uid(&self.read_lossy(pid, "status")?)
    }

    /// Start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
    /// Together with the pid it identifies a process across pid reuse.
    pub fn start_time(&self, pid: u32) -> Option<u64> {
        parse_stat_start_time(&self.read_lossy(pid, "stat")?)
    }

    /// `/proc/<pid>/cgroup` as is; see [`parse_cgroup`].
    pub fn cgroup(&self, pid: u32) -> Option<String> {
        self.read_lossy(pid, "cgroup")
    }

    /// `/proc/<pid>/cmdline` split into arguments; see [`parse_cmdline`].
    pub fn cmdline(&self, pid: u32) -> Option<Vec<String>> {
        let bytes = fs::read(self.pid_file(pid, "cmdline")).ok()?;
        Some(parse_cmdline(&bytes))
    }
}

/// Real uid from the `Uid:` line of `/proc/<pid>/status`
/// (`Uid:\treal\teffective\tsaved\tfs`). The real uid is who started the
/// process, which is what "whose job is using the GPU" means; the effective
/// uid differs only for setuid programs.
pub fn parse_status_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Field 22 (`starttime`) of `/proc/<pid>/stat`.
///
/// Field 2 is the comm in parentheses, and comm is chosen by the program: it
/// may contain spaces and `)` (`(my (weird) proc)`), so splitting the whole
/// line on whitespace miscounts. The kernel prints nothing after comm that can
/// contain `)`, so everything after the LAST `)` is the fixed numeric fields,
/// starting with field 3 (state).
pub fn parse_stat_start_time(stat: &str) -> Option<u64> {
    const FIRST_FIELD_AFTER_COMM: usize = 3;
    const START_TIME_FIELD: usize = 22;
    let (_, after_comm) = stat.rsplit_once(')')?;
    after_comm
        .split_whitespace()
        .nth(START_TIME_FIELD - FIRST_FIELD_AFTER_COMM)?
        .parse()
        .ok()
}

/// Splits `/proc/<pid>/cmdline` (arguments each ending in NUL) into arguments.
///
/// All trailing NULs are dropped before splitting: programs that rewrite their
/// title (setproctitle, nginx, postgres) pad the old argv area with NULs, and
/// those are not arguments. The cost is that genuinely empty trailing
/// arguments vanish. Kernel threads and zombies have an empty cmdline, which
/// gives an empty vector.
pub fn parse_cmdline(bytes: &[u8]) -> Vec<String> {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    if end == 0 {
        return Vec::new();
    }
    bytes[..end]
        .split(|&b| b == 0)
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect()
}

/// The container runtime named by a cgroup path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    Docker,
    Containerd,
    CriO,
    Podman,
}

impl Runtime {
    /// Stable label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Docker => "docker",
            Runtime::Containerd => "containerd",
            Runtime::CriO => "cri-o",
            Runtime::Podman => "podman",
        }
    }
}

/// Who a process belongs to, as far as its cgroup path tells.
///
/// `runtime` is only ever set together with `container_id`, and only when the
/// path names it: the cgroupfs driver under `kubepods` writes a bare id that
/// could come from any runtime. `systemd_unit` is only set when there is no
/// container: it answers "which service is this" for processes on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupIdentity {
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
pub fn parse_cgroup(content: &str) -> CgroupIdentity {
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
pub fn parse_cgroup_path(path: &str) -> CgroupIdentity {
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

/// 64 lowercase hex digits: the full id every runtime here uses in cgroup
/// names. Anything shorter is a truncated or unrelated name, and reporting it
/// would produce ids that match nothing in `docker ps` or `crictl ps`.
pub fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A UUID in its 36-character 8-4-4-4-12 hex form, which is what Kubernetes
/// pod UIDs are.
pub fn is_pod_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// uid → user name from passwd-format content. Comments, blank lines, NIS
/// compat entries (`+`/`-`) and lines without a numeric uid are skipped; when
/// a uid appears twice the first name wins, as with `getpwuid`.
pub fn parse_passwd(content: &str) -> HashMap<u32, String> {
    let mut names = HashMap::new();
    for line in content.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split(':');
        let (Some(name), Some(_password), Some(uid)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if name.is_empty() || name.starts_with(['+', '-']) {
            continue;
        }
        let Ok(uid) = uid.parse::<u32>() else {
            continue;
        };
        names.entry(uid).or_insert_with(|| name.to_owned());
    }
    names
}

/// uid → user name, from one passwd file read at most once.
///
/// The file is read directly instead of through NSS (`getpwuid`): in a
/// container the exporter's own `/etc/passwd` is not the host's, so the host
/// file is mounted (e.g. `/host/etc/passwd`) and named here. It is read once,
/// lazily, because users change rarely and re-reading per process per tick is
/// waste; a user added later shows as a numeric uid until restart. LDAP/SSSD
/// users are not in the file and show as numeric uids too.
#[derive(Debug)]
pub struct UserNames {
    path: PathBuf,
    names: OnceLock<HashMap<u32, String>>,
}

impl UserNames {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            names: OnceLock::new(),
        }
    }

    /// From passwd content already in hand (tests, or a caller that read it).
    pub fn from_passwd(content: &str) -> Self {
        Self {
            path: PathBuf::new(),
            names: OnceLock::from(parse_passwd(content)),
        }
    }

    /// The user name, or the uid in decimal when unknown or unreadable, so a
    /// label always has a value that still identifies the user.
    pub fn name(&self, uid: u32) -> String {
        self.names()
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    fn names(&self) -> &HashMap<u32, String> {
        self.names.get_or_init(|| {
            fs::read(&self.path)
                .map(|bytes| parse_passwd(&String::from_utf8_lossy(&bytes)))
                .unwrap_or_default()
        })
    }
}

/// What a redacted value is replaced with.
pub const REDACTED: &str = "<redacted>";

/// Joins a command line with spaces for display, with secret-looking values
/// replaced by [`REDACTED`], then cut to at most `max_len` characters.
///
/// Command lines end up in metric labels, which anyone who can read Prometheus
/// can see, and people do pass tokens on the command line. Redacted:
/// - options whose name has a secret-looking word (`--password=x`,
///   `--token x`, `--api-key`, `--auth`, `-Dssl.keyStorePassword=x`); the
///   words are matched per `-`/`_`/`.`-separated part, so `--tokenizer` and
///   `--max-num-batched-tokens` keep their (useful) values;
/// - `KEY=value` arguments with a secret-looking key (`HF_TOKEN=`,
///   `AWS_SECRET_ACCESS_KEY=`, `DB_PASSWORD=`, `api_key=`);
/// - the password of URLs with userinfo (`postgres://user:<redacted>@host`).
///
/// A secret option without `=` redacts the next argument unless that looks
/// like an option itself (`--use-auth-token --model x` keeps `--model`).
/// Control characters become spaces so a label stays one line. The result,
/// including the trailing `…` that marks a cut, is at most `max_len`
/// characters (not bytes), so label size is bounded.
pub fn redact_cmdline(args: &[String], max_len: usize) -> String {
    let mut out = Vec::with_capacity(args.len());
    let mut value_expected = false;
    for arg in args {
        if std::mem::take(&mut value_expected) && !looks_like_option(arg) {
            out.push(REDACTED.to_owned());
            continue;
        }
        let (redacted, takes_value) = redact_arg(arg);
        value_expected = takes_value;
        out.push(redacted);
    }
    let joined: String = out
        .join(" ")
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate_chars(joined, max_len)
}

fn looks_like_option(arg: &str) -> bool {
    arg.len() > 1 && arg.starts_with('-')
}

/// Redacts one argument; the flag says whether the next argument is this
/// option's (secret) value.
fn redact_arg(arg: &str) -> (String, bool) {
    if let Some(option) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) {
        let prefix = &arg[..arg.len() - option.len()];
        match option.split_once('=') {
            Some((name, _)) if is_secret_name(name) => {
                return (format!("{prefix}{name}={REDACTED}"), false);
            }
            None if is_secret_name(option) => {
                let negated = option.starts_with("no-") || option.starts_with("no_");
                return (arg.to_owned(), !negated);
            }
            _ => {}
        }
    } else if let Some((key, _)) = arg.split_once('=')
        && is_secret_env_key(key)
    {
        return (format!("{key}={REDACTED}"), false);
    }
    (redact_url_passwords(arg), false)
}

fn name_parts(name: &str) -> Vec<String> {
    name.to_lowercase()
        .split(['-', '_', '.'])
        .filter(|part| !part.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether an option or key name looks like it holds a secret, judged per
/// separated part: `auth` must be a whole part (not `author`), the others may
/// end a part (`dbpassword`, `keystorepassword`, `hftoken`).
fn is_secret_name(name: &str) -> bool {
    const ENDINGS: [&str; 9] = [
        "password",
        "passwd",
        "secret",
        "secrets",
        "token",
        "credential",
        "credentials",
        "apikey",
        "accesskey",
    ];
    let parts = name_parts(name);
    let word = parts
        .iter()
        .any(|part| part == "auth" || ENDINGS.iter().any(|end| part.ends_with(end)));
    let pair = parts
        .windows(2)
        .any(|pair| matches!(pair[0].as_str(), "api" | "access" | "secret") && pair[1] == "key");
    word || pair
}

/// Whether the key of a `KEY=value` argument looks secret: a secret-looking
/// name, or one ending in `_KEY` / `_PASS` / `_PWD`. The key must look like an
/// identifier, so that `a/b?x=y` or `x y=z` are not mistaken for assignments.
fn is_secret_env_key(key: &str) -> bool {
    let identifier = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !identifier {
        return false;
    }
    let last_is_secret = name_parts(key)
        .last()
        .is_some_and(|last| matches!(last.as_str(), "key" | "pass" | "pwd"));
    is_secret_name(key) || last_is_secret
}

/// Replaces the password in every `scheme://user:password@host` of `s`. The
/// authority ends at `/`, `?`, `#`, `,` or whitespace; the LAST `@` in it ends
/// the userinfo, because unencoded passwords do contain `@`.
fn redact_url_passwords(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(scheme_end) = rest.find("://") {
        let authority_start = scheme_end + "://".len();
        out.push_str(&rest[..authority_start]);
        let after = &rest[authority_start..];
        let end = after
            .find(|c: char| matches!(c, '/' | '?' | '#' | ',') || c.is_whitespace())
            .unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rsplit_once('@') {
            Some((userinfo, host)) if userinfo.contains(':') => {
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                out.push_str(user);
                out.push(':');
                out.push_str(REDACTED);
                out.push('@');
                out.push_str(host);
            }
            _ => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// Cuts `s` to at most `max_len` characters, the last being `…` when cut.
fn truncate_chars(s: String, max_len: usize) -> String {
    if s.chars().count() <= max_len {
        return s;
    }
    if max_len == 0 {
        return String::new();
    }
    let cut = s
        .char_indices()
        .nth(max_len - 1)
        .map_or(s.len(), |(index, _)| index);
    let mut truncated = s[..cut].to_owned();
    truncated.push('…');
    truncated
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const ID: &str = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899";
    const NODE: &str = "aaaabbbbccccddddeeeeffff0000111122223333444455556666777788889999";
    const UID: &str = "7e6b1f2a-3c4d-4e5f-8a9b-0c1d2e3f4a5b";
    const UID_: &str = "7e6b1f2a_3c4d_4e5f_8a9b_0c1d2e3f4a5b";

    fn ident(
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
    fn fill(template: &str) -> String {
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
    fn runtime_labels() {
        let cases = [
            (Runtime::Docker, "docker"),
            (Runtime::Containerd, "containerd"),
            (Runtime::CriO, "cri-o"),
            (Runtime::Podman, "podman"),
        ];
        for (runtime, label) in cases {
            assert_eq!(runtime.as_str(), label);
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

    #[test]
    fn parse_stat_start_time_table() {
        let tail = "S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 123456 789 18446744073709551615";
        let cases: Vec<(&str, String, Option<u64>)> = vec![
            ("plain", format!("4242 (python3) {tail}"), Some(987654)),
            (
                "comm with spaces",
                format!("4242 (my proc) {tail}"),
                Some(987654),
            ),
            (
                "comm with parens",
                format!("4242 (my (weird) proc)) {tail}"),
                Some(987654),
            ),
            (
                "comm that mimics fields",
                format!("4242 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20) {tail}"),
                Some(987654),
            ),
            (
                "trailing newline",
                format!("4242 (a) {tail}\n"),
                Some(987654),
            ),
            ("truncated", "4242 (a) S 1 4242".to_owned(), None),
            ("empty", String::new(), None),
            ("no paren", tail.to_owned(), None),
            (
                "non-numeric start time",
                "1 (a) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 soon".to_owned(),
                None,
            ),
        ];
        for (name, input, expected) in cases {
            assert_eq!(parse_stat_start_time(&input), expected, "case {name:?}");
        }
    }

    #[test]
    fn parse_status_uid_table() {
        let cases = [
            (
                "normal",
                "Name:\tpython3\nState:\tS (sleeping)\nUid:\t1000\t1001\t1000\t1000\nGid:\t100\t100\t100\t100\n",
                Some(1000),
            ),
            ("root", "Uid:\t0\t0\t0\t0\n", Some(0)),
            ("spaces not tabs", "Uid:  42 42 42 42", Some(42)),
            ("missing", "Name:\tx\nGid:\t1\t1\t1\t1\n", None),
            ("empty uid line", "Uid:\n", None),
            ("non-numeric", "Uid:\tabc\t1\t1\t1\n", None),
            ("empty", "", None),
            ("indented key is not the key", " Uid:\t5\t5\t5\t5", None),
        ];
        for (name, input, expected) in cases {
            assert_eq!(parse_status_uid(input), expected, "case {name:?}");
        }
    }

    #[test]
    fn parse_cmdline_table() {
        let cases: Vec<(&str, &[u8], Vec<&str>)> = vec![
            (
                "normal",
                b"python3\0train.py\0--lr\x000.1\0",
                vec!["python3", "train.py", "--lr", "0.1"],
            ),
            ("empty (kernel thread)", b"", vec![]),
            ("only NULs", b"\0\0\0", vec![]),
            ("empty arg inside", b"a\0\0b\0", vec!["a", "", "b"]),
            ("no trailing NUL", b"a\0b", vec!["a", "b"]),
            (
                "setproctitle padding",
                b"nginx: worker process\0\0\0\0\0\0",
                vec!["nginx: worker process"],
            ),
            ("invalid utf-8", b"a\xff\0b\0", vec!["a\u{fffd}", "b"]),
        ];
        for (name, input, expected) in cases {
            assert_eq!(parse_cmdline(input), expected, "case {name:?}");
        }
    }

    /// A temporary directory removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "procfs-test-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn write(&self, relative: &str, content: &[u8]) {
            let path = self.0.join(relative);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn proc_root_reads_a_fake_proc() {
        let dir = TempDir::new();
        dir.write("4242/comm", b"my proc) x\n");
        dir.write(
            "4242/status",
            b"Name:\tmy proc) x\nUid:\t1000\t0\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\n",
        );
        dir.write(
            "4242/stat",
            b"4242 (my proc) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 123456 789\n",
        );
        dir.write(
            "4242/cgroup",
            fill("0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope\n")
                .as_bytes(),
        );
        dir.write("4242/cmdline", b"python3\0train.py\0--token\0abc\0");
        // A process whose files are unreadable garbage or empty.
        dir.write("7/comm", b"");
        dir.write("7/status", b"garbage");
        dir.write("7/stat", b"7 (x");
        dir.write("7/cmdline", b"");

        let proc = ProcRoot::new(&dir.0);
        assert_eq!(proc.path(), dir.0.as_path());
        assert!(proc.exists(4242));
        assert_eq!(proc.comm(4242).as_deref(), Some("my proc) x"));
        assert_eq!(proc.uid(4242), Some(1000));
        assert_eq!(proc.start_time(4242), Some(987654));
        let cgroup = proc.cgroup(4242).unwrap();
        assert_eq!(
            parse_cgroup(&cgroup),
            ident(Some(ID), Some(UID), Some(Runtime::Containerd), None)
        );
        let args = proc.cmdline(4242).unwrap();
        assert_eq!(args, ["python3", "train.py", "--token", "abc"]);
        assert_eq!(
            redact_cmdline(&args, 100),
            "python3 train.py --token <redacted>"
        );

        assert!(proc.exists(7));
        assert_eq!(proc.comm(7).as_deref(), Some(""));
        assert_eq!(proc.uid(7), None);
        assert_eq!(proc.start_time(7), None);
        assert_eq!(proc.cgroup(7), None);
        assert_eq!(proc.cmdline(7), Some(vec![]));

        // Gone (or never there).
        assert!(!proc.exists(99999));
        assert_eq!(proc.comm(99999), None);
        assert_eq!(proc.uid(99999), None);
        assert_eq!(proc.start_time(99999), None);
        assert_eq!(proc.cgroup(99999), None);
        assert_eq!(proc.cmdline(99999), None);

        // A plain file named like a pid is not a process directory.
        dir.write("31337", b"");
        assert!(!proc.exists(31337));
    }

    #[test]
    fn proc_root_defaults_to_proc() {
        assert_eq!(ProcRoot::default().path(), Path::new("/proc"));
    }

    #[test]
    fn parse_passwd_table() {
        type Case<'a> = (&'a str, &'a str, Vec<(u32, &'a str)>);
        let cases: Vec<Case<'_>> = vec![
            (
                "typical",
                "root:x:0:0:root:/root:/bin/bash\n\
                 daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
                 alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash\n",
                vec![(0, "root"), (1, "daemon"), (1000, "alice")],
            ),
            (
                "comments, blanks, CRLF",
                "# comment\n\n  \nbob:x:1001:1001::/home/bob:/bin/sh\r\n",
                vec![(1001, "bob")],
            ),
            (
                "malformed lines skipped",
                "nouid:x\n:x:5:5::/:/bin/sh\ncarol:x:notanumber:1::/:/bin/sh\n\
                 dave:x:-1:1::/:/bin/sh\nerin:x:4294967296:1::/:/bin/sh\nfrank:x:7:7\n",
                vec![(7, "frank")],
            ),
            (
                "NIS compat entries skipped",
                "+::::::\n-baduser:x:9:9::/:/bin/sh\n+@group:x:10:10::/:/bin/sh\n",
                vec![],
            ),
            (
                "duplicate uid: first wins",
                "toor:x:0:0::/root:/bin/sh\nroot:x:0:0::/root:/bin/sh\n",
                vec![(0, "toor")],
            ),
            (
                "max uid",
                "nobody4:x:4294967295:1::/:/bin/sh",
                vec![(4294967295, "nobody4")],
            ),
            ("empty", "", vec![]),
        ];
        for (name, input, expected) in cases {
            let expected: HashMap<u32, String> = expected
                .into_iter()
                .map(|(uid, name)| (uid, name.to_owned()))
                .collect();
            assert_eq!(parse_passwd(input), expected, "case {name:?}");
        }
    }

    #[test]
    fn user_names_reads_once_and_falls_back_to_uid() {
        let dir = TempDir::new();
        dir.write(
            "etc/passwd",
            b"root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n",
        );
        let users = UserNames::new(dir.0.join("etc/passwd"));
        assert_eq!(users.name(1000), "alice");
        assert_eq!(users.name(0), "root");
        assert_eq!(users.name(4242), "4242");

        // Loaded once: later edits are not seen.
        dir.write("etc/passwd", b"mallory:x:1000:1000::/:/bin/sh\n");
        assert_eq!(users.name(1000), "alice");

        let missing = UserNames::new(dir.0.join("does/not/exist"));
        assert_eq!(missing.name(0), "0");
        assert_eq!(missing.name(1000), "1000");

        let in_hand = UserNames::from_passwd("bob:x:1001:1001::/:/bin/sh");
        assert_eq!(in_hand.name(1001), "bob");
        assert_eq!(in_hand.name(1002), "1002");
    }

    #[test]
    fn redact_cmdline_table() {
        let cases: Vec<(&str, Vec<&str>, &str)> = vec![
            (
                "nothing to redact",
                vec!["python3", "train.py", "--lr", "0.1"],
                "python3 train.py --lr 0.1",
            ),
            ("empty", vec![], ""),
            // long options, inline value
            (
                "--password=",
                vec!["app", "--password=hunter2"],
                "app --password=<redacted>",
            ),
            (
                "--passwd=",
                vec!["app", "--passwd=hunter2"],
                "app --passwd=<redacted>",
            ),
            (
                "--token=",
                vec!["app", "--token=abc"],
                "app --token=<redacted>",
            ),
            (
                "--api-key=",
                vec!["app", "--api-key=abc"],
                "app --api-key=<redacted>",
            ),
            (
                "--api_key=",
                vec!["app", "--api_key=abc"],
                "app --api_key=<redacted>",
            ),
            (
                "--apikey=",
                vec!["app", "--apikey=abc"],
                "app --apikey=<redacted>",
            ),
            (
                "--secret=",
                vec!["app", "--secret=abc"],
                "app --secret=<redacted>",
            ),
            (
                "--client-secret=",
                vec!["app", "--client-secret=abc"],
                "app --client-secret=<redacted>",
            ),
            (
                "--auth=",
                vec!["app", "--auth=user:pw"],
                "app --auth=<redacted>",
            ),
            (
                "--access-key=",
                vec!["app", "--access-key=AKIA"],
                "app --access-key=<redacted>",
            ),
            (
                "--credentials=",
                vec!["app", "--credentials=abc"],
                "app --credentials=<redacted>",
            ),
            (
                "--hf-token=",
                vec!["app", "--hf-token=hf_abc"],
                "app --hf-token=<redacted>",
            ),
            (
                "--DB-PASSWORD= (case)",
                vec!["app", "--DB-PASSWORD=x"],
                "app --DB-PASSWORD=<redacted>",
            ),
            (
                "--password= empty value",
                vec!["app", "--password="],
                "app --password=<redacted>",
            ),
            // long options, separate value
            (
                "--password x",
                vec!["app", "--password", "hunter2", "-v"],
                "app --password <redacted> -v",
            ),
            (
                "--token x",
                vec!["app", "--token", "abc"],
                "app --token <redacted>",
            ),
            (
                "--api-key x",
                vec!["app", "--api-key", "abc", "serve"],
                "app --api-key <redacted> serve",
            ),
            ("secret option last", vec!["app", "--token"], "app --token"),
            (
                "flag-like secret option followed by option",
                vec!["run", "--use-auth-token", "--model", "llama"],
                "run --use-auth-token --model llama",
            ),
            (
                "negated flag takes no value",
                vec!["app", "--no-auth", "data.csv"],
                "app --no-auth data.csv",
            ),
            (
                "value '-' is redacted",
                vec!["app", "--password", "-"],
                "app --password <redacted>",
            ),
            // single-dash (Go flags, Java properties)
            (
                "-token=",
                vec!["app", "-token=abc"],
                "app -token=<redacted>",
            ),
            (
                "-token x",
                vec!["app", "-token", "abc"],
                "app -token <redacted>",
            ),
            (
                "java property",
                vec![
                    "java",
                    "-Djavax.net.ssl.keyStorePassword=changeit",
                    "-jar",
                    "x.jar",
                ],
                "java -Djavax.net.ssl.keyStorePassword=<redacted> -jar x.jar",
            ),
            // not secrets
            (
                "-p is ambiguous",
                vec!["ssh", "-p", "22", "host"],
                "ssh -p 22 host",
            ),
            (
                "--tokenizer keeps its value",
                vec!["vllm", "--tokenizer", "meta/llama"],
                "vllm --tokenizer meta/llama",
            ),
            (
                "--max-num-batched-tokens keeps its value",
                vec!["vllm", "--max-num-batched-tokens", "8192"],
                "vllm --max-num-batched-tokens 8192",
            ),
            (
                "--author keeps its value",
                vec!["app", "--author", "alice"],
                "app --author alice",
            ),
            (
                "--key is ambiguous",
                vec!["app", "--key", "tls.key"],
                "app --key tls.key",
            ),
            (
                "max_tokens=",
                vec!["app", "max_tokens=100"],
                "app max_tokens=100",
            ),
            (
                "KEY_PATH=",
                vec!["app", "KEY_PATH=/etc/k"],
                "app KEY_PATH=/etc/k",
            ),
            ("MONKEY=", vec!["app", "MONKEY=1"], "app MONKEY=1"),
            // env-style
            (
                "FOO_KEY=",
                vec!["env", "FOO_KEY=abc", "app"],
                "env FOO_KEY=<redacted> app",
            ),
            (
                "HF_TOKEN=",
                vec!["env", "HF_TOKEN=hf_abc"],
                "env HF_TOKEN=<redacted>",
            ),
            (
                "*_SECRET=",
                vec!["env", "CLIENT_SECRET=abc"],
                "env CLIENT_SECRET=<redacted>",
            ),
            (
                "*_PASSWORD=",
                vec!["env", "DB_PASSWORD=abc"],
                "env DB_PASSWORD=<redacted>",
            ),
            (
                "*_PASS=",
                vec!["env", "DB_PASS=abc"],
                "env DB_PASS=<redacted>",
            ),
            (
                "AWS_SECRET_ACCESS_KEY=",
                vec!["env", "AWS_SECRET_ACCESS_KEY=abc"],
                "env AWS_SECRET_ACCESS_KEY=<redacted>",
            ),
            (
                "SECRET_KEY_BASE=",
                vec!["env", "SECRET_KEY_BASE=abc"],
                "env SECRET_KEY_BASE=<redacted>",
            ),
            (
                "hydra override",
                vec!["python", "x.py", "model.api_key=abc"],
                "python x.py model.api_key=<redacted>",
            ),
            (
                "value containing '='",
                vec!["env", "TOKEN=a=b=c"],
                "env TOKEN=<redacted>",
            ),
            // URLs
            (
                "url with password",
                vec!["app", "postgres://user:hunter2@db:5432/x"],
                "app postgres://user:<redacted>@db:5432/x",
            ),
            (
                "url in option value",
                vec!["app", "--db-url=mysql://root:pw@localhost/db"],
                "app --db-url=mysql://root:<redacted>@localhost/db",
            ),
            (
                "url with user only",
                vec!["git", "clone", "https://user@host/r.git"],
                "git clone https://user@host/r.git",
            ),
            (
                "url without userinfo",
                vec!["curl", "https://host:8443/x?a=b"],
                "curl https://host:8443/x?a=b",
            ),
            (
                "password with @",
                vec!["app", "redis://:p@ss@cache:6379"],
                "app redis://:<redacted>@cache:6379",
            ),
            (
                "two urls in one arg",
                vec!["app", "--peers=http://a:1@h1,http://b:2@h2"],
                "app --peers=http://a:<redacted>@h1,http://b:<redacted>@h2",
            ),
            (
                "bare scheme separator",
                vec!["app", "://", "x://"],
                "app :// x://",
            ),
            // display hygiene
            (
                "control chars become spaces",
                vec!["a\nb", "c\td"],
                "a b c d",
            ),
        ];
        for (name, args, expected) in cases {
            let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
            assert_eq!(redact_cmdline(&args, 1000), expected, "case {name:?}");
        }
    }

    #[test]
    fn redact_cmdline_truncates_on_char_boundaries() {
        let args = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let cases: Vec<(Vec<String>, usize, &str)> = vec![
            (args(&["abc", "def"]), 7, "abc def"),
            (args(&["abc", "def"]), 100, "abc def"),
            (args(&["abc", "def"]), 6, "abc d…"),
            (args(&["abc", "def"]), 1, "…"),
            (args(&["abc", "def"]), 0, ""),
            (args(&[]), 0, ""),
            (args(&["日本語テキスト"]), 4, "日本語…"),
            (args(&["日本語"]), 3, "日本語"),
            (args(&["🎉🎉🎉🎉"]), 2, "🎉…"),
            (args(&["app", "--token=abcdef"]), 14, "app --token=<…"),
        ];
        for (args, max_len, expected) in cases {
            let got = redact_cmdline(&args, max_len);
            assert_eq!(got, expected, "args {args:?} max_len {max_len}");
            assert!(got.chars().count() <= max_len);
        }
    }
}
