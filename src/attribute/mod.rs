//! Who a pid is: name and owner from /proc ([`procfs`], [`passwd`]),
//! container and pod from its cgroup ([`cgroup`]), its Slurm job from the
//! same path ([`slurm`]), the pod watcher's
//! index ([`crate::kube`]), container names from the engine's API
//! ([`containers`]), an optional redacted command line ([`redact`]), and the
//! PyTorch allocator figures the process publishes itself ([`torch`]).
//! [`ProcCache`] puts them together for the sampler, cached by (pid, start
//! time).

pub(crate) mod cgroup;
pub(crate) mod containers;
pub(crate) mod passwd;
pub(crate) mod procfs;
pub(crate) mod redact;
pub(crate) mod slurm;
pub(crate) mod torch;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::Attribution;
use crate::kube::index::PodIndex;
use crate::model::{
    ContainerLookups, KubeState, ProcIdentity, SlurmJob, TorchCounters, TorchStats,
};
use crate::ratelimit::LogLimiter;
use containers::ContainerCache;
use passwd::UserNames;
use procfs::ProcRoot;
use torch::TorchReader;

/// What the sampler learns about a pid from /proc (and the pod watcher).
/// Implementations cache by (pid, start time), so a tick reads one small
/// file per known process.
pub trait ProcessLookup {
    /// Name, owner, container and pod of `pid`; all empty when the process
    /// is gone or not visible (no host PID namespace).
    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity>;
    /// Called at the start of each full sample: a pid listed on several
    /// GPUs is checked against /proc once per sample, not once per GPU.
    fn begin_tick(&mut self) {}
    /// Called once per full tick with the pids still on some GPU, so the
    /// cache can drop the rest.
    fn retain(&mut self, live: &dyn Fn(u32) -> bool);
    /// Lookups of pids that were not visible in /proc, so far.
    fn failures(&self) -> u64 {
        0
    }
    /// The pod watcher's state, when one feeds this lookup.
    fn kubernetes(&self) -> Option<KubeState> {
        None
    }
    /// PyTorch allocator figures `pid` itself published (torch bridge) for
    /// the device named by `uuids` (its MIG instance's UUID first, then the
    /// GPU's). Called after `identify(pid)` in the same tick; a process's
    /// document is read at most once per tick, and `retain` ends the tick.
    fn torch(&mut self, _pid: u32, _uuids: &[&str]) -> Option<TorchStats> {
        None
    }
    /// Torch bridge documents accepted and dropped, when the bridge is on.
    fn torch_counters(&self) -> Option<TorchCounters> {
        None
    }
    /// Container engine lookups, when `containers.engine_socket` is set.
    fn container_lookups(&self) -> Option<ContainerLookups> {
        None
    }
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
    /// PyTorch allocator figures from `/proc/<pid>/fd` (torch bridge).
    torch: Option<TorchReader>,
    /// Container names from the engine's API (filled off this thread).
    engine: Option<Arc<ContainerCache>>,
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
            torch: None,
            engine: None,
        }
    }

    /// The lookup `cfg` asks for, resolving pods through `pods` when the
    /// pod watcher runs.
    pub fn from_config(cfg: &Attribution, pods: Option<Arc<PodIndex>>) -> Self {
        let mut cache =
            ProcCache::new(ProcRoot::new(&cfg.procfs)).with_users(UserNames::new(&cfg.passwd_file));
        if cfg.torch_bridge {
            cache = cache.with_torch_bridge();
        }
        if let Some(max) = cfg.cmdline {
            cache = cache.with_cmdline(max);
        }
        if let Some(p) = pods {
            cache = cache.with_pods(p);
        }
        cache
    }

    /// Read the PyTorch allocator figures processes publish with the
    /// `gpumem_bridge` Python package (`processes.torch_bridge`).
    pub fn with_torch_bridge(mut self) -> Self {
        self.torch = Some(TorchReader::new(self.root.clone()));
        self
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

    /// Add the (redacted, truncated) command line to identities.
    pub fn with_cmdline(mut self, max_len: usize) -> Self {
        self.cmdline_max = Some(max_len);
        self
    }

    fn read(&self, pid: u32) -> ProcIdentity {
        let s = |v: String| -> Arc<str> { Arc::from(v) };
        let cgroup_text = self.root.cgroup(pid);
        let cg = cgroup_text
            .as_deref()
            .map(cgroup::parse_cgroup)
            .unwrap_or_default();
        let slurm = cgroup_text
            .as_deref()
            .and_then(slurm::parse_slurm_cgroup)
            .map(|j| SlurmJob {
                job: Arc::from(j.job),
                step: Arc::from(j.step.unwrap_or_default()),
                uid: Arc::from(j.uid.unwrap_or_default()),
            });
        ProcIdentity {
            comm: s(self.root.comm(pid).unwrap_or_default()),
            user: s(self
                .root
                .uid(pid)
                .map(|u| self.users.name(u))
                .unwrap_or_default()),
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
    fn resolve_pod(&self, ident: &mut ProcIdentity) -> bool {
        let Some(pods) = &self.pods else {
            return false;
        };
        let uid = (!ident.pod_uid.is_empty()).then_some(&*ident.pod_uid);
        let cid = (!ident.container_id.is_empty()).then_some(&*ident.container_id);
        if uid.is_none() && cid.is_none() {
            return false;
        }
        match pods.lookup(uid, cid) {
            Some(r) => {
                ident.namespace = Arc::from(r.namespace);
                ident.pod = Arc::from(r.pod);
                ident.container = Arc::from(r.container);
                // Kubernetes wins over the container engine.
                ident.engine = None;
                true
            }
            None => false,
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
        if self.checked.contains(&pid)
            && let Some((_, ident)) = self.entries.get(&pid)
            && (self.pods.is_none() || !ident.pod.is_empty())
            && !self.wants_engine(ident)
        {
            return Arc::clone(ident);
        }
        let Some(start) = self.root.start_time(pid) else {
            // Gone, or hidden because we do not share the host's PID
            // namespace: the bytes are still exported by pid.
            self.entries.remove(&pid);
            self.failures += 1;
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
        if let Some((s, ident)) = self.entries.get(&pid)
            && *s == start
        {
            let pod_settled = !ident.pod.is_empty()
                || self.pods.is_none()
                || (ident.pod_uid.is_empty() && ident.container_id.is_empty());
            if pod_settled && !self.wants_engine(ident) {
                return Arc::clone(ident);
            }
            // Known process, pod (or container name) not resolved yet: try
            // the index (and the engine cache) again.
            let mut updated = ProcIdentity::clone(ident);
            let pod = !pod_settled && self.resolve_pod(&mut updated);
            if pod | self.resolve_engine(&mut updated) {
                let updated = Arc::new(updated);
                self.entries.insert(pid, (start, Arc::clone(&updated)));
                return updated;
            }
            return Arc::clone(ident);
        }
        let mut ident = self.read(pid);
        self.resolve_pod(&mut ident);
        self.resolve_engine(&mut ident);
        let ident = Arc::new(ident);
        self.entries.insert(pid, (start, Arc::clone(&ident)));
        ident
    }

    fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.entries.retain(|pid, _| live(*pid));
        if let Some(engine) = &self.engine {
            let ids: HashSet<&str> = self
                .entries
                .values()
                .map(|(_, i)| &*i.container_id)
                .filter(|id| !id.is_empty())
                .collect();
            engine.retain(&|id| ids.contains(id));
        }
        if let Some(t) = &mut self.torch {
            t.end_tick(live);
        }
    }

    fn failures(&self) -> u64 {
        self.failures
    }

    fn torch(&mut self, pid: u32, uuids: &[&str]) -> Option<TorchStats> {
        // Only a process identify() just found in /proc, at that start time.
        let start = self.entries.get(&pid)?.0;
        self.torch.as_mut()?.stats(pid, start, uuids)
    }

    fn torch_counters(&self) -> Option<TorchCounters> {
        self.torch.as_ref().map(TorchReader::counters)
    }

    fn container_lookups(&self) -> Option<ContainerLookups> {
        self.engine.as_ref().map(|e| e.lookups())
    }

    fn kubernetes(&self) -> Option<KubeState> {
        self.pods.as_ref().map(|p| p.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
        let mut cache = ProcCache::new(ProcRoot::new(root.path()));
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
        assert_eq!(cache.failures(), 0);
        // The next sample checks the start time again and finds it gone.
        cache.begin_tick();
        assert_eq!(&*cache.identify(42).comm, "");
        assert_eq!(cache.failures(), 1);
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
    }

    /// A Podman container is named from the engine cache once the lookup
    /// thread answered; a process Kubernetes knows is never asked about,
    /// and an engine name gives way when its pod becomes known.
    #[test]
    fn engine_names_fill_in_later_and_kubernetes_wins() {
        use crate::model::ContainerInfo;
        use containers::cache::Outcome;
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
        // Known to Kubernetes later: the pod's names, no engine labels.
        pods.insert(pod_uid, &[("trainer", &plain)], "ml", "trainer-0");
        cache.begin_tick();
        let ident = cache.identify(10);
        assert_eq!(&*ident.pod, "trainer-0");
        assert!(ident.engine.is_none(), "{ident:?}");
        assert_eq!(engine.lookups().found, 1);
    }
}
