//! Who a pid is: name and owner from /proc ([`procfs`], [`passwd`]),
//! container and pod from its cgroup ([`cgroup`]), its Slurm job from the
//! same path ([`slurm`]), the pod watcher's
//! index ([`crate::kube`]), container names from the engine's cache
//! ([`crate::containers`]) and an optional redacted command line
//! ([`redact`]). [`ProcCache`] puts them together for the sampler, cached
//! by (pid, start time). Identity only: what a process publishes about
//! itself (the torch bridge) is a source of its own ([`crate::bridge`]).
//!
//! Architecture invariant: **attribution comes only from what a tenant
//! cannot create.** A job, pod or container named by a process's cgroup
//! counts only when the names sit at their real place in the hierarchy
//! ([`cgroup`], [`slurm`]), every directory on the path belongs to root
//! ([`cgroupfs`]), a container id belongs to the pod UID of the same path
//! (`PodIndex::resolve`), and a Slurm job's owner is the process's real
//! uid (the kernel's `Uid:` line). A process that fails keeps its series
//! by pid without those labels; the refusal is counted by reason
//! (`gpumem_exporter_attribution_rejected_total`) and logged, rate-limited.

pub(crate) mod cgroup;
pub(crate) mod cgroupfs;
pub(crate) mod cgroupns;
pub(crate) mod liveness;
pub(crate) mod passwd;
pub(crate) mod procfs;
pub(crate) mod redact;
pub(crate) mod slurm;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::Attribution;
use crate::containers::ContainerCache;
use crate::kube::index::{PodIndex, PodLookup};
use crate::model::{AttributionRejections, ProcIdentity, SlurmJob, Stale};
use crate::ratelimit::LogLimiter;
use cgroupfs::{CgroupFs, Ownership};
use cgroupns::{Namespaces, OwnView};
use liveness::Liveness;
use passwd::UserNames;
use procfs::ProcRoot;

/// What the sampler learns about a pid from /proc (and the pod watcher).
/// Implementations cache by (pid, start time), so a tick reads one small
/// file per known process.
pub trait ProcessLookup {
    /// Name, owner, container and pod of `pid`; all empty when the process
    /// is gone or not visible (no host PID namespace).
    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity>;
    /// What this sample found of `pid` besides who it is: the start time
    /// at which `identify(pid)` found it in /proc (with the pid, the key a
    /// per-process reading such as the torch bridge's is kept by), and why
    /// it is stale, if it is.
    fn seen(&self, pid: u32) -> Seen;
    /// Called at the start of each full sample: a pid listed on several
    /// GPUs is checked against /proc once per sample, not once per GPU.
    fn begin_tick(&mut self) {}
    /// Called once per full tick with the pids still on some GPU, so the
    /// cache can drop the rest.
    fn retain(&mut self, live: &dyn Fn(u32) -> bool);
    /// Lookups of pids that were not visible in /proc, and attribution
    /// claims refused by reason, so far.
    fn counters(&self) -> (u64, AttributionRejections) {
        (0, AttributionRejections::default())
    }
}

/// What [`ProcessLookup::seen`] says of a pid in this sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    /// Its start time, when it is in /proc now.
    pub start: Option<u64>,
    /// Why it holds memory nobody uses, from the kernel and the API.
    pub stale: Option<Stale>,
}

pub(crate) use crate::config::DEFAULT_UNINTERRUPTIBLE_AFTER;

/// The owners of Slurm jobs as the job mapping knows them (the jobstats
/// layout's `<jobid> <uid>`), for the owner check of a job whose cgroup
/// path carries no uid (cgroup v2). Implemented by the job-mapping reader.
pub trait JobOwners: Send + Sync {
    /// The uids the mapping gives job `job`; empty when it gives none.
    fn owners(&self, job: &str) -> Vec<u32>;
    /// Whether the mapping lists job `job` now.
    fn knows(&self, job: &str) -> bool;
}

/// Why attribution refused what a cgroup path said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Rejection {
    CgroupOwner,
    CgroupUnverified,
    CgroupMisplaced,
    ContainerPodMismatch,
    SlurmOwner,
}

impl Rejection {
    fn label(self) -> &'static str {
        match self {
            Rejection::CgroupOwner => "cgroup_owner",
            Rejection::CgroupUnverified => "cgroup_unverified",
            Rejection::CgroupMisplaced => "cgroup_misplaced",
            Rejection::ContainerPodMismatch => "container_pod_mismatch",
            Rejection::SlurmOwner => "slurm_owner",
        }
    }

    fn count(self, into: &mut AttributionRejections) {
        let n = match self {
            Rejection::CgroupOwner => &mut into.cgroup_owner,
            Rejection::CgroupUnverified => &mut into.cgroup_unverified,
            Rejection::CgroupMisplaced => &mut into.cgroup_misplaced,
            Rejection::ContainerPodMismatch => &mut into.container_pod_mismatch,
            Rejection::SlurmOwner => &mut into.slurm_owner,
        };
        *n += 1;
    }
}

/// A refusal with what the log line says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    reason: Rejection,
    detail: String,
}

/// A cgroup path as a log line shows it: at most 256 characters.
fn shown(path: &str) -> String {
    path.chars().take(256).collect()
}

