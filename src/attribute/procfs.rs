//! `/proc/<pid>` readers and the pure parsers behind them: comm, owner, start
//! time, command line. The cgroup, passwd and redaction parsers are in
//! [`super::cgroup`], [`super::passwd`] and [`super::redact`].
//!
//! Everything here is std-only, and every parser is a plain `&str → value`
//! function, so attribution (pid → user, container, pod) is table-tested with
//! real-world lines without a kernel, a container runtime or a GPU.
//!
//! Readers return `Option` rather than errors: a process can exit between the
//! moment NVML reports its pid and the moment we read `/proc`, and that race is
//! normal operation, not a failure worth reporting.

use std::fs;
use std::path::{Path, PathBuf};

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

    /// State, parent pid and start time from one read of
    /// `/proc/<pid>/stat`.
    pub fn stat(&self, pid: u32) -> Option<Stat> {
        parse_stat(&self.read_lossy(pid, "stat")?)
    }

    /// `/proc/<pid>/cgroup` as is; see [`parse_cgroup`](super::cgroup::parse_cgroup).
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
pub(crate) fn parse_status_uid(status: &str) -> Option<u32> {
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
pub(crate) fn parse_stat_start_time(stat: &str) -> Option<u64> {
    const FIRST_FIELD_AFTER_COMM: usize = 3;
    const START_TIME_FIELD: usize = 22;
    let (_, after_comm) = stat.rsplit_once(')')?;
    after_comm
        .split_whitespace()
        .nth(START_TIME_FIELD - FIRST_FIELD_AFTER_COMM)?
        .parse()
        .ok()
}

/// What the sampler reads of `/proc/<pid>/stat`: fields 3 (state), 4
/// (parent pid) and 22 (start time). All three are the kernel's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `R`, `S`, `D`, `Z`, `T`, …
    pub state: u8,
    pub ppid: u32,
    pub start: u64,
}

/// Fields 3, 4 and 22 of `/proc/<pid>/stat`, counted after the last `)`
/// as [`parse_stat_start_time`] does.
pub(crate) fn parse_stat(stat: &str) -> Option<Stat> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    let mut fields = after_comm.split_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let ppid = fields.next()?.parse().ok()?;
    // Field 5 on to field 22: 17 more after the parent pid.
    let start = fields.nth(17)?.parse().ok()?;
    Some(Stat { state, ppid, start })
}

/// Splits `/proc/<pid>/cmdline` (arguments each ending in NUL) into arguments.
///
/// All trailing NULs are dropped before splitting: programs that rewrite their
/// title (setproctitle, nginx, postgres) pad the old argv area with NULs, and
/// those are not arguments. The cost is that genuinely empty trailing
/// arguments vanish. Kernel threads and zombies have an empty cmdline, which
/// gives an empty vector.
pub(crate) fn parse_cmdline(bytes: &[u8]) -> Vec<String> {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    if end == 0 {
        return Vec::new();
    }
    bytes[..end]
        .split(|&b| b == 0)
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribute::cgroup::tests::{ID, UID, fill, ident};
    use crate::attribute::cgroup::{Runtime, parse_cgroup};
    use crate::attribute::redact::redact_cmdline;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn parse_stat_reads_state_parent_and_start() {
        let cases = [
            (
                "42 (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777\n",
                Some((b'S', 1, 777)),
            ),
            (
                "7 (my (weird) proc) Z 4411 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 12\n",
                Some((b'Z', 4411, 12)),
            ),
            (
                "9 (x) D 2 9 9 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 6 7\n",
                Some((b'D', 2, 5)),
            ),
            ("9 (x) D 2 9 9 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0\n", None),
            (
                "9 (x) S notapid 9 9 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5\n",
                None,
            ),
            ("no parenthesis", None),
        ];
        for (line, want) in cases {
            let got = parse_stat(line).map(|s| (s.state, s.ppid, s.start));
            assert_eq!(got, want, "{line:?}");
            if let Some((_, _, start)) = want {
                assert_eq!(parse_stat_start_time(line), Some(start));
            }
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
}
