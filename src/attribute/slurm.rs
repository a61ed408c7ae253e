//! cgroup → Slurm job, step and uid: a pure `&str → value` parser beside
//! [`super::cgroup`], table-tested with the paths Slurm's cgroup plugins
//! write.
//!
//! Slurm puts every step of a job in a cgroup whose path names the job:
//! - cgroup v1 (`cgroup/v1`): `/slurm/uid_<uid>/job_<id>/step_<step>/task_<t>`,
//!   or `/slurm_<node>/…` when slurmd runs as several nodes on one host
//!   (`--enable-multiple-slurmd`), under each controller it uses (freezer,
//!   cpuset, memory, devices);
//! - cgroup v2 (`cgroup/v2`): `/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<t>`
//!   (the step's slurmstepd itself in `…/step_<step>/slurm`), or
//!   `<node>_slurmstepd.scope`; slurmd's own processes sit in
//!   `slurmstepd.scope/system`, which is no job;
//! - Slurm 26.05's default v2 layout names the job by its SLUID instead of
//!   `job_<id>` (`…/slurmstepd.scope/<SLUID>/step_<step>/…`;
//!   `CgroupJobIdPaths=yes` restores `job_<id>`).
//!
//! The job is exported as the path holds it: the numeric job id, or the
//! SLUID string. Only at those places: the same names anywhere else (a
//! user's delegated `user@UID.service` subtree, a container's own cgroup)
//! are not a job ([`parse_slurm_path`]). Steps are `batch`, `extern`, `interactive` or a number
//! (`<n>+<het component>` for heterogeneous steps); the uid is only in v1
//! paths.

use super::cgroup::{CgroupLine, lines};

/// A process's Slurm job, as far as its cgroup path tells.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlurmCgroup {
    /// `job_<id>`'s id, or the SLUID (26.05 v2 layout), as written.
    pub job: String,
    /// `step_<step>`'s step; `None` for a process in the job's own cgroup.
    pub step: Option<String>,
    /// `uid_<uid>`'s uid (cgroup v1 only).
    pub uid: Option<String>,
}

impl SlurmCgroup {
    fn rank(&self) -> (bool, bool) {
        (self.step.is_some(), self.uid.is_some())
    }
}

/// The Slurm job of a `/proc/<pid>/cgroup`, if any line's path is in one:
/// the most informative line wins (v1 controllers a job does not use sit
/// elsewhere, e.g. under `slurmd.service`), the first one on ties.
pub(crate) fn parse_slurm_cgroup(content: &str) -> Option<SlurmCgroup> {
    parse_slurm_cgroup_lines(content).job
}

/// What a whole `/proc/<pid>/cgroup` told about Slurm: the job, the line
/// it came from (whose directories' owners the caller checks), and
/// whether some line named a job below a Slurm root out of its place
/// (a forgery: a user can create `…/slurmstepd.scope/job_1/step_0` in a
/// subtree delegated to it, never at the top of the hierarchy).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ParsedSlurm<'a> {
    pub job: Option<SlurmCgroup>,
    pub line: Option<CgroupLine<'a>>,
    pub misplaced: bool,
    /// The first line that named a job out of place.
    pub misplaced_line: Option<CgroupLine<'a>>,
}

/// [`parse_slurm_cgroup`], with the line and whether a job was named out
/// of place.
pub(crate) fn parse_slurm_cgroup_lines(content: &str) -> ParsedSlurm<'_> {
    let mut best = ParsedSlurm::default();
    let mut misplaced = None;
    for line in lines(content) {
        match parse_slurm_path(line.path) {
            Some(found) if best.job.as_ref().is_none_or(|b| found.rank() > b.rank()) => {
                best.job = Some(found);
                best.line = Some(line);
            }
            Some(_) => {}
            None if misplaced.is_none() && parse_slurm_path_anywhere(line.path).is_some() => {
                misplaced = Some(line);
            }
            None => {}
        }
    }
    if best.job.is_none() {
        best.misplaced_line = misplaced;
        best.misplaced = misplaced.is_some();
    }
    best
}