/// `refusal`, unless one of its reason is there already.
fn push(refused: &mut Vec<Refusal>, refusal: Refusal) {
    if !refused.iter().any(|r| r.reason == refusal.reason) {
        refused.push(refusal);
    }
}

/// What a process's cgroup says once checked: the identity that stands
/// and what was refused.
#[derive(Debug, Default)]
struct Vetted {
    cgroup: cgroup::CgroupIdentity,
    slurm: Option<slurm::SlurmCgroup>,
    refused: Vec<Refusal>,
    /// The job stands, but neither its path nor the job mapping named its
    /// owner yet: checked again once the mapping knows the job.
    owner_pending: bool,
}

/// What one read of `/proc/<pid>` found.
struct Read {
    ident: ProcIdentity,
    refused: Vec<Refusal>,
    /// The real uid, when the job's owner is still to be checked.
    owner_pending: Option<Option<u32>>,
}

/// /proc lookups cached by (pid, start time): a pid reused by a new process
/// gets fresh data; a known process costs one read of `/proc/<pid>/stat`.
/// Pod names come from the pod watcher's cache (never the API itself) and
/// are retried each tick until the watcher knows the pod.
pub struct ProcCache {
    root: ProcRoot,
    users: UserNames,
    pods: Option<Arc<PodIndex>>,
    /// Include the command line, redacted and cut to this many characters.
    cmdline_max: Option<usize>,
    entries: HashMap<u32, (u64, Arc<ProcIdentity>)>,
    /// Pids whose start time was checked in this full sample.
    checked: HashSet<u32>,
    unknown: Arc<ProcIdentity>,
    failures: u64,
    /// A pid hidden from /proc is logged once.
    hidden_warning: LogLimiter<()>,
    /// Container names from the engine's API (filled off this thread).
    engine: Option<Arc<ContainerCache>>,
    /// The owners of the directories on cgroup paths are checked here.
    cgroupfs: CgroupFs,
    /// Paths read from inside a cgroup namespace, made absolute in the
    /// tree at `cgroupfs`.
    namespaces: Namespaces,
    /// Slurm job owners from the job mapping, when it is read.
    job_owners: Option<Arc<dyn JobOwners>>,
    /// Refusals so far, by reason.
    rejected: AttributionRejections,
    /// Each reason is logged at most once a minute.
    rejection_log: LogLimiter<Rejection>,
    /// Processes whose Slurm job's owner no one named yet: (start time,
    /// real uid), checked against the job mapping each sample until it
    /// names the owner.
    owner_pending: HashMap<u32, (u64, Option<u32>)>,
    /// Whether each pid is alive and owned, from /proc and the sources.
    liveness: Liveness,
}

impl ProcCache {
    pub fn new(root: ProcRoot) -> Self {
        ProcCache {
            root,
            users: UserNames::new("/etc/passwd"),
            pods: None,
            cmdline_max: None,
            entries: HashMap::new(),
            checked: HashSet::new(),
            unknown: Arc::new(ProcIdentity::default()),
            failures: 0,
            hidden_warning: LogLimiter::once(),
            engine: None,
            cgroupfs: CgroupFs::new("/sys/fs/cgroup"),
            namespaces: Namespaces::new(CgroupFs::new("/sys/fs/cgroup"), None),
            job_owners: None,
            rejected: AttributionRejections::default(),
            rejection_log: LogLimiter::every(std::time::Duration::from_secs(60)),
            owner_pending: HashMap::new(),
            liveness: Liveness::new(DEFAULT_UNINTERRUPTIBLE_AFTER),
        }
    }

    /// Check the owners of cgroup directories under this cgroup
    /// filesystem root (`path.cgroupfs`).
    pub fn with_cgroupfs(mut self, root: impl Into<std::path::PathBuf>) -> Self {
        self.cgroupfs = CgroupFs::new(root);
        self.namespaces = Namespaces::new(self.cgroupfs.clone(), None);
        self
    }

    /// Read cgroup paths as the exporter `own` sees them (its pid and
    /// `/proc/self/cgroup`): where it runs in a cgroup namespace of its
    /// own, paths relative to that namespace are made absolute in the
    /// tree at `path.cgroupfs` ([`cgroupns`]). Call after
    /// [`ProcCache::with_cgroupfs`].
    pub(crate) fn with_own_view(mut self, own: Option<OwnView>) -> Self {
        self.namespaces = Namespaces::new(self.cgroupfs.clone(), own);
        self
    }

    /// Check the owners of Slurm jobs against the job mapping too.
    pub fn with_job_owners(mut self, owners: Arc<dyn JobOwners>) -> Self {
        self.job_owners = Some(owners);
        self
    }

