//! Slurm jobs against a real Slurm (Debian's `slurmctld`, `slurmd` and
//! `munge`, started by the test in a temporary folder on free ports, and
//! stopped by it, also when it fails): a one-node cluster with
//! `proctrack/cgroup`, `task/cgroup` on cgroup v1 and two fake GPUs
//! (`/dev/nvidia0`, `/dev/nvidia1` made with mknod, `gres.conf`), whose
//! `Prolog=` and `Epilog=` are the shipped deploy/slurm scripts behind a
//! wrapper that names the job-mapping directory.
//!
//! Two `srun --gres=gpu:1 sleep` jobs: A gets GPU 0, B GPU 1. The fake
//! NVML lists both pids on GPU 0 (real /proc: the exporter reads their
//! real cgroups), so GPU 0's process series carry two jobs told apart,
//! and GPU 1 is held by B without a process of B on it (the allocation
//! GpuAllocatedButIdle is about). B is cancelled: its epilog removes the
//! mapping, the fake drops its pid as the driver would, and within one
//! refresh neither its allocation nor its process series are left.
//!
//! Needs root (mknod, cgroups, slurmd); scripts/ci/test installs the
//! programs.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;

const GPU0: &str = "GPU-51510000-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-51511111-0000-0000-0000-000000000000";
/// The node's name, which is also in its jobs' cgroup paths
/// (`/slurm_<node>/…`): unique per test process, so two runs on one host
/// do not share cgroups.
fn node() -> String {
    format!("gpumem{}", std::process::id())
}

/// The exporter's full sample interval and the job-mapping interval: "one
/// refresh".
const REFRESH: Duration = Duration::from_millis(200);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// munged, slurmctld and slurmd in a temporary folder; everything stopped
/// on drop (jobs cancelled first, so their steps end with them).
struct Cluster {
    dir: tempfile::TempDir,
    jobs: Vec<Child>,
    /// The jobs' `sleep` processes.
    pids: Vec<u32>,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let c = Cluster {
            dir,
            jobs: Vec::new(),
            pids: Vec::new(),
        };
        let d = c.dir.path().to_path_buf();
        for sub in ["state", "spool", "log", "dev", "jobs"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        run(Command::new("mungekey")
            .args(["-c", "-b", "1024", "-k"])
            .arg(d.join("munge.key")));
        run(Command::new("munged")
            .arg(format!("--socket={}", d.join("munge.sock").display()))
            .arg(format!("--key-file={}", d.join("munge.key").display()))
            .arg(format!("--pid-file={}", d.join("munged.pid").display()))
            .arg(format!("--log-file={}", d.join("log/munged.log").display()))
            .arg(format!("--seed-file={}", d.join("munge.seed").display())));
        for i in 0..2 {
            run(Command::new("mknod")
                .arg(d.join(format!("dev/nvidia{i}")))
                .args(["c", "195", &i.to_string()]));
        }
        let p = |rel: &str| d.join(rel).display().to_string();
        let node = node();
        let conf = format!(
            "ClusterName=gpumemtest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={ctldpid}
SlurmdPidFile={slurmdpid}
SlurmctldLogFile={ctldlog}
SlurmdLogFile={slurmdlog}
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
GresTypes=gpu
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=1
Prolog={prolog}
Epilog={epilog}
NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
",
            ctld = free_port(),
            slurmd = free_port(),
            sock = p("munge.sock"),
            state = p("state"),
            spool = p("spool"),
            ctldpid = p("slurmctld.pid"),
            slurmdpid = p("slurmd.pid"),
            ctldlog = p("log/slurmctld.log"),
            slurmdlog = p("log/slurmd.log"),
            prolog = p("prolog"),
            epilog = p("epilog"),
        );
        std::fs::write(d.join("slurm.conf"), conf).unwrap();
        std::fs::write(
            d.join("cgroup.conf"),
            "CgroupPlugin=cgroup/v1\nConstrainDevices=no\n",
        )
        .unwrap();
        std::fs::write(
            d.join("gres.conf"),
            format!("NodeName={node} Name=gpu File={}\n", p("dev/nvidia[0-1]")),
        )
        .unwrap();
        // The shipped scripts, with the mapping directory from the
        // environment, as docs/deploying.md shows.
        for (name, script) in [("prolog", "prolog.sh"), ("epilog", "epilog.sh")] {
            let w = d.join(name);
            std::fs::write(
                &w,
                format!(
                    "#!/bin/sh\nGPUMEM_JOB_MAPPING_DIR={} exec {}\n",
                    p("jobs"),
                    repo_file(&format!("deploy/slurm/{script}")).display()
                ),
            )
            .unwrap();
            run(Command::new("chmod").arg("755").arg(&w));
        }
        run(c.slurm("slurmctld").args(["-c", "-i"]));
        run(c.slurm("slurmd").args(["-c", "-N", &node]));
        wait_for(Duration::from_secs(15), "the Slurm node idle", || {
            let out = c.slurm("sinfo").args(["-h", "-o", "%t"]).output().ok()?;
            (String::from_utf8_lossy(&out.stdout).trim() == "idle").then_some(())
        });
        c
    }

