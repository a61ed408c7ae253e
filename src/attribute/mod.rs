//! Who a pid is: name and owner from /proc ([`procfs`], [`passwd`]),
//! container and pod from its cgroup ([`cgroup`]) and the pod watcher's
//! index ([`crate::kube`]), an optional redacted command line ([`redact`]), and the
//! PyTorch allocator figures the process publishes itself ([`torch`]).
//! [`ProcCache`] puts them together for the sampler, cached by (pid, start
//! time).

pub mod cgroup;
pub mod passwd;
pub mod procfs;
pub mod redact;
pub mod torch;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::config::Attribution;
use crate::kube::index::PodIndex;
use crate::model::{KubeState, ProcIdentity, TorchCounters, TorchStats};
use crate::ratelimit::LogLimiter;
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

    /// Add the (redacted, truncated) command line to identities.
    pub fn with_cmdline(mut self, max_len: usize) -> Self {
        self.cmdline_max = Some(max_len);
        self
    }

    fn read(&self, pid: u32) -> ProcIdentity {
        let s = |v: String| -> Arc<str> { Arc::from(v) };
        let cg = self
            .root
            .cgroup(pid)
            .map(|c| cgroup::parse_cgroup(&c))
            .unwrap_or_default();
        ProcIdentity {
            comm: s(self.root.comm(pid).unwrap_or_default()),
            user: s(self
                .root
                .uid(pid)
                .map(|u| self.users.name(u))
                .unwrap_or_default()),
            container_id: s(cg.container_id.unwrap_or_default()),
            pod_uid: s(cg.pod_uid.unwrap_or_default()),
            cmdline: self.cmdline_max.map(|max| {
                let args = self.root.cmdline(pid).unwrap_or_default();
                s(redact::redact_cmdline(&args, max))
            }),
            namespace: Arc::from(""),
            pod: Arc::from(""),
            container: Arc::from(""),
        }
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
            if !ident.pod.is_empty()
                || self.pods.is_none()
                || (ident.pod_uid.is_empty() && ident.container_id.is_empty())
            {
                return Arc::clone(ident);
            }
            // Known process, pod not resolved yet: try the index again.
            let mut updated = ProcIdentity::clone(ident);
            if self.resolve_pod(&mut updated) {
                let updated = Arc::new(updated);
                self.entries.insert(pid, (start, Arc::clone(&updated)));
                return updated;
            }
            return Arc::clone(ident);
        }
        let mut ident = self.read(pid);
        self.resolve_pod(&mut ident);
        let ident = Arc::new(ident);
        self.entries.insert(pid, (start, Arc::clone(&ident)));
        ident
    }

    fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.entries.retain(|pid, _| live(*pid));
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

    fn kubernetes(&self) -> Option<KubeState> {
        self.pods.as_ref().map(|p| p.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