    /// The lookup `cfg` asks for, resolving pods through `pods` when the
    /// pod watcher runs.
    pub fn from_config(cfg: &Attribution, pods: Option<Arc<PodIndex>>) -> Self {
        let mut cache = ProcCache::new(ProcRoot::new(&cfg.procfs))
            .with_users(UserNames::new(&cfg.passwd_file))
            .with_cgroupfs(&cfg.cgroupfs);
        // Who the exporter is, through the same procfs as its targets:
        // paths relative to its cgroup namespace are placed from there.
        match OwnView::read(std::path::Path::new(&cfg.procfs)) {
            Ok(own) => cache = cache.with_own_view(Some(own)),
            Err(why) => tracing::info!(
                why,
                "cgroup paths are taken as the kernel writes them: those relative to a cgroup namespace (/..) cannot be placed and are refused as cgroup_unverified"
            ),
        }
        if let Some(max) = cfg.cmdline {
            cache = cache.with_cmdline(max);
        }
        cache = cache.with_uninterruptible_after(cfg.uninterruptible_after);
        if let Some(p) = pods {
            cache = cache.with_pods(p);
        }
        cache
    }

    /// Map uids to names with this passwd file (e.g. the host's).
    pub fn with_users(mut self, users: UserNames) -> Self {
        self.users = users;
        self
    }

    /// Resolve pod UIDs and container ids through this pod index.
    pub fn with_pods(mut self, pods: Arc<PodIndex>) -> Self {
        self.pods = Some(pods);
        self
    }

    /// Name containers through this cache, which the lookup thread fills
    /// (`containers.engine_socket`).
    pub fn with_container_engine(mut self, cache: Arc<ContainerCache>) -> Self {
        self.engine = Some(cache);
        self
    }

    /// A process is `uninterruptible` after this long in `D`.
    pub fn with_uninterruptible_after(mut self, after: std::time::Duration) -> Self {
        self.liveness = Liveness::new(after);
        self
    }

    /// Add the (redacted, truncated) command line to identities.
    pub fn with_cmdline(mut self, max_len: usize) -> Self {
        self.cmdline_max = Some(max_len);
        self
    }