    fn slurm(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("SLURM_CONF", self.dir.path().join("slurm.conf"));
        cmd
    }

    fn mapping_dir(&self) -> PathBuf {
        self.dir.path().join("jobs")
    }

    /// `srun --gres=gpu:1 sleep 120` named `name`, in the background:
    /// (job id, the pid of its `sleep`).
    fn srun(&mut self, name: &str) -> (String, u32) {
        let child = self
            .slurm("srun")
            .args(["--gres=gpu:1", "-J", name, "sleep", "120"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("srun");
        self.jobs.push(child);
        let job = wait_for(Duration::from_secs(15), "the job running", || {
            let out = self
                .slurm("squeue")
                .args(["-h", "-t", "R", "-o", "%i", "-n", name])
                .output()
                .ok()?;
            let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (!id.is_empty()).then_some(id)
        });
        let procs = PathBuf::from(format!(
            "/sys/fs/cgroup/freezer/slurm_{}/uid_0/job_{job}/step_0/cgroup.procs",
            node()
        ));
        let pid = wait_for(Duration::from_secs(10), "the job's sleep", || {
            std::fs::read_to_string(&procs)
                .ok()?
                .lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .find(|p| {
                    std::fs::read_to_string(format!("/proc/{p}/comm"))
                        .is_ok_and(|c| c.trim() == "sleep")
                })
        });
        self.pids.push(pid);
        (job, pid)
    }

    fn log(&self) -> String {
        let mut s = String::new();
        for f in ["slurmctld.log", "slurmd.log"] {
            let text =
                std::fs::read_to_string(self.dir.path().join("log").join(f)).unwrap_or_default();
            s.push_str(&format!("== {f}\n{text}\n"));
        }
        s
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let t = Instant::now();
        let _ = self.slurm("scancel").args(["-u", "root", "-f"]).status();
        for j in &mut self.jobs {
            let _ = j.kill();
            let _ = j.wait();
        }
        // The steps end their tasks; whatever is left in this node's
        // cgroups (the steps' slurmstepd, which waits for a slurmd that is
        // about to go) is this cluster's alone: the node name is unique.
        for pid in &self.pids {
            stop(*pid, libc::SIGCONT, Duration::from_secs(3));
        }
        let cgroups = node_cgroups();
        for pid in cgroups.iter().flat_map(|c| procs_under(c)) {
            stop(pid, libc::SIGKILL, Duration::from_secs(2));
        }
        let jobs_gone = t.elapsed();
        for pidfile in ["slurmd.pid", "slurmctld.pid", "munged.pid"] {
            if let Some(pid) = std::fs::read_to_string(self.dir.path().join(pidfile))
                .ok()
                .and_then(|p| p.trim().parse::<u32>().ok())
            {
                stop(pid, libc::SIGTERM, Duration::from_millis(500));
            }
        }
        // Empty now: remove them, deepest first.
        for c in &cgroups {
            remove_tree(c);
        }
        eprintln!(
            "slurm: jobs ended {jobs_gone:.2?}, daemons stopped {:.2?} after the test",
            t.elapsed()
        );
    }
}

/// This test's node's cgroup under every v1 controller that has one
/// (`/sys/fs/cgroup/<controller>/slurm_<node>`).
fn node_cgroups() -> Vec<PathBuf> {
    let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") else {
        return Vec::new();
    };
    controllers
        .filter_map(Result::ok)
        .map(|c| c.path().join(format!("slurm_{}", node())))
        .filter(|p| p.is_dir())
        .collect()
}

/// The pids in `dir` and every cgroup below it.
fn procs_under(dir: &Path) -> Vec<u32> {
    let mut out: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.filter_map(Result::ok) {
            if e.path().is_dir() {
                out.extend(procs_under(&e.path()));
            }
        }
    }
    out
}

