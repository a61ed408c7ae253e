use std::collections::BTreeMap;
use std::sync::Arc;

use super::*;
use crate::expose::{Format, Reuse, encode_reusing};
use crate::model::{
    DeviceInfo, DeviceSample, MemoryInfo, ProcIdentity, ProcessSample, SeriesPolicy, Snapshot,
};

/// `gpus` GPUs with `procs` processes each: pid `1000 * gpu + i` uses
/// `i + 1` MiB and belongs to pod `p<i % pods>` (no pod when `pods` is 0).
fn snapshot(gpus: u32, procs: u32, pods: u32, policy: SeriesPolicy) -> Snapshot {
    let mut s = Snapshot::empty(std::time::UNIX_EPOCH);
    s.series = policy;
    for g in 0..gpus {
        let processes: Vec<ProcessSample> = (0..procs)
            .map(|i| ProcessSample {
                pid: 1000 * (g + 1) + i,
                used_bytes: Some(u64::from(i + 1) << 20),
                ident: Arc::new(ProcIdentity {
                    comm: "python".into(),
                    user: "alice".into(),
                    pod: if pods == 0 {
                        "".into()
                    } else {
                        format!("p{}", i % pods).into()
                    },
                    namespace: if pods == 0 { "".into() } else { "ml".into() },
                    ..Default::default()
                }),
                gpu_instance_id: None,
                compute_instance_id: None,
                used_peak_bytes: Some(u64::from(i + 1) << 20),
                torch: None,
                readings: Default::default(),
            })
            .collect();
        let used: u64 = processes.iter().filter_map(|p| p.used_bytes).sum();
        s.devices.push(DeviceSample {
            info: Arc::new(DeviceInfo {
                uuid: format!("GPU-{g}"),
                name: "Fake".into(),
                ..DeviceInfo::unknown(g as usize)
            }),
            memory: Some(MemoryInfo {
                total: 1 << 40,
                used,
                free: (1 << 40) - used,
                reserved: Some(0),
            }),
            used_peak_bytes: Some(used),
            processes: processes.into(),
            other: None,
            mig: Arc::new([]),
            readings: Default::default(),
        });
    }
    s
}

/// Series per family of a body, the exporter's own families left out.
fn served(body: &str) -> Counts {
    let mut c = Counts::new();
    count(body, &mut c);
    c.retain(|(f, _)| !f.starts_with("gpumem_exporter_"));
    c
}

/// The value of each `name{…uuid="U"…}` series summed per uuid.
fn sum_by_uuid(body: &str, name: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !rest.starts_with('{') {
            continue;
        }
        let uuid = rest
            .split("uuid=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("");
        let v: u64 = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        *out.entry(uuid.to_string()).or_insert(0) += v;
    }
    out
}

#[test]
fn counts_series_per_family_in_both_formats() {
    for (text, want) in [
        (
            "# HELP a A.\n# TYPE a gauge\na{x=\"1\"} 1\na{x=\"2\"} 2\n# HELP b B.\n# TYPE b_total counter\nb_total 3\n",
            vec![("a", 2), ("b_total", 1)],
        ),
        (
            "# HELP a A.\n# TYPE a gauge\n# HELP b B.\n# TYPE b counter\nb_total 3\nb_total{y=\"1\"} 4\n# EOF\n",
            vec![("a", 0), ("b_total", 2)],
        ),
        (
            "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 0\nh_bucket{le=\"+Inf\"} 0\nh_sum 0\nh_count 0\n",
            vec![("h", 4)],
        ),
        (
            "# HELP c C.\n# TYPE c gauge\n# UNIT c bytes\nc 1\n# EOF\n",
            vec![("c", 1)],
        ),
        // A `# HELP ` inside a help text is no family of its own.
        (
            "# HELP d says # HELP x.\n# TYPE d gauge\nd 1\n",
            vec![("d", 1)],
        ),
    ] {
        let mut c = Counts::new();
        count(text, &mut c);
        let got: Vec<(&str, u64)> = c.iter().map(|(f, n)| (&**f, *n)).collect();
        assert_eq!(got, want, "{text:?}");
    }
}