/// The path's segments, the kernel's `(deleted)` suffix dropped.
fn segments(path: &str) -> impl Iterator<Item = &str> {
    let path = path.trim();
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    path.split('/').filter(|s| !s.is_empty())
}

/// The Slurm job of one cgroup path, `None` outside Slurm's hierarchy.
///
/// Slurm's root is recognised only where slurmd makes it: at the top of a
/// v1 hierarchy (`/slurm`, `/slurm_<node>`), or as the scope systemd (or
/// slurmd itself) makes under `/system.slice` on v2. Root-owned places
/// a tenant cannot create; anywhere else the same names are the tenant's
/// own.
pub(crate) fn parse_slurm_path(path: &str) -> Option<SlurmCgroup> {
    let mut segments = segments(path);
    let first = segments.next()?;
    let v2 = if is_v1_root(first) {
        false
    } else if first == "system.slice" && segments.next().is_some_and(is_v2_root) {
        true
    } else {
        return None;
    };
    parse_below_root(segments, v2)
}

/// The old, lax reading: a Slurm root at any depth. Only used to tell a
/// forged path (counted) from a path that names no job at all.
fn parse_slurm_path_anywhere(path: &str) -> Option<SlurmCgroup> {
    let mut segments = segments(path);
    let v2 = loop {
        let s = segments.next()?;
        if is_v1_root(s) {
            break false;
        }
        if is_v2_root(s) {
            break true;
        }
    };
    parse_below_root(segments, v2)
}

/// `slurm` or `slurm_<node>` (v1, `--enable-multiple-slurmd`).
fn is_v1_root(s: &str) -> bool {
    s == "slurm" || s.strip_prefix("slurm_").is_some_and(is_name)
}

/// `slurmstepd.scope` or `<node>_slurmstepd.scope` (v2).
fn is_v2_root(s: &str) -> bool {
    s == "slurmstepd.scope" || s.strip_suffix("_slurmstepd.scope").is_some_and(is_name)
}

/// The job, step and uid below Slurm's root.
fn parse_below_root<'a>(
    mut segments: impl Iterator<Item = &'a str>,
    v2: bool,
) -> Option<SlurmCgroup> {
    let mut uid = None;
    let mut next = segments.next()?;
    if !v2 && let Some(u) = next.strip_prefix("uid_") {
        if !u.bytes().all(|b| b.is_ascii_digit()) || u.is_empty() || u.len() > 10 {
            return None;
        }
        uid = Some(u.to_owned());
        next = segments.next()?;
    }
    let job = match next.strip_prefix("job_") {
        Some(id) if is_job_id(id) => id,
        Some(_) => return None,
        // The SLUID form: v2 only; `system` is slurmd's own cgroup.
        None if v2 && next != "system" && is_sluid(next) => next,
        None => return None,
    };
    let step = segments
        .next()
        .and_then(|s| s.strip_prefix("step_"))
        .filter(|s| is_step(s))
        .map(str::to_owned);
    Some(SlurmCgroup {
        job: job.to_owned(),
        step,
        uid,
    })
}

/// A node name as slurmd puts it in a path.
fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// A numeric job id.
fn is_job_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit())
}