    /// What `text` (a `/proc/<pid>/cgroup`) says about a process of real
    /// uid `uid`, once checked: names only at their real place, on a path
    /// of root-owned directories, a Slurm job only of its owner.
    fn vet(&self, text: &str, uid: Option<u32>) -> Vetted {
        let mut refused: Vec<Refusal> = Vec::new();
        // A path still relative to a cgroup namespace (not placed by
        // `cgroupns`) cannot be placed.
        let other_namespace = cgroup::lines(text).any(|l| l.path.split('/').any(|s| s == ".."));
        let cgroupfs = &self.cgroupfs;
        // Whether the owners of `line`'s directories let it count; the
        // refusal is pushed when not.
        let owned_by_root = |line: cgroup::CgroupLine<'_>, refused: &mut Vec<Refusal>| {
            let refusal = match cgroupfs.check(line) {
                Ownership::Trusted => return true,
                Ownership::Delegated { uid } => Refusal {
                    reason: Rejection::CgroupOwner,
                    detail: format!("{}: a directory owned by uid {uid}", shown(line.path)),
                },
                Ownership::Unverified(why) => Refusal {
                    reason: Rejection::CgroupUnverified,
                    detail: format!(
                        "{}: not checkable ({why:?}) under {}",
                        shown(line.path),
                        cgroupfs.path().display()
                    ),
                },
            };
            push(refused, refusal);
            false
        };
        // A name out of place: counted as the owner's where a user owns
        // the directory, else as misplaced.
        let out_of_place =
            |line: cgroup::CgroupLine<'_>, what: &str, refused: &mut Vec<Refusal>| {
                if matches!(cgroupfs.check(line), Ownership::Delegated { .. }) {
                    owned_by_root(line, refused);
                    return;
                }
                let reason = if other_namespace {
                    Rejection::CgroupUnverified
                } else {
                    Rejection::CgroupMisplaced
                };
                push(
                    refused,
                    Refusal {
                        reason,
                        detail: format!("{}: {what} named out of its place", shown(line.path)),
                    },
                );
            };

        let parsed = cgroup::parse_cgroup_lines(text);
        let mut cg = parsed.identity;
        if let Some(line) = parsed.line.filter(|_| cg.names_workload()) {
            if !owned_by_root(line, &mut refused) {
                cg = cgroup::CgroupIdentity::default();
            }
        } else if let Some(line) = parsed.misplaced_line {
            out_of_place(line, "a pod or container", &mut refused);
        }

        let parsed = slurm::parse_slurm_cgroup_lines(text);
        let mut job = parsed.job;
        let mut owner_pending = false;
        if let (Some(j), Some(line)) = (&job, parsed.line) {
            let mut ok = owned_by_root(line, &mut refused);
            let mut owners: Vec<u32> = j.uid.iter().filter_map(|u| u.parse().ok()).collect();
            if let Some(mapping) = &self.job_owners {
                owners.extend(mapping.owners(&j.job));
            }
            if ok && let Some(o) = owners.iter().find(|o| Some(**o) != uid) {
                let runs_as = uid.map_or_else(|| "unknown".into(), |u| u.to_string());
                push(
                    &mut refused,
                    Refusal {
                        reason: Rejection::SlurmOwner,
                        detail: format!(
                            "job {} belongs to uid {o}, the process runs as uid {runs_as}",
                            j.job
                        ),
                    },
                );
                ok = false;
            }
            owner_pending = ok && owners.is_empty() && self.job_owners.is_some();
            if !ok {
                job = None;
            }
        } else if let Some(line) = parsed.misplaced_line {
            out_of_place(line, "a Slurm job", &mut refused);
        }
        Vetted {
            cgroup: cg,
            slurm: job,
            refused,
            owner_pending,
        }
    }

    /// The cgroup v2 path of a `/proc/<pid>/cgroup`, where every directory
    /// on it is root's: the cgroup-keyed limits are asked about it alone,
    /// so a tenant's own (delegated) cgroup gets no limit from them.
    fn trusted_v2_path(&self, text: &str) -> Option<Arc<str>> {
        let line = cgroup::lines(text).find(|l| l.controllers.is_empty())?;
        let path = line.path.trim();
        (path.starts_with('/') && self.cgroupfs.check(line) == Ownership::Trusted)
            .then(|| Arc::from(path))
    }

    fn read(&mut self, pid: u32) -> Read {
        let s = |v: String| -> Arc<str> { Arc::from(v) };
        let uid = self.root.uid(pid);
        let text = self.cgroup(pid);
        let vetted = text
            .as_deref()
            .map(|text| self.vet(text, uid))
            .unwrap_or_default();
        let own_cgroup = text.as_deref().and_then(|t| self.trusted_v2_path(t));
        let cg = vetted.cgroup;
        let slurm = vetted.slurm.map(|j| SlurmJob {
            job: Arc::from(j.job),
            step: Arc::from(j.step.unwrap_or_default()),
            uid: Arc::from(j.uid.unwrap_or_default()),
        });
        let ident = ProcIdentity {
            comm: s(self.root.comm(pid).unwrap_or_default()),
            user: s(uid.map(|u| self.users.name(u)).unwrap_or_default()),
            container_id: s(cg.container_id.unwrap_or_default()),
            pod_uid: s(cg.pod_uid.unwrap_or_default()),
            slurm,
            cmdline: self.cmdline_max.map(|max| {
                let args = self.root.cmdline(pid).unwrap_or_default();
                s(redact::redact_cmdline(&args, max))
            }),
            namespace: Arc::from(""),
            pod: Arc::from(""),
            container: Arc::from(""),
            engine: None,
            start_time: None,
            cgroup: own_cgroup,
        };
        Read {
            ident,
            refused: vetted.refused,
            owner_pending: vetted.owner_pending.then_some(uid),
        }
    }

    /// The owner check of a job whose owner no one had named when `pid`
    /// was first seen, now that the job mapping may know it: a changed
    /// identity (the job dropped, the refusal counted) when it names
    /// another uid. Job ids are not reused and the mapping is root's, so
    /// once the mapping has named the owner the check is final.
    fn recheck_owner(
        &mut self,
        pid: u32,
        start: u64,
        ident: &ProcIdentity,
    ) -> Option<Arc<ProcIdentity>> {
        let (at, uid) = *self.owner_pending.get(&pid)?;
        if at != start {
            self.owner_pending.remove(&pid);
            return None;
        }
        let job = ident.slurm.as_ref()?;
        let owners = self.job_owners.as_ref()?.owners(&job.job);
        if owners.is_empty() {
            return None;
        }
        self.owner_pending.remove(&pid);
        let other = *owners.iter().find(|o| Some(**o) != uid)?;
        let runs_as = uid.map_or_else(|| "unknown".into(), |u| u.to_string());
        self.record(
            pid,
            &[Refusal {
                reason: Rejection::SlurmOwner,
                detail: format!(
                    "job {} belongs to uid {other} (job mapping, read after the process was first seen), the process runs as uid {runs_as}",
                    job.job
                ),
            }],
        );
        let mut updated = ProcIdentity::clone(ident);
        updated.slurm = None;
        let updated = Arc::new(updated);
        self.entries.insert(pid, (start, Arc::clone(&updated)));
        Some(updated)
    }

    /// `/proc/<pid>/cgroup` with paths relative to the exporter's cgroup
    /// namespace made absolute where the kernel vouches for them; read a
    /// second time when a path failed that check (the process may have
    /// moved between the two reads).
    fn cgroup(&mut self, pid: u32) -> Option<String> {
        let text = self.root.cgroup(pid)?;
        let (abs, failed) = self.namespaces.absolute(&text, pid);
        if !failed {
            return Some(abs.into_owned());
        }
        let text = self.root.cgroup(pid)?;
        Some(self.namespaces.absolute(&text, pid).0.into_owned())
    }

    /// Count and log what was refused about `pid`.
    fn record(&mut self, pid: u32, refused: &[Refusal]) {
        for r in refused {
            r.reason.count(&mut self.rejected);
            if let Some(suppressed) = self.rejection_log.check(r.reason) {
                tracing::warn!(
                    pid,
                    reason = r.reason.label(),
                    detail = %r.detail,
                    suppressed,
                    "attribution refused what a process's cgroup claims: its series keep the pid without job or pod labels. Counted in gpumem_exporter_attribution_rejected_total; logged at most once a minute per reason"
                );
            }
        }
    }

    /// Whether the engine is asked about this process: it is in a
    /// container, and Kubernetes does not know it — its pod is not
    /// resolved and, while the pod watcher runs, its cgroup names no pod
    /// (the watcher will).
    fn wants_engine(&self, ident: &ProcIdentity) -> bool {
        self.engine.is_some()
            && ident.engine.is_none()
            && !ident.container_id.is_empty()
            && ident.pod.is_empty()
            && (self.pods.is_none() || ident.pod_uid.is_empty())
    }

    /// Fill the container's name, image and compose labels from the
    /// engine cache, if it has them (a miss is queued for the lookup
    /// thread; a later tick tries again).
    fn resolve_engine(&self, ident: &mut ProcIdentity) -> bool {
        if !self.wants_engine(ident) {
            return false;
        }
        let Some(info) = self
            .engine
            .as_ref()
            .and_then(|e| e.get(&ident.container_id))
        else {
            return false;
        };
        ident.engine = Some(info);
        true
    }

    /// Fill namespace/pod/container from the pod index, if it knows them.
    /// A container id that belongs to another pod than the path's (or to
    /// a pod while the path names none) is refused: the container id and
    /// pod UID are cleared, and the refusal returned. `true` when the
    /// identity changed.
    fn resolve_pod(&self, pid: u32, ident: &mut ProcIdentity) -> (bool, Option<Refusal>) {
        let Some(pods) = &self.pods else {
            return (false, None);
        };
        let uid = (!ident.pod_uid.is_empty()).then_some(&*ident.pod_uid);
        let cid = (!ident.container_id.is_empty()).then_some(&*ident.container_id);
        if uid.is_none() && cid.is_none() {
            return (false, None);
        }
        match pods.resolve(uid, cid) {
            PodLookup::Found(r) => {
                ident.namespace = Arc::from(r.namespace);
                ident.pod = Arc::from(r.pod);
                ident.container = Arc::from(r.container);
                // Kubernetes wins over the container engine.
                ident.engine = None;
                (true, None)
            }
            PodLookup::Unknown => (false, None),
            PodLookup::Mismatch { owner } => {
                let detail = format!(
                    "pid {pid}: container {} belongs to pod {owner}, the cgroup path names pod {}",
                    ident.container_id,
                    if ident.pod_uid.is_empty() {
                        "none"
                    } else {
                        &ident.pod_uid
                    }
                );
                ident.container_id = Arc::from("");
                ident.pod_uid = Arc::from("");
                ident.engine = None;
                (
                    true,
                    Some(Refusal {
                        reason: Rejection::ContainerPodMismatch,
                        detail,
                    }),
                )
            }
        }
    }
}