#[test]
fn whole_families_go_per_process_first_then_from_the_end() {
    let counts =
        |v: &[(&str, u64)]| -> Counts { v.iter().map(|(f, n)| (Box::from(*f), *n)).collect() };
    let body = [
        ("gpu_info", 8),
        ("gpu_memory_used_bytes", 8),
        ("gpu_process_memory_used_bytes", 8),
        ("gpu_processes_other", 8),
        ("gpu_driver_info", 1),
    ];
    for (budget, want) in [
        (33, vec![]),
        (32, vec![3]),
        (25, vec![3]),
        (24, vec![3, 2]),
        (16, vec![3, 2, 4]),
        (15, vec![3, 2, 4, 1]),
        (0, vec![3, 2, 4, 1, 0]),
    ] {
        assert_eq!(
            families_to_drop(&counts(&body), budget),
            want,
            "budget {budget}"
        );
    }
    let text = "# HELP a A.\n# TYPE a gauge\na 1\n# HELP b B.\n# TYPE b gauge\nb 2\n# HELP c C.\n# TYPE c gauge\nc 3\n";
    let c = counts(&[("a", 1), ("b", 1), ("c", 1)]);
    assert_eq!(
        without(text, &c, &[1]),
        "# HELP a A.\n# TYPE a gauge\na 1\n# HELP c C.\n# TYPE c gauge\nc 3\n"
    );
}

#[test]
fn a_cut_keeps_the_largest_and_sums_the_rest() {
    for (mode, pods, k, kept_per_gpu, other_count) in [
        // pid mode: the 3 largest of 10 processes, 7 in the rollup.
        (SeriesMode::Pid, 0, 3, 3, 7),
        (SeriesMode::Pid, 0, 10, 10, 0),
        (SeriesMode::Pid, 0, 0, 0, 10),
        // workload mode, 4 pods: the 2 largest pods keep all their
        // processes: pod 1 (2 + 6 + 10 MiB) and pod 0 (1 + 5 + 9).
        (SeriesMode::Workload, 4, 2, 6, 4),
        (SeriesMode::Workload, 4, 0, 0, 10),
    ] {
        let policy = SeriesPolicy {
            mode,
            budget: 0,
            ..SeriesPolicy::default()
        };
        let s = snapshot(2, 10, pods, policy);
        let c = cut(&s, k);
        for (d, before) in c.devices.iter().zip(&s.devices) {
            assert_eq!(d.processes.len(), kept_per_gpu, "{mode:?} k={k}");
            let kept: u64 = d.processes.iter().filter_map(|p| p.used_bytes).sum();
            let other = d.other.map_or(0, |o| o.used_bytes);
            let all: u64 = before.processes.iter().filter_map(|p| p.used_bytes).sum();
            assert_eq!(kept + other, all, "{mode:?} k={k}: totals kept");
            assert_eq!(d.other.map_or(0, |o| o.count), other_count);
            let smallest_kept = d.processes.iter().filter_map(|p| p.used_bytes).min();
            let largest_cut = before
                .processes
                .iter()
                .filter(|p| !d.processes.iter().any(|q| q.pid == p.pid))
                .filter_map(|p| p.used_bytes)
                .max();
            if mode == SeriesMode::Pid
                && let (Some(a), Some(b)) = (smallest_kept, largest_cut)
            {
                assert!(a > b, "largest kept");
            }
            assert!(d.processes.windows(2).all(|w| w[0].pid < w[1].pid));
        }
    }
}

