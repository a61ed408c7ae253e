use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use super::*;
use crate::model::{
    AllocatedDevice, Busy, DeviceInfo, DeviceSample, GpuAccount, JobAllocation, JobMappingState,
    MemoryInfo, ProcIdentity, Readings, SlurmJob, WorkloadTotals,
};

const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
const GIB: u64 = 1 << 30;

fn ident(user: &str, job: Option<&str>) -> Arc<ProcIdentity> {
    Arc::new(ProcIdentity {
        user: Arc::from(user),
        slurm: job.map(|j| SlurmJob {
            job: Arc::from(j),
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn proc(pid: u32, used: u64, who: &Arc<ProcIdentity>) -> ProcessSample {
    ProcessSample {
        pid,
        used_bytes: Some(used),
        ident: Arc::clone(who),
        gpu_instance_id: None,
        compute_instance_id: None,
        used_peak_bytes: None,
        torch: None,
        readings: Readings::default(),
    }
}

/// One GPU using `used` bytes, busy `busy` %, with `processes`; each
/// process's total kept (`processes.byte_seconds`).
fn snap(used: Option<u64>, busy: Option<u32>, processes: &Arc<[ProcessSample]>) -> Snapshot {
    let mut s = Snapshot::empty(UNIX_EPOCH);
    s.series.process_byte_seconds = true;
    s.devices.push(DeviceSample {
        info: Arc::new(DeviceInfo {
            gpu: "0".into(),
            uuid: GPU0.into(),
            name: "NVIDIA H200".into(),
            pci_bus_id: String::new(),
            memory: Default::default(),
        }),
        memory: used.map(|used| MemoryInfo {
            total: 100 * GIB,
            reserved: Some(0),
            used,
            free: 100 * GIB - used,
        }),
        used_peak_bytes: None,
        processes: Arc::clone(processes),
        other: None,
        mig: Arc::from(Vec::new()),
        readings: Arc::new(match busy {
            Some(pct) => Readings::default().with(Busy {
                percent: Some(pct),
                samples: None,
            }),
            None => Readings::default(),
        }),
    });
    s
}

fn gpu(a: &Accounts) -> &GpuAccount {
    &a.gpus[GPU0]
}

fn close(got: f64, want: f64) {
    assert!(
        (got - want).abs() <= want.abs() * 1e-9 + 1e-6,
        "got {got}, want {want}"
    );
}

#[test]
fn bytes_held_between_samples_integrate_exactly_and_survive_the_process() {
    let alice = ident("alice", None);
    let held: Arc<[ProcessSample]> = Arc::from(vec![proc(10, 8 * GIB, &alice)]);
    let none: Arc<[ProcessSample]> = Arc::from(Vec::new());
    let mut l = Ledger::new();
    let t0 = Instant::now();
    // Ten memory samples a second for 30 s on the same list (the same
    // Arc, as between full samples), with a new list every second.
    let mut a = l.record(&snap(Some(8 * GIB), Some(50), &held), t0);
    let mut list = Arc::clone(&held);
    for i in 1..=300u64 {
        if i % 10 == 0 {
            list = Arc::from(vec![proc(10, 8 * GIB, &alice)]);
        }
        a = l.record(
            &snap(Some(8 * GIB), Some(50), &list),
            t0 + Duration::from_millis(100 * i),
        );
    }
    let s = snap(Some(8 * GIB), Some(50), &list);
    close(gpu(&a).used_byte_seconds, 240.0 * GIB as f64);
    close(gpu(&a).busy_seconds.unwrap_or(0.0), 15.0);
    close(process_byte_seconds(&a, GPU0, &list[0]), 240.0 * GIB as f64);
    let mut s2 = s.clone();
    s2.accounting = a.clone();
    let w = workload_totals(&s2);
    let user = (
        Workload::User {
            user: Arc::from("alice"),
        },
        Arc::from(GPU0),
    );
    close(w[&user].0, 240.0 * GIB as f64);
    close(w[&user].1, 15.0);

    // It exits: its series goes, its workload keeps what it had.
    let a = l.record(
        &snap(Some(0), Some(0), &none),
        t0 + Duration::from_millis(30_500),
    );
    assert!(a.processes.is_empty(), "{:?}", a.processes);
    let mut s3 = snap(Some(0), Some(0), &none);
    s3.accounting = a.clone();
    let w = workload_totals(&s3);
    close(w[&user].0, (240.0 + 4.0) * GIB as f64);
    close(w[&user].1, 15.25);
}

#[test]
fn totals_never_go_back_when_the_gpu_is_lost_or_re_enumerated() {
    let alice = ident("alice", None);
    let held: Arc<[ProcessSample]> = Arc::from(vec![proc(10, GIB, &alice)]);
    let none: Arc<[ProcessSample]> = Arc::from(Vec::new());
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    l.record(&snap(Some(GIB), None, &held), at(0));
    let before = l.record(&snap(Some(GIB), None, &held), at(1000));
    close(gpu(&before).used_byte_seconds, GIB as f64);
    assert_eq!(gpu(&before).busy_seconds, None, "no utilisation: no figure");
    // Down for 5 s: the last answer held until it was seen down, then nothing.
    let down = l.record(&snap(None, None, &none), at(2000));
    close(gpu(&down).used_byte_seconds, 2.0 * GIB as f64);
    let still = l.record(&snap(None, None, &none), at(7000));
    close(gpu(&still).used_byte_seconds, 2.0 * GIB as f64);
    // Re-opened: not identified yet, then back under the same UUID.
    let mut unknown = Snapshot::empty(UNIX_EPOCH);
    unknown.devices.push(DeviceSample {
        info: Arc::new(DeviceInfo::unknown(0)),
        ..snap(None, None, &none).devices.remove(0)
    });
    let gone = l.record(&unknown, at(8000));
    close(gpu(&gone).used_byte_seconds, 2.0 * GIB as f64);
    l.record(&snap(Some(GIB), None, &held), at(9000));
    let back = l.record(&snap(Some(GIB), None, &held), at(10_000));
    close(gpu(&back).used_byte_seconds, 3.0 * GIB as f64);
}

/// Slurm job 7's allocation of `device`, and the snapshot of GPU 0 with
/// `processes` and that one row in its job mapping.
fn job7_holds(
    device: AllocatedDevice,
) -> (AllocationRow, impl Fn(&Arc<[ProcessSample]>) -> Snapshot) {
    let row = JobAllocation {
        device,
        job: "7".into(),
        uid: None,
    };
    let mapping = JobMappingState {
        allocations: Arc::from(vec![row.clone()]),
        ..Default::default()
    };
    let with = move |procs: &Arc<[ProcessSample]>| {
        let mut s = snap(Some(GIB), None, procs);
        s.job_mapping = Some(mapping.clone());
        s
    };
    (AllocationRow::Slurm(row), with)
}

#[test]
fn an_allocated_gpu_without_a_process_of_its_job_counts_idle_seconds() {
    let job7 = ident("bob", Some("7"));
    let other = ident("eve", Some("8"));
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let (key, with) = job7_holds(AllocatedDevice::GpuIndex { gpu: "0".into() });
    // Another job's process does not make it busy.
    let theirs: Arc<[ProcessSample]> = Arc::from(vec![proc(20, GIB, &other)]);
    l.record(&with(&theirs), at(0));
    let mut a = l.record(&with(&theirs), at(100));
    for i in 2..=40 {
        a = l.record(&with(&theirs), at(100 * i));
    }
    let (all, idle) = allocation_seconds(&a, &key).unwrap_or_default();
    close(all, 4.0);
    close(idle, 4.0);
    // Its own process appears: idle stops, allocated goes on.
    let ours: Arc<[ProcessSample]> = Arc::from(vec![proc(20, GIB, &other), proc(21, GIB, &job7)]);
    l.record(&with(&ours), at(4100));
    let a = l.record(&with(&ours), at(6100));
    let (all, idle) = allocation_seconds(&a, &key).unwrap_or_default();
    close(all, 6.1);
    close(idle, 4.1);
}

#[test]
fn a_process_listed_again_after_its_gpu_was_down_carries_on() {
    let alice = ident("alice", None);
    let held: Arc<[ProcessSample]> = Arc::from(vec![proc(10, GIB, &alice)]);
    let none: Arc<[ProcessSample]> = Arc::from(Vec::new());
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    l.record(&snap(Some(GIB), None, &held), at(0));
    l.record(&snap(None, None, &none), at(2000));
    let again: Arc<[ProcessSample]> = Arc::from(vec![proc(10, GIB, &alice)]);
    let a = l.record(&snap(Some(GIB), None, &again), at(5000));
    close(process_byte_seconds(&a, GPU0, &again[0]), 2.0 * GIB as f64);
    // Gone from a GPU that answers: its total goes with it.
    let a = l.record(&snap(Some(GIB), None, &none), at(6000));
    assert!(a.processes.is_empty());
}

#[test]
fn a_mig_allocation_is_idle_while_its_jobs_process_runs_on_another_instance() {
    let job7 = ident("bob", Some("7"));
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // Job 7 holds GPU 0's GPU instance 1 (dcgm-exporter's `0.1` file name).
    let (key, with) = job7_holds(AllocatedDevice::MigOfGpuIndex {
        gpu: "0".into(),
        gpu_instance_id: 1,
    });
    let on = |gi: u32, pid: u32| ProcessSample {
        gpu_instance_id: Some(gi),
        compute_instance_id: Some(0),
        ..proc(pid, GIB, &job7)
    };
    // Its process on instance 2 of the same GPU: instance 1 is idle.
    let elsewhere: Arc<[ProcessSample]> = Arc::from(vec![on(2, 30)]);
    l.record(&with(&elsewhere), at(0));
    let a = l.record(&with(&elsewhere), at(2000));
    let (all, idle) = allocation_seconds(&a, &key).unwrap_or_default();
    close(all, 2.0);
    close(idle, 2.0);
    // On instance 1: busy.
    let here: Arc<[ProcessSample]> = Arc::from(vec![on(1, 31)]);
    l.record(&with(&here), at(2000));
    let a = l.record(&with(&here), at(5000));
    let (all, idle) = allocation_seconds(&a, &key).unwrap_or_default();
    close(all, 5.0);
    close(idle, 2.0);
}

#[test]
fn the_ranking_keeps_the_last_hour_and_since_start_with_ended_workloads() {
    let alice = ident("alice", None);
    let bob = ident("bob", None);
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    // Alice for 2 h; bob for the first 601 s only. One sample a second.
    let mut last = None;
    for i in 0..=7200u64 {
        // A new list every sample, as every full sample makes.
        let list: Arc<[ProcessSample]> = if i <= 600 {
            Arc::from(vec![proc(10, 2 * GIB, &alice), proc(11, GIB, &bob)])
        } else {
            Arc::from(vec![proc(10, 2 * GIB, &alice)])
        };
        let mut s = snap(Some(3 * GIB), Some(50), &list);
        s.accounting = l.record(&s, at(i));
        last = Some(s);
    }
    let Some(s) = last else { return };
    let (hour, since) = rank(&s, 10);
    let user = |u: &str| Workload::User { user: Arc::from(u) };
    // The window: the last 59 whole minutes and the current one.
    close(hour.seconds, 3540.0);
    close(since.seconds, 7200.0);
    assert_eq!(
        hour.workloads.len(),
        1,
        "bob ended over an hour ago: {hour:?}"
    );
    assert_eq!(hour.workloads[0].0, user("alice"));
    close(
        hour.workloads[0].1.used_byte_seconds,
        2.0 * GIB as f64 * 3540.0,
    );
    close(hour.workloads[0].1.busy_seconds, 0.5 * 3540.0);
    // Since start: alice's 2 h, bob's 600 s although the ledger dropped
    // his account 300 s after he left.
    assert!(
        !s.accounting
            .workloads
            .keys()
            .any(|(w, _)| *w == user("bob")),
        "the ledger forgot bob"
    );
    assert_eq!(since.workloads.len(), 2, "{since:?}");
    assert_eq!(since.workloads[0].0, user("alice"));
    close(
        since.workloads[0].1.used_byte_seconds,
        2.0 * GIB as f64 * 7200.0,
    );
    assert_eq!(since.workloads[1].0, user("bob"));
    // Listed by the samples at 0..=600 s, each held until the next.
    close(since.workloads[1].1.used_byte_seconds, GIB as f64 * 601.0);
    close(since.workloads[1].1.busy_seconds, 0.5 * 601.0);
    assert_eq!(since.omitted, WorkloadTotals::default());
    let (_, one) = rank(&s, 1);
    close(one.omitted.used_byte_seconds, GIB as f64 * 601.0);
}

#[test]
fn the_ranking_stays_bounded_when_a_tenant_makes_thousands_of_workloads() {
    let mut l = Ledger::new();
    let t0 = Instant::now();
    // A new user every second for 2 h, each holding 1 byte for 1 s.
    let mut last = None;
    for i in 0..7200u32 {
        let who = ident(&format!("u{i}"), None);
        let list: Arc<[ProcessSample]> = Arc::from(vec![proc(100 + i, 1, &who)]);
        let mut s = snap(Some(1), None, &list);
        s.accounting = l.record(&s, t0 + Duration::from_secs(u64::from(i)));
        last = Some(s);
    }
    let Some(s) = last else { return };
    let base = &s.accounting.ranking;
    assert!(base.ended.len() <= crate::model::RANK_ENDED_WORKLOADS);
    assert!(base.hour.len() <= crate::model::RANK_WORKLOADS_PER_MINUTE * 59);
    assert!(base.boundary.len() <= 400, "{}", base.boundary.len());
    let (hour, since) = rank(&s, 100);
    assert_eq!(hour.workloads.len(), 100);
    // Nothing is lost: what is not listed is summed.
    let sum = |r: &Ranked| {
        r.workloads
            .iter()
            .map(|w| w.1.used_byte_seconds)
            .sum::<f64>()
            + r.omitted.used_byte_seconds
    };
    close(sum(&since), 7199.0);
    close(sum(&hour), hour.seconds);
}

#[test]
fn nvml_utilisation_samples_are_counted_once_per_read_instead_of_the_gauge() {
    use crate::model::BusySamples;
    let alice = ident("alice", None);
    let held: Arc<[ProcessSample]> = Arc::from(vec![proc(10, GIB, &alice)]);
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let mut a = Accounts::default();
    // The gauge says 100 %, the samples 50 % of each second: one read a
    // second, carried by the nine memory samples after it.
    for i in 0..=100u64 {
        let read = BusySamples {
            read: 1000 + i / 10,
            percent_us: if i < 10 { 0 } else { 50 * 1_000_000 },
        };
        let mut s = snap(Some(GIB), None, &held);
        s.devices[0].readings = Arc::new(Readings::default().with(Busy {
            percent: Some(100),
            samples: Some(read),
        }));
        a = l.record(&s, t0 + Duration::from_millis(100 * i));
    }
    close(gpu(&a).busy_seconds.unwrap_or(0.0), 5.0);
    let mut s = snap(Some(GIB), None, &held);
    s.accounting = a.clone();
    let w = workload_totals(&s);
    let user = (
        Workload::User {
            user: Arc::from("alice"),
        },
        Arc::from(GPU0),
    );
    close(w[&user].1, 5.0);
}

/// One pod as its first samples know it (by uid only) and as its later
/// ones do (named).
fn one_pod_two_ways() -> (Arc<ProcIdentity>, Arc<ProcIdentity>) {
    let uid: Arc<str> = Arc::from("aaaaaaaa-0000-0000-0000-000000000001");
    let by_uid = Arc::new(ProcIdentity {
        pod_uid: Arc::clone(&uid),
        ..Default::default()
    });
    let named = Arc::new(ProcIdentity {
        namespace: Arc::from("team-a"),
        pod: Arc::from("trainer-0"),
        pod_uid: uid,
        ..Default::default()
    });
    (by_uid, named)
}

#[test]
fn a_pod_named_after_its_first_samples_stays_one_workload() {
    let (by_uid, named) = one_pod_two_ways();
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // 2 s seen by UID only (the pod watcher had not named it yet), then
    // 3 s by its names: one account of 5 GiB.s, under the names.
    let early: Arc<[ProcessSample]> = Arc::from(vec![proc(40, GIB, &by_uid)]);
    l.record(&snap(Some(GIB), None, &early), at(0));
    let late: Arc<[ProcessSample]> = Arc::from(vec![proc(40, GIB, &named)]);
    l.record(&snap(Some(GIB), None, &late), at(2000));
    let a = l.record(&snap(Some(GIB), None, &late), at(5000));
    let totals = workload_totals_of(&a, &snap(Some(GIB), None, &late).devices);
    assert_eq!(totals.len(), 1, "{totals:?}");
    let ((w, _), (bytes, _)) = totals.iter().next().unwrap();
    assert_eq!(
        w.labels(),
        vec![
            ("namespace", "team-a"),
            ("pod", "trainer-0"),
            ("pod_uid", "aaaaaaaa-0000-0000-0000-000000000001")
        ]
    );
    close(*bytes, 5.0 * GIB as f64);
}

/// A pid reused by another process (another start time) starts from 0,
/// while the workload's counter goes on; also after the GPU was down.
#[test]
fn a_reused_pid_starts_its_byte_seconds_from_zero() {
    let started = |at: u64| {
        Arc::new(ProcIdentity {
            start_time: Some(at),
            ..ProcIdentity::clone(&ident("alice", None))
        })
    };
    let (first, second, third) = (started(100), started(200), started(300));
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let list =
        |who: &Arc<ProcIdentity>| -> Arc<[ProcessSample]> { Arc::from(vec![proc(10, GIB, who)]) };
    let a = list(&first);
    l.record(&snap(Some(GIB), None, &a), at(0));
    let a2 = list(&first);
    let got = l.record(&snap(Some(GIB), None, &a2), at(10_000));
    close(process_byte_seconds(&got, GPU0, &a2[0]), 10.0 * GIB as f64);
    // Pid 10 exits and is reused between two full samples.
    let b = list(&second);
    l.record(&snap(Some(GIB), None, &b), at(11_000));
    let b2 = list(&second);
    let got = l.record(&snap(Some(GIB), None, &b2), at(12_000));
    close(process_byte_seconds(&got, GPU0, &b2[0]), GIB as f64);
    assert_eq!(got.processes.len(), 1, "{:?}", got.processes);
    let mut s = snap(Some(GIB), None, &b2);
    s.accounting = got.clone();
    let user = (
        Workload::User {
            user: Arc::from("alice"),
        },
        Arc::from(GPU0),
    );
    close(workload_totals(&s)[&user].0, 12.0 * GIB as f64);
    // The GPU is down, and lists pid 10 again started anew: from 0, and
    // the kept total of the one before is gone.
    let none: Arc<[ProcessSample]> = Arc::from(Vec::new());
    l.record(&snap(None, None, &none), at(13_000));
    let c = list(&third);
    l.record(&snap(Some(GIB), None, &c), at(15_000));
    let c2 = list(&third);
    let got = l.record(&snap(Some(GIB), None, &c2), at(16_000));
    close(process_byte_seconds(&got, GPU0, &c2[0]), GIB as f64);
    assert_eq!(got.processes.len(), 1, "{:?}", got.processes);
}

/// Memory held by a stale process is integrated by reason at every
/// sample: bytes × seconds, exactly on the monotonic clock; nothing while
/// the processes were never read.
#[test]
fn stale_bytes_are_integrated_by_reason() {
    use crate::model::{Stale, StaleReason, Unattributed};
    let alice = ident("alice", None);
    let mut dead = proc(10, 2 * GIB, &alice);
    dead.readings = Readings::default().with(Stale {
        reason: StaleReason::Exited,
        since: UNIX_EPOCH,
    });
    let held: Arc<[ProcessSample]> = Arc::from(vec![dead, proc(11, GIB, &alice)]);
    let mut l = Ledger::new();
    let t0 = Instant::now();
    let mut a = Accounts::default();
    for i in 0..=100u64 {
        let mut s = snap(Some(3 * GIB), None, &held);
        s.devices[0].readings = Arc::new(Readings::default().with(Unattributed::default()));
        a = l.record(&s, t0 + Duration::from_millis(100 * i));
    }
    let got = gpu(&a).stale_byte_seconds.unwrap_or_default();
    close(got[StaleReason::Exited as usize], 2.0 * GIB as f64 * 10.0);
    assert_eq!(got[StaleReason::Zombie as usize], 0.0);
    // Processes never read: no stale totals at all.
    let mut l = Ledger::new();
    let a = l.record(&snap(Some(3 * GIB), None, &held), t0);
    assert_eq!(gpu(&a).stale_byte_seconds, None);
}

/// A workload's idle processes' bytes are integrated into its idle
/// byte-seconds (bytes × seconds); busy ones add nothing there.
#[test]
fn idle_bytes_are_integrated_per_workload() {
    use crate::model::Idle;
    let alice = ident("alice", None);
    let bob = ident("bob", None);
    let mut idle = proc(10, 2 * GIB, &alice);
    idle.readings = Readings::default().with(Idle { since: UNIX_EPOCH });
    let t0 = Instant::now();
    let mut l = Ledger::new();
    let mut last = Snapshot::empty(UNIX_EPOCH);
    for i in 0..=10u64 {
        // A new list each full sample (one a second), as the sampler makes.
        let held: Arc<[ProcessSample]> = Arc::from(vec![idle.clone(), proc(11, GIB, &bob)]);
        let mut s = snap(Some(3 * GIB), None, &held);
        s.accounting = l.record(&s, t0 + Duration::from_secs(i));
        last = s;
    }
    let totals = crate::accounting::workload_idle_totals(&last);
    let of = |who: &str| {
        totals
            .iter()
            .find(|((w, _), _)| w.labels().iter().any(|(_, v)| *v == who))
            .map(|(_, v)| *v)
    };
    close(of("alice").unwrap_or(0.0), 2.0 * GIB as f64 * 10.0);
    assert_eq!(of("bob"), None, "never idle: no series");
}

/// Without the per-process counter (the default) no process's total is
/// kept, and the workloads' totals are the same; asked for again, each
/// process starts from 0; a recorder keeps them whatever the snapshots say.
#[test]
fn process_totals_only_while_asked_for() {
    let alice = ident("alice", None);
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let user = (
        Workload::User {
            user: Arc::from("alice"),
        },
        Arc::from(GPU0),
    );
    let run = |l: &mut Ledger, on: bool| -> (Accounts, Snapshot) {
        let mut last = Snapshot::empty(UNIX_EPOCH);
        let mut a = Accounts::default();
        for i in 0..=20u64 {
            // A new list every second, memory-only samples between.
            let list: Arc<[ProcessSample]> = Arc::from(vec![proc(10, GIB, &alice)]);
            for k in 0..10u64 {
                let mut s = snap(Some(GIB), Some(100), &list);
                s.series.process_byte_seconds = on;
                a = l.record(&s, at(1000 * i + 100 * k));
                s.accounting = a.clone();
                last = s;
            }
        }
        (a, last)
    };
    let (off, s_off) = run(&mut Ledger::new(), false);
    assert!(off.processes.is_empty(), "{:?}", off.processes);
    let (on, s_on) = run(&mut Ledger::new(), true);
    assert_eq!(on.processes.len(), 1);
    close(
        process_byte_seconds(&on, GPU0, &s_on.devices[0].processes[0]),
        20.9 * GIB as f64,
    );
    close(workload_totals(&s_off)[&user].0, 20.9 * GIB as f64);
    close(
        workload_totals(&s_off)[&user].0,
        workload_totals(&s_on)[&user].0,
    );
    close(
        workload_totals(&s_off)[&user].1,
        workload_totals(&s_on)[&user].1,
    );
    let mut recorder = Ledger::new();
    recorder.keep_processes(true);
    let (kept, _) = run(&mut recorder, false);
    assert_eq!(kept.processes.len(), 1, "the recorder keeps them");
}

/// A list's processes summed per workload, one entry each, in workload
/// order; a pod named by any of its processes carries the names.
#[test]
fn live_workloads_sum_each_workload_once() {
    use crate::model::Idle;
    let alice = ident("alice", None);
    let bob = ident("bob", None);
    let (by_uid, named) = one_pod_two_ways();
    let mut idle = proc(4, 5, &bob);
    idle.readings = Readings::default().with(Idle { since: UNIX_EPOCH });
    let nobody = proc(6, 1000, &Arc::new(ProcIdentity::default()));
    let list = vec![
        proc(1, 1, &bob),
        proc(2, 2, &alice),
        proc(3, 3, &by_uid),
        idle,
        proc(5, 7, &named),
        nobody,
        proc(7, 11, &alice),
    ];
    /// A workload's labels, bytes, idle bytes and whether it idles.
    type Row<'a> = (Vec<(&'static str, &'a str)>, u64, u64, bool);
    let live = live_workloads(&list);
    let got: Vec<Row<'_>> = live
        .iter()
        .map(|w| (w.workload.labels(), w.bytes, w.idle_bytes, w.idle))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                vec![
                    ("namespace", "team-a"),
                    ("pod", "trainer-0"),
                    ("pod_uid", "aaaaaaaa-0000-0000-0000-000000000001")
                ],
                10,
                0,
                false
            ),
            (vec![("user", "alice")], 13, 0, false),
            (vec![("user", "bob")], 6, 5, true),
        ]
    );
}