/// A SLUID: a short alphanumeric string (Slurm 26.05 writes it in
/// lower-case base 32); bounded so a label value stays short.
fn is_sluid(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// `batch`, `extern`, `interactive`, a number, or `<n>+<component>`.
fn is_step(s: &str) -> bool {
    match s {
        "batch" | "extern" | "interactive" => true,
        _ => {
            let (n, het) = s.split_once('+').unwrap_or((s, "0"));
            is_job_id(n) && is_job_id(het)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(job: &str, step: Option<&str>, uid: Option<&str>) -> Option<SlurmCgroup> {
        Some(SlurmCgroup {
            job: job.into(),
            step: step.map(Into::into),
            uid: uid.map(Into::into),
        })
    }

    fn check_cgroup_cases(cases: Vec<(&str, &str, Option<SlurmCgroup>)>) {
        for (name, input, want) in cases {
            assert_eq!(parse_slurm_cgroup(input), want, "{name}");
        }
    }

    /// cgroup v1 (Slurm 22.05 on Debian 12, as srun leaves it).
    #[test]
    fn parse_slurm_cgroup_v1() {
        check_cgroup_cases(vec![
            (
                "v1 one node, step 0, hybrid host",
                "13:misc:/\n12:freezer:/slurm_node1/uid_0/job_1/step_0\n11:devices:/slurm_node1/uid_0/job_1/step_0/task_0\n\
                 7:memory:/slurm_node1/uid_0/job_1/step_0/task_0\n1:name=systemd:/system.slice/slurmd.service\n0::/system.slice/slurmd.service\n",
                job("1", Some("0"), Some("0")),
            ),
            (
                "v1 /slurm root, batch step",
                "4:memory:/slurm/uid_1000/job_4242/step_batch/task_0\n3:freezer:/slurm/uid_1000/job_4242/step_batch\n",
                job("4242", Some("batch"), Some("1000")),
            ),
            (
                "v1 extern step (pam_slurm_adopt)",
                "3:freezer:/slurm/uid_1000/job_77/step_extern\n",
                job("77", Some("extern"), Some("1000")),
            ),
            (
                "v1 interactive step (salloc)",
                "5:cpuset:/slurm/uid_1000/job_78/step_interactive/task_0\n",
                job("78", Some("interactive"), Some("1000")),
            ),
            (
                "v1 heterogeneous step",
                "3:freezer:/slurm/uid_1000/job_90/step_2+1\n",
                job("90", Some("2+1"), Some("1000")),
            ),
            (
                "v1 job cgroup without a step",
                "7:memory:/slurm/uid_1000/job_91\n",
                job("91", None, Some("1000")),
            ),
            (
                "v1 the deepest line wins over a job-only one",
                "7:memory:/slurm/uid_1000/job_91\n3:freezer:/slurm/uid_1000/job_91/step_3\n",
                job("91", Some("3"), Some("1000")),
            ),
        ]);
    }

    #[test]
    fn parse_slurm_cgroup_v2() {
        check_cgroup_cases(vec![
            (
                "v2 task",
                "0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0\n",
                job("1234", Some("0"), None),
            ),
            (
                "v2 the step's slurmstepd",
                "0::/system.slice/slurmstepd.scope/job_1234/step_batch/slurm\n",
                job("1234", Some("batch"), None),
            ),
            (
                "v2 multiple slurmd: <node>_slurmstepd.scope",
                "0::/system.slice/gpu-07_slurmstepd.scope/job_55/step_extern/user/task_special\n",
                job("55", Some("extern"), None),
            ),
            (
                "v2 interactive",
                "0::/system.slice/slurmstepd.scope/job_56/step_interactive/user/task_0\n",
                job("56", Some("interactive"), None),
            ),
            (
                "v2 Slurm 26.05 default layout, job by SLUID",
                "0::/system.slice/slurmstepd.scope/s1f0c9kq2h7r4/step_0/user/task_0\n",
                job("s1f0c9kq2h7r4", Some("0"), None),
            ),
            (
                "v2 SLUID, batch step's slurmstepd",
                "0::/system.slice/slurmstepd.scope/s1f0c9kq2h7r4/step_batch/slurm\n",
                job("s1f0c9kq2h7r4", Some("batch"), None),
            ),
            (
                "removed cgroup",
                "0::/system.slice/slurmstepd.scope/job_9/step_1/user/task_0 (deleted)\n",
                job("9", Some("1"), None),
            ),
        ]);
    }

    #[test]
    fn parse_slurm_cgroup_not_a_job() {
        check_cgroup_cases(vec![
            (
                "slurmd's own scope",
                "0::/system.slice/slurmstepd.scope/system\n",
                None,
            ),
            ("slurmd service", "0::/system.slice/slurmd.service\n", None),
            (
                "slurmctld",
                "1:name=systemd:/system.slice/slurmctld.service\n",
                None,
            ),
            (
                "user session",
                "0::/user.slice/user-1000.slice/session-3.scope\n",
                None,
            ),
            (
                "a pod",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod7e6b1f2a_3c4d_4e5f_8a9b_0c1d2e3f4a5b.slice/cri-containerd-3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899.scope\n",
                None,
            ),
            (
                "a docker container",
                "12:pids:/docker/3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899\n",
                None,
            ),
            ("slurm root only", "3:freezer:/slurm\n", None),
            ("bad job id", "3:freezer:/slurm/uid_0/job_x1/step_0\n", None),
            ("bad uid", "3:freezer:/slurm/uid_me/job_1/step_0\n", None),
            (
                "v1 without job_ is no SLUID",
                "3:freezer:/slurm/uid_0/abc/step_0\n",
                None,
            ),
            (
                "a slurm-named directory elsewhere",
                "0::/user.slice/slurmish/job_1\n",
                None,
            ),
            ("empty", "", None),
            ("garbage", "no colons here\n::\n", None),
        ]);
    }

    /// Forged: Slurm's names out of place are no job, and are flagged.
    #[test]
    fn forged_slurm_paths_are_no_job() {
        let cases: Vec<(&str, &str, Option<SlurmCgroup>, bool)> = vec![
            (
                "v2 in a user's delegated subtree",
                "0::/user.slice/user-65534.slice/user@65534.service/app.slice/slurmstepd.scope/job_4242/step_0\n",
                None,
                true,
            ),
            (
                "v2 scope at the top, not under system.slice",
                "0::/slurmstepd.scope/job_4242/step_0/user/task_0\n",
                None,
                true,
            ),
            (
                "v2 under another slice",
                "0::/machine.slice/slurmstepd.scope/job_4242/step_0\n",
                None,
                true,
            ),
            (
                "v2 inside a container's cgroup",
                "0::/system.slice/docker-3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899.scope/system.slice/slurmstepd.scope/job_4242/step_0\n",
                None,
                true,
            ),
            (
                "v1 below a user's session",
                "4:memory:/user.slice/user-1000.slice/session-3.scope/slurm/uid_1000/job_4242/step_0\n",
                None,
                true,
            ),
            (
                "v1 nested below a real job: the real job",
                "3:freezer:/slurm/uid_1000/job_7/step_0/slurm/uid_1001/job_8/step_0\n",
                job("7", Some("0"), Some("1000")),
                false,
            ),
            (
                "a forged line beside a real one: the real one",
                "12:freezer:/slurm/uid_1000/job_7/step_1\n0::/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_9/step_0\n",
                job("7", Some("1"), Some("1000")),
                false,
            ),
            (
                "a uid too long for a uid",
                "3:freezer:/slurm/uid_123456789012/job_7/step_1\n",
                None,
                false,
            ),
            (
                "no Slurm name at all",
                "0::/user.slice/user-1000.slice/session-3.scope\n",
                None,
                false,
            ),
        ];
        for (name, input, want, misplaced) in cases {
            let got = parse_slurm_cgroup_lines(input);
            assert_eq!(got.job, want, "{name}");
            assert_eq!(got.misplaced, misplaced, "{name} misplaced");
        }
        let got = parse_slurm_cgroup_lines(
            "7:memory:/slurm/uid_0/job_1\n3:freezer:/slurm/uid_0/job_1/step_0\n",
        );
        assert_eq!(
            got.line,
            Some(CgroupLine {
                controllers: "freezer",
                path: "/slurm/uid_0/job_1/step_0"
            })
        );
    }

    #[test]
    fn odd_steps_keep_the_job() {
        assert_eq!(
            parse_slurm_path("/slurm/uid_0/job_5/step_what"),
            job("5", None, Some("0"))
        );
        let long = format!("/system.slice/slurmstepd.scope/{}/step_0", "a".repeat(33));
        assert_eq!(parse_slurm_path(&long), None);
    }
}