#[test]
fn bodies_stay_within_the_budget_and_sum_to_what_nvml_says() {
    for (mode, pods, budget) in [
        (SeriesMode::Pid, 0, 1_000_000),
        (SeriesMode::Pid, 0, 400),
        (SeriesMode::Pid, 0, 60),
        (SeriesMode::Pid, 0, 5),
        (SeriesMode::Workload, 16, 200),
        (SeriesMode::Workload, 16, 40),
        (SeriesMode::Off, 0, 10),
    ] {
        let s = Arc::new(snapshot(
            4,
            64,
            pods,
            SeriesPolicy {
                mode,
                budget,
                ..SeriesPolicy::default()
            },
        ));
        let all = SeriesPolicy {
            mode,
            budget: 1_000_000,
            ..SeriesPolicy::default()
        };
        let uncut = Arc::new(snapshot(4, 64, pods, all));
        let uncut = total(&served(
            &crate::expose::encode(&uncut, Format::Text).unwrap_or_default(),
        ));
        for format in [Format::Text, Format::OpenMetrics] {
            let reuse = Reuse::new();
            let body = encode_reusing(&s, format, &reuse).unwrap_or_default();
            let c = served(&body);
            assert!(
                total(&c) <= budget,
                "{mode:?} budget {budget}: {} series",
                total(&c)
            );
            let used = sum_by_uuid(&body, "gpu_process_memory_used_bytes");
            let nvml = sum_by_uuid(&body, "gpu_memory_used_bytes");
            if used.is_empty() {
                assert!(mode == SeriesMode::Off || budget < 20, "{mode:?} {budget}");
            } else {
                assert_eq!(used, nvml, "{mode:?} budget {budget}: sums");
            }
            let dropped = body
                .lines()
                .any(|l| l.starts_with("gpumem_exporter_series_dropped"));
            assert_eq!(dropped, uncut > budget, "{mode:?} {budget}: {uncut} uncut");
            // The gauge says what the body holds, family by family.
            for (family, n) in c.iter().filter(|(_, n)| *n > 0) {
                let line = format!("gpumem_exporter_series{{family=\"{family}\"}} {n}\n");
                assert!(body.contains(&line), "{mode:?} {budget}: {line}");
            }
            // A memory-only snapshot after it reuses the cut.
            let mut next = (*s).clone();
            next.taken_at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1);
            let again = encode_reusing(&Arc::new(next), format, &reuse).unwrap_or_default();
            assert_eq!(reuse.reused(), 1);
            assert!(total(&served(&again)) <= budget);
        }
    }
}

/// A tenant that starts a thousand small processes beside another
/// tenant's one large one: over the budget, the small ones roll up and
/// the victim keeps its series; in workload mode the thousand are one
/// series and nothing is cut.
#[test]
fn a_thousand_small_processes_do_not_push_a_large_one_out() {
    for (mode, budget) in [(SeriesMode::Pid, 300), (SeriesMode::Workload, 300)] {
        let mut s = snapshot(
            1,
            1000,
            0,
            SeriesPolicy {
                mode,
                budget,
                ..SeriesPolicy::default()
            },
        );
        let d = &mut s.devices[0];
        let mut procs: Vec<ProcessSample> = d.processes.to_vec();
        // The attacker's processes are one user's; the victim is pid 1.
        for p in &mut procs {
            p.used_bytes = Some(MIB_);
            p.ident = Arc::new(ProcIdentity {
                user: "mallory".into(),
                ..(*p.ident).clone()
            });
        }
        procs.insert(
            0,
            ProcessSample {
                pid: 1,
                used_bytes: Some(1 << 30),
                ident: Arc::new(ProcIdentity {
                    user: "victim".into(),
                    ..Default::default()
                }),
                ..procs[0].clone()
            },
        );
        d.processes = procs.into();
        let body = crate::expose::encode(&Arc::new(s), Format::Text).unwrap_or_default();
        assert!(total(&served(&body)) <= budget, "{mode:?}");
        let victim = match mode {
            SeriesMode::Pid => "pid=\"1\"",
            _ => "user=\"victim\"",
        };
        assert!(
            body.lines()
                .any(|l| l.starts_with("gpu_process_memory_used_bytes{") && l.contains(victim)),
            "{mode:?}: the victim's series stays"
        );
        let cut = body.contains("gpumem_exporter_series_dropped_total");
        assert_eq!(cut, mode == SeriesMode::Pid, "{mode:?}");
    }
}

const MIB_: u64 = 1 << 20;