impl ProcessLookup for ProcCache {
    fn begin_tick(&mut self) {
        self.checked.clear();
    }

    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity> {
        // Already checked in this sample (the pid is on another GPU too)
        // and resolved: no second read of /proc.
        let again = self.checked.contains(&pid);
        if again
            && let Some((_, ident)) = self.entries.get(&pid)
            && (self.pods.is_none() || !ident.pod.is_empty())
            && !self.wants_engine(ident)
        {
            return Arc::clone(ident);
        }
        let wall = std::time::SystemTime::now();
        let Some(stat) = self.root.stat(pid) else {
            // Gone, or hidden because we do not share the host's PID
            // namespace: the bytes are still exported by pid, under the
            // identity it had when it was last seen alive, if it was.
            self.entries.remove(&pid);
            self.failures += 1;
            let last = if again {
                self.liveness.last_identity(pid)
            } else {
                self.checked.insert(pid);
                self.liveness.missing(pid, wall)
            };
            if let Some(ident) = last {
                return ident;
            }
            if self.hidden_warning.check(()).is_some() {
                tracing::warn!(
                    pid,
                    procfs = %self.root.path().display(),
                    "a pid reported by NVML is not visible in /proc: process names, users and pods cannot be resolved (run with hostPID: true, or point path.procfs at the host's /proc); memory is still exported by pid. Counted in gpumem_exporter_process_lookup_failures_total; this is logged once"
                );
            }
            return Arc::clone(&self.unknown);
        };
        self.checked.insert(pid);
        let ident = self.identify_alive(pid, stat.start);
        if !again {
            self.liveness
                .alive(pid, &stat, &ident, std::time::Instant::now(), wall);
            let owner = self.owner_state(&ident);
            self.liveness.owner(pid, owner, wall);
        }
        ident
    }

    fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.liveness.retain(live);
        self.retain_entries(live);
    }

    fn seen(&self, pid: u32) -> Seen {
        // Only what identify() found in this sample.
        if !self.checked.contains(&pid) {
            return Seen::default();
        }
        Seen {
            start: self.entries.get(&pid).map(|(start, _)| *start),
            stale: self.liveness.stale(pid, std::time::Instant::now()),
        }
    }

    fn counters(&self) -> (u64, AttributionRejections) {
        (self.failures, self.rejected)
    }
}