/// rmdir `dir`'s cgroups, children first.
fn remove_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.filter_map(Result::ok) {
            if e.path().is_dir() {
                remove_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Whether `pid` runs (a zombie does not: daemons are reparented to an
/// init that may reap them late).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// Send `sig` to `pid`, wait for it to end, SIGKILL it after `grace`.
fn stop(pid: u32, sig: libc::c_int, grace: Duration) {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return;
    };
    let t = Instant::now();
    // SAFETY: kill(2) on a pid this test started (or its daemons wrote).
    unsafe { libc::kill(p, sig) };
    while alive(pid) {
        if t.elapsed() > grace {
            // SAFETY: as above.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", output_text(&out));
}

fn scenario(gpu0: &[u32]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {GPU0}\n    memory: {{total: 85899345920, reserved: 536870912, used: 30000000000}}\n    processes:\n"
    );
    for (i, pid) in gpu0.iter().enumerate() {
        y.push_str(&format!(
            "      - {{pid: {pid}, used: {}}}\n",
            (i as u64 + 1) * 1_000_000_000
        ));
    }
    if gpu0.is_empty() {
        y = y.replace("    processes:\n", "    processes: []\n");
    }
    y.push_str(&format!(
        "  - uuid: {GPU1}\n    memory: {{total: 85899345920, reserved: 536870912, used: 600000000}}\n    processes: []\n"
    ));
    y
}

fn mapping(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().to_string(),
                        std::fs::read_to_string(e.path()).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn slurm_jobs_steps_and_allocations_from_a_real_slurm() {
    let started = Instant::now();
    let mut cluster = Cluster::start();
    let up = started.elapsed();
    let (job_a, pid_a) = cluster.srun("gpumem-a");
    let (job_b, pid_b) = cluster.srun("gpumem-b");
    assert_ne!(job_a, job_b);

    // The shipped prolog wrote one file per GPU index (SLURM_JOB_GPUS).
    let map = mapping(&cluster.mapping_dir());
    assert_eq!(
        map,
        vec![
            ("0".to_string(), format!("{job_a}\n")),
            ("1".to_string(), format!("{job_b}\n")),
        ],
        "{}",
        cluster.log()
    );

    let scn = Scenario::new(&scenario(&[pid_a, pid_b]));
    let config = format!(
        "sample_interval: 200ms\nkubernetes:\n  enabled: false\nslurm:\n  job_mapping_dir: {}\n  job_mapping_interval: 200ms\n",
        cluster.mapping_dir().display()
    );
    let exporter = Exporter::with_config(&scn, &config, &[]);
    let (a, b) = (pid_a.to_string(), pid_b.to_string());
    let m = wait_for(
        Duration::from_secs(10),
        "both jobs and both allocations",
        || {
            let m = exporter.metrics();
            (m.find("gpu_allocation_info", &[]).len() == 2
                && m.find(
                    "gpu_process_memory_used_bytes",
                    &[("slurm_job", job_b.as_str())],
                )
                .len()
                    == 1)
                .then_some(m)
        },
    );

    // GPU 0's two processes, told apart by job; the info series carry
    // the step and (cgroup v1) the uid.
    for (pid, job, used) in [(&a, &job_a, 1_000_000_000u64), (&b, &job_b, 2_000_000_000)] {
        assert_eq!(
            m.get_u64(
                "gpu_process_memory_used_bytes",
                &[
                    ("gpu", "0"),
                    ("uuid", GPU0),
                    ("pid", pid),
                    ("process", "sleep"),
                    ("slurm_job", job),
                ]
            ),
            Some(used),
            "{}",
            m.text
        );
        assert_eq!(
            m.get(
                "gpu_process_info",
                &[
                    ("gpu", "0"),
                    ("uuid", GPU0),
                    ("pid", pid),
                    ("process", "sleep"),
                    ("user", "root"),
                    ("slurm_job", job),
                    ("slurm_step", "0"),
                    ("slurm_uid", "0"),
                ]
            ),
            Some(1.0),
            "{}",
            m.text
        );
    }
    // The allocations: A holds GPU 0 (busy), B holds GPU 1 without a
    // process of B on it.
    for (gpu, uuid, job) in [("0", GPU0, &job_a), ("1", GPU1, &job_b)] {
        assert_eq!(
            m.get(
                "gpu_allocation_info",
                &[("gpu", gpu), ("uuid", uuid), ("slurm_job", job)]
            ),
            Some(1.0),
            "{}",
            m.text
        );
    }
    assert!(
        m.find("gpu_process_memory_used_bytes", &[("gpu", "1")])
            .is_empty(),
        "{}",
        m.text
    );
    assert_eq!(
        m.get(
            "gpumem_exporter_slurm_job_mapping_errors_total",
            &[("reason", "content")]
        ),
        Some(0.0)
    );

    // B ends: its epilog removes the mapping and the driver drops its
    // process (the fake, as a driver would, once the pid is gone).
    let cancelled = Instant::now();
    run(cluster.slurm("scancel").arg(&job_b));
    wait_for(Duration::from_secs(10), "B's epilog", || {
        (mapping(&cluster.mapping_dir()) == vec![("0".to_string(), format!("{job_a}\n"))])
            .then_some(())
    });
    let epilog_done = Instant::now();
    scn.write(&scenario(&[pid_a]));
    // One refresh: the next read of the directory and the next full
    // sample (REFRESH each) after it. Polled, with room for a loaded CI
    // machine; the time it took is reported.
    let needle = format!("slurm_job=\"{job_b}\"");
    let m = wait_for(
        REFRESH * 15,
        "job B's allocation and process series gone",
        || {
            let m = exporter.metrics();
            // The job's workload counters (`gpu_workload_*`) stay for their
            // grace after its last process (docs/metrics.md); its
            // allocation and process series go.
            (!m.text
                .lines()
                .filter(|l| !l.starts_with("gpu_workload_"))
                .any(|l| l.contains(&needle)))
            .then_some(m)
        },
    );
    let gone = epilog_done.elapsed();
    assert_eq!(
        m.get(
            "gpu_allocation_info",
            &[("gpu", "0"), ("uuid", GPU0), ("slurm_job", job_a.as_str())]
        ),
        Some(1.0),
        "{}",
        m.text
    );
    assert!(
        m.get("gpumem_exporter_slurm_job_mapping_reads_total", &[])
            .is_some_and(|n| n >= 2.0)
    );
    eprintln!(
        "slurm: daemons up in {:.2?}, epilog {:.2?} after scancel, B's series gone {:.2?} after it (refresh {REFRESH:?}), whole test {:.2?}",
        up,
        epilog_done - cancelled,
        gone,
        started.elapsed()
    );
}
