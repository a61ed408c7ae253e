//! Which processes of a GPU get series of their own (`processes.top_n`,
//! `processes.min_bytes`), and the `pid="other"` sum of the rest.

use crate::config::Selection;
use crate::gpu::RawProcess;
use crate::model::OtherProcesses;

/// Indices (into `procs`, which is sorted by pid) of the processes that get
/// their own series, still in pid order, and the sum of the rest. A process
/// without a memory figure has nothing to sum and is always listed.
pub fn select(procs: &[RawProcess], sel: &Selection) -> (Vec<usize>, Option<OtherProcesses>) {
    let mut other = OtherProcesses::default();
    let mut keep: Vec<usize> = Vec::with_capacity(procs.len());
    let mut ranked: Vec<(u64, u32, usize)> = Vec::with_capacity(procs.len());
    for (i, p) in procs.iter().enumerate() {
        match p.used_bytes {
            None if sel.enabled => keep.push(i),
            None => other.count += 1,
            Some(b) if sel.enabled && b >= sel.min_bytes => ranked.push((b, p.pid, i)),
            Some(b) => {
                other.count += 1;
                other.used_bytes += b;
            }
        }
    }
    if sel.top_n > 0 && ranked.len() > sel.top_n {
        ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(b, _, _) in &ranked[sel.top_n..] {
            other.count += 1;
            other.used_bytes += b;
        }
        ranked.truncate(sel.top_n);
    }
    keep.extend(ranked.iter().map(|r| r.2));
    keep.sort_unstable();
    (keep, (other.count > 0).then_some(other))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(pid: u32, used: Option<u64>) -> RawProcess {
        RawProcess {
            pid,
            used_bytes: used,
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    #[test]
    fn selection_keeps_totals() {
        let procs = [
            raw(1, Some(100)),
            raw(2, Some(5)),
            raw(3, None),
            raw(4, Some(50)),
            raw(5, Some(70)),
        ];
        let total: u64 = procs.iter().filter_map(|p| p.used_bytes).sum();
        let cases = [
            (Selection::default(), vec![0, 1, 2, 3, 4], None),
            (
                Selection {
                    top_n: 2,
                    ..Default::default()
                },
                vec![0, 2, 4],
                Some(OtherProcesses {
                    count: 2,
                    used_bytes: 55,
                }),
            ),
            (
                Selection {
                    min_bytes: 60,
                    ..Default::default()
                },
                vec![0, 2, 4],
                Some(OtherProcesses {
                    count: 2,
                    used_bytes: 55,
                }),
            ),
            (
                Selection {
                    min_bytes: 60,
                    top_n: 1,
                    ..Default::default()
                },
                vec![0, 2],
                Some(OtherProcesses {
                    count: 3,
                    used_bytes: 125,
                }),
            ),
            (
                Selection {
                    enabled: false,
                    ..Default::default()
                },
                vec![],
                Some(OtherProcesses {
                    count: 5,
                    used_bytes: 225,
                }),
            ),
        ];
        for (sel, want_keep, want_other) in cases {
            let (keep, other) = select(&procs, &sel);
            assert_eq!(keep, want_keep, "{sel:?}");
            assert_eq!(other, want_other, "{sel:?}");
            let kept: u64 = keep.iter().filter_map(|&i| procs[i].used_bytes).sum();
            assert_eq!(kept + other.map_or(0, |o| o.used_bytes), total, "{sel:?}");
        }
    }
}