impl ProcCache {
    /// Who `pid`, found in /proc with start time `start`, is: from the
    /// cache when it holds that very process and its pod (or container
    /// name) is settled, else read and resolved.
    fn identify_alive(&mut self, pid: u32, start: u64) -> Arc<ProcIdentity> {
        if let Some((s, ident)) = self.entries.get(&pid).map(|(s, i)| (*s, Arc::clone(i)))
            && s == start
        {
            let ident = &self.recheck_owner(pid, start, &ident).unwrap_or(ident);
            let pod_settled = !ident.pod.is_empty()
                || self.pods.is_none()
                || (ident.pod_uid.is_empty() && ident.container_id.is_empty());
            if pod_settled && !self.wants_engine(ident) {
                return Arc::clone(ident);
            }
            // Known process, pod (or container name) not resolved yet: try
            // the index (and the engine cache) again.
            let mut updated = ProcIdentity::clone(ident);
            let (pod, refused) = if pod_settled {
                (false, None)
            } else {
                self.resolve_pod(pid, &mut updated)
            };
            if let Some(r) = refused {
                self.record(pid, &[r]);
            }
            if pod | self.resolve_engine(&mut updated) {
                let updated = Arc::new(updated);
                self.entries.insert(pid, (start, Arc::clone(&updated)));
                return updated;
            }
            return Arc::clone(ident);
        }
        let Read {
            mut ident,
            mut refused,
            owner_pending,
        } = self.read(pid);
        match owner_pending {
            Some(uid) => {
                self.owner_pending.insert(pid, (start, uid));
            }
            None => {
                self.owner_pending.remove(&pid);
            }
        }
        ident.start_time = Some(start);
        if let (_, Some(r)) = self.resolve_pod(pid, &mut ident) {
            refused.push(r);
        }
        self.record(pid, &refused);
        self.resolve_engine(&mut ident);
        let ident = Arc::new(ident);
        self.entries.insert(pid, (start, Arc::clone(&ident)));
        ident
    }

    /// What the sources say of `ident`'s owners now: whether its pod is a
    /// tombstone of the pod watcher, and whether the job mapping lists its
    /// Slurm job (`None`: no job, or no mapping).
    fn owner_state(&self, ident: &ProcIdentity) -> liveness::Owner {
        liveness::Owner {
            pod_deleted: !ident.pod_uid.is_empty()
                && self
                    .pods
                    .as_ref()
                    .is_some_and(|p| p.is_deleted(&ident.pod_uid)),
            job_listed: match (&ident.slurm, &self.job_owners) {
                (Some(job), Some(map)) => Some(map.knows(&job.job)),
                _ => None,
            },
        }
    }

    fn retain_entries(&mut self, live: &dyn Fn(u32) -> bool) {
        self.entries.retain(|pid, _| live(*pid));
        self.owner_pending.retain(|pid, _| live(*pid));
        if let Some(engine) = &self.engine {
            let ids: HashSet<&str> = self
                .entries
                .values()
                .map(|(_, i)| &*i.container_id)
                .filter(|id| !id.is_empty())
                .collect();
            engine.retain(&|id| ids.contains(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The directories of a `/proc/<pid>/cgroup` under a fake cgroup
    /// filesystem at `<root>/cgroupfs` (hybrid: v2 at `unified/`), owned by
    /// whoever runs the test, like the hierarchy's top.
    fn cgroup_dirs(root: &std::path::Path, text: &str) {
        for line in cgroup::lines(text) {
            let hierarchy = match line.controllers {
                "" => "unified",
                c => c.strip_prefix("name=").unwrap_or(c),
            };
            let path = line.path.trim().trim_start_matches('/');
            if path.split('/').any(|s| s == "..") {
                continue;
            }
            std::fs::create_dir_all(root.join("cgroupfs").join(hierarchy).join(path)).unwrap();
        }
    }

    /// The Slurm job, step and uid come from the same cgroup file as the
    /// container; a process in no job has none.
    #[test]
    fn proc_cache_reads_the_slurm_job_from_the_cgroup() {
        let root = tempfile::tempdir().unwrap();
        for (pid, cgroup) in [
            (
                42,
                "7:freezer:/slurm_gpu1/uid_1000/job_77/step_batch\n1:name=systemd:/system.slice/slurmd.service\n",
            ),
            (43, "0::/user.slice/user-1000.slice/session-1.scope\n"),
        ] {
            let dir = root.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("comm"), "python3\n").unwrap();
            std::fs::write(
                dir.join("stat"),
                format!("{pid} (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777\n"),
            )
            .unwrap();
            std::fs::write(dir.join("status"), "Uid:\t1000\t1000\t1000\t1000\n").unwrap();
            std::fs::write(dir.join("cgroup"), cgroup).unwrap();
            cgroup_dirs(root.path(), cgroup);
        }
        let mut cache =
            ProcCache::new(ProcRoot::new(root.path())).with_cgroupfs(root.path().join("cgroupfs"));
        cache.begin_tick();
        assert_eq!(
            cache.identify(42).slurm,
            Some(SlurmJob {
                job: Arc::from("77"),
                step: Arc::from("batch"),
                uid: Arc::from("1000"),
            })
        );
        assert_eq!(cache.identify(43).slurm, None);
    }

    /// A pid on several GPUs is read from /proc once per full sample, and
    /// checked again (start time) in the next one.
    #[test]
    fn proc_cache_reads_a_pid_once_per_sample() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("42");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), "trainer\n").unwrap();
        std::fs::write(
            dir.join("stat"),
            "42 (trainer) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777\n",
        )
        .unwrap();
        std::fs::write(dir.join("status"), "Uid:\t0\t0\t0\t0\n").unwrap();
        let mut cache = ProcCache::new(ProcRoot::new(root.path()));
        cache.begin_tick();
        assert_eq!(&*cache.identify(42).comm, "trainer");
        // Gone from /proc mid-sample: the second GPU's lookup is not a read.
        std::fs::remove_file(dir.join("stat")).unwrap();
        assert_eq!(&*cache.identify(42).comm, "trainer");
        assert_eq!(cache.counters().0, 0);
        // The next sample checks the start time again and finds it gone:
        // a failed lookup, under the identity it had when last seen.
        cache.begin_tick();
        assert_eq!(&*cache.identify(42).comm, "trainer");
        assert_eq!(cache.counters().0, 1);
        assert_eq!(cache.seen(42).stale, None, "one missing sample");
        cache.begin_tick();
        cache.identify(42);
        assert_eq!(
            cache.seen(42).stale.map(|s| s.reason),
            Some(crate::model::StaleReason::Exited)
        );
        // Never seen alive: unknown, never exited.
        cache.begin_tick();
        assert_eq!(&*cache.identify(43).comm, "");
        cache.begin_tick();
        cache.identify(43);
        assert_eq!(cache.seen(43).stale, None);
    }

    fn write_proc(root: &std::path::Path, pid: u32, cgroup: &str) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), "trainer\n").unwrap();
        std::fs::write(
            dir.join("stat"),
            format!("{pid} (trainer) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777\n"),
        )
        .unwrap();
        std::fs::write(dir.join("status"), "Uid:\t0\t0\t0\t0\n").unwrap();
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
        cgroup_dirs(root, cgroup);
    }

    /// A Podman container is named from the engine cache once the lookup
    /// thread answered; a process Kubernetes knows is never asked about,
    /// and an engine name gives way when its pod becomes known.
    #[test]
    fn engine_names_fill_in_later_and_kubernetes_wins() {
        use crate::containers::cache::Outcome;
        use crate::model::ContainerInfo;
        let root = tempfile::tempdir().unwrap();
        let plain = "c".repeat(64);
        let in_pod = "d".repeat(64);
        let pod_uid = "0b6e2f51-3c1d-4a8e-9f7b-2d4c6e8a0b1c";
        write_proc(
            root.path(),
            10,
            &format!("0::/libpod_parent/libpod-{plain}\n"),
        );
        write_proc(
            root.path(),
            11,
            &format!(
                "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{in_pod}.scope\n",
                pod_uid.replace('-', "_")
            ),
        );
        let pods = Arc::new(PodIndex::new());
        let (engine, mut queue) = ContainerCache::with_limits(8, 8);
        let mut cache = ProcCache::new(ProcRoot::new(root.path()))
            .with_cgroupfs(root.path().join("cgroupfs"))
            .with_pods(Arc::clone(&pods))
            .with_container_engine(Arc::clone(&engine));
        cache.begin_tick();
        assert!(cache.identify(10).engine.is_none());
        assert!(cache.identify(11).engine.is_none());
        // Only the container outside Kubernetes is asked about.
        assert_eq!(queue.try_recv().as_deref().ok(), Some(plain.as_str()));
        assert!(queue.try_recv().is_err(), "a pod's container was queued");
        engine.complete(
            &plain,
            Outcome::Found(ContainerInfo {
                name: Arc::from("trainer-a"),
                ..ContainerInfo::default()
            }),
        );
        cache.begin_tick();
        assert_eq!(
            cache.identify(10).engine.as_deref().map(|c| &*c.name),
            Some("trainer-a")
        );
        // Pod 11's container becomes known to Kubernetes: its pod's
        // names, no engine labels.
        pods.insert(pod_uid, &[("trainer", &in_pod)], "ml", "trainer-0");
        cache.begin_tick();
        let ident = cache.identify(11);
        assert_eq!(&*ident.pod, "trainer-0");
        assert_eq!(&*ident.container, "trainer");
        assert!(ident.engine.is_none(), "{ident:?}");
        assert_eq!(engine.lookups().found, 1);
        assert_eq!(cache.counters().1, AttributionRejections::default());
    }

    /// What a tenant can forge about itself names no job and no pod: a
    /// Slurm path out of place, a job of another uid, a container id of
    /// another pod; each process keeps its name and is counted once per
    /// reason, also over later ticks.
    #[test]
    fn forged_cgroups_are_refused_and_counted() {
        let root = tempfile::tempdir().unwrap();
        let victim_pod = "0b6e2f51-3c1d-4a8e-9f7b-2d4c6e8a0b1c";
        let own_pod = "1c7f3062-4d2e-4b9f-8a8c-3e5d7f9b1c2d";
        let victim_id = "e".repeat(64);
        let forged = [
            // A Slurm job in a user's own subtree.
            (20, "0::/user.slice/user-0.slice/user@0.service/app.slice/slurmstepd.scope/job_4242/step_0\n".to_string()),
            // A real-looking v1 job of uid 1000 for a root process.
            (21, "4:freezer:/slurm/uid_1000/job_4243/step_0\n".to_string()),
            // Its own pod's path with another pod's container id.
            (
                22,
                format!(
                    "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{victim_id}.scope\n",
                    own_pod.replace('-', "_")
                ),
            ),
            // The victim's pod slice with no directory behind it.
            (23, format!("0::/kubepods/pod{victim_pod}/{victim_id}\n")),
        ];
        for (pid, cgroup) in &forged {
            write_proc(root.path(), *pid, cgroup);
        }
        // Pid 23's cgroup was never made.
        std::fs::remove_dir_all(root.path().join("cgroupfs/unified/kubepods")).unwrap();
        let pods = Arc::new(PodIndex::new());
        pods.insert(victim_pod, &[("victim", &victim_id)], "team-b", "victim-0");
        pods.insert(own_pod, &[], "team-a", "mine-0");
        let mut cache = ProcCache::new(ProcRoot::new(root.path()))
            .with_cgroupfs(root.path().join("cgroupfs"))
            .with_pods(pods);
        for _ in 0..3 {
            cache.begin_tick();
            for (pid, _) in &forged {
                let ident = cache.identify(*pid);
                assert_eq!(&*ident.comm, "trainer");
                assert_eq!(ident.slurm, None, "pid {pid}");
                assert!(
                    ident.pod_uid.is_empty()
                        && ident.container_id.is_empty()
                        && ident.pod.is_empty(),
                    "pid {pid}: {ident:?}"
                );
            }
        }
        assert_eq!(
            cache.counters().1,
            AttributionRejections {
                cgroup_misplaced: 1,
                slurm_owner: 1,
                container_pod_mismatch: 1,
                cgroup_unverified: 1,
                ..AttributionRejections::default()
            }
        );
    }

    /// The job mapping's uid is the owner of a job whose path names none.
    #[test]
    fn a_job_of_another_uid_in_the_mapping_is_refused() {
        struct Owners;
        impl JobOwners for Owners {
            fn owners(&self, job: &str) -> Vec<u32> {
                if job == "77" { vec![1000] } else { Vec::new() }
            }
            fn knows(&self, _job: &str) -> bool {
                true
            }
        }
        let root = tempfile::tempdir().unwrap();
        // Root's processes (write_proc): job 77 is uid 1000's, 78 unknown.
        write_proc(
            root.path(),
            30,
            "0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n",
        );
        write_proc(
            root.path(),
            31,
            "0::/system.slice/slurmstepd.scope/job_78/step_0/user/task_0\n",
        );
        let mut cache = ProcCache::new(ProcRoot::new(root.path()))
            .with_cgroupfs(root.path().join("cgroupfs"))
            .with_job_owners(Arc::new(Owners));
        cache.begin_tick();
        assert_eq!(cache.identify(30).slurm, None);
        assert_eq!(
            cache.identify(31).slurm.as_ref().map(|j| &*j.job),
            Some("78")
        );
        assert_eq!(cache.counters().1.slurm_owner, 1);
    }

    /// A job the mapping did not know when its process was first seen is
    /// checked again once the mapping names its owner: refused (and
    /// counted once) when that is another uid, kept when it is the
    /// process's own; nothing read again from /proc for it.
    #[test]
    fn a_job_the_mapping_learns_later_is_checked_then() {
        use std::sync::Mutex;
        #[derive(Default)]
        struct Owners(Mutex<HashMap<String, u32>>);
        impl JobOwners for Owners {
            fn owners(&self, job: &str) -> Vec<u32> {
                self.0
                    .lock()
                    .unwrap()
                    .get(job)
                    .into_iter()
                    .copied()
                    .collect()
            }
            fn knows(&self, _job: &str) -> bool {
                true
            }
        }
        let root = tempfile::tempdir().unwrap();
        // Root's processes: job 90 will be uid 1000's, 91 root's own.
        for (pid, job) in [(40, 90), (41, 91)] {
            write_proc(
                root.path(),
                pid,
                &format!("0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n"),
            );
        }
        let owners = Arc::new(Owners::default());
        let mut cache = ProcCache::new(ProcRoot::new(root.path()))
            .with_cgroupfs(root.path().join("cgroupfs"))
            .with_job_owners(Arc::clone(&owners) as Arc<dyn JobOwners>);
        let jobs = |cache: &mut ProcCache| {
            cache.begin_tick();
            [40, 41].map(|pid| {
                cache
                    .identify(pid)
                    .slurm
                    .as_ref()
                    .map(|j| j.job.to_string())
            })
        };
        let both = [Some("90".to_string()), Some("91".to_string())];
        assert_eq!(jobs(&mut cache), both);
        assert_eq!(jobs(&mut cache), both);
        owners
            .0
            .lock()
            .unwrap()
            .extend([("90".to_string(), 1000), ("91".to_string(), 0)]);
        // The cgroup files go: the later checks read nothing of them.
        for pid in [40, 41] {
            std::fs::remove_file(root.path().join(format!("{pid}/cgroup"))).unwrap();
        }
        for _ in 0..3 {
            assert_eq!(jobs(&mut cache), [None, Some("91".to_string())]);
        }
        assert_eq!(cache.counters().1.slurm_owner, 1);
        assert!(cache.owner_pending.is_empty());
    }
}
