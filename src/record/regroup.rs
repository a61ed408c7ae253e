//! After a clean stop, an OpenMetrics recording is rewritten so that each
//! family appears once, with all its samples, each series' samples
//! together in time order, and one `# EOF`: what a strict OpenMetrics
//! parser (`prometheus_client.openmetrics.parser`) asks for. While
//! recording, the file holds one block per sample (see
//! [`super::openmetrics`]), which Prometheus' parser, and so promtool's
//! backfill, reads as it is; this only changes the order of the lines.
//!
//! **Crash safety.** The regrouped text goes to a temporary file beside
//! the recording (`.<name>.regroup-<pid>`), is synced, and renamed over
//! it: at every moment the path holds either the recording as written
//! or the whole regrouped file. A recorder killed before the rename
//! leaves the recording as written (promtool-valid, not strictly valid)
//! and possibly that temporary file; a regroup that fails (no room for
//! the copy, a line it does not understand) leaves the recording as
//! written and says why.
//!
//! **Memory.** The file is a transpose away from the strict order (it is
//! time → family → series; strict is family → series → time), so this is
//! an external sort rather than a load of the whole file: one sequential
//! pass gives each sample line its (family, series) rank, assigned at
//! first sight, and collects lines into runs of at most [`RUN_BYTES`],
//! each sorted (stably, so time order holds within a series) and written
//! to a spool file (unlinked at once, so nothing is left behind); then a
//! k-way merge of the runs, [`READ_BUFFER`] bytes buffered per run, writes
//! the result. Memory is one run (32 MiB of lines and 24 bytes of index
//! per line) plus 64 KiB per run (one per 32 MiB of recording) plus one
//! key per series (its label set), whatever the length of the recording
//! otherwise; disk needs room for two more copies of the file while it
//! runs (the spool and the result).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, ErrorKind, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The most bytes of lines held in memory before a sorted run is spooled
/// (small in unit tests, so that a few lines make many runs).
#[cfg(not(test))]
const RUN_BYTES: usize = 32 << 20;
#[cfg(test)]
const RUN_BYTES: usize = 4 << 10;
/// Bytes read ahead per run during the merge.
#[cfg(not(test))]
const READ_BUFFER: usize = 64 << 10;
#[cfg(test)]
const READ_BUFFER: usize = 100;

/// Why a recording was left as written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RegroupError {
    #[error("regrouping {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("regrouping {path}: line {line}: {what}")]
    Line {
        path: String,
        line: u64,
        what: &'static str,
    },
    #[error("regrouping {path}: {read} sample lines read but {written} written")]
    Count {
        path: String,
        read: u64,
        written: u64,
    },
}

/// What a regroup did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Regrouped {
    /// Sample lines, the same before and after.
    pub(crate) samples: u64,
    /// The file's size after.
    pub(crate) bytes: u64,
}

/// One family: its metadata lines as first seen, and whether any sample
/// line is its.
#[derive(Default)]
struct Family {
    help: Option<Vec<u8>>,
    typ: Option<Vec<u8>>,
    unit: Option<Vec<u8>>,
    /// Labels that do not tell one series from another (`le` of a
    /// histogram's buckets, `quantile` of a summary), from `# TYPE`.
    group_label: Option<&'static str>,
    /// Series key (labels, less `group_label`) → rank within the family.
    series: HashMap<Vec<u8>, u32>,
}

/// One line of a run: where it sorts, where its bytes are.
struct Entry {
    family: u32,
    series: u32,
    start: usize,
    end: usize,
}

/// Regroup the OpenMetrics recording at `path` in place (see the module
/// doc); on an error the file is as it was.
pub(crate) fn regroup(path: &Path) -> Result<Regrouped, RegroupError> {
    let name = path.display().to_string();
    let io = |source| RegroupError::Io {
        path: name.clone(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "recording".into());
    let pid = std::process::id();
    let spool_path = dir.join(format!(".{file_name}.spool-{pid}"));
    let out_path = dir.join(format!(".{file_name}.regroup-{pid}"));

    let input = File::open(path).map_err(io)?;
    let permissions = input.metadata().map_err(io)?.permissions();
    let spool = create_new(&spool_path).map_err(io)?;
    // Unlinked at once: the spool never outlives the process.
    let _ = std::fs::remove_file(&spool_path);
    let (families, runs, read) = spool_runs(BufReader::new(input), &spool, &name)?;

    let out = create_new(&out_path).map_err(io)?;
    let written = merge(&families, &runs, &spool, out).map_err(|source| {
        let _ = std::fs::remove_file(&out_path);
        io(source)
    });
    let (written, bytes) = written?;
    let done = if written == read {
        std::fs::set_permissions(&out_path, permissions)
            .and_then(|()| std::fs::rename(&out_path, path))
            .map_err(io)
    } else {
        Err(RegroupError::Count {
            path: name.clone(),
            read,
            written,
        })
    };
    if let Err(e) = done {
        let _ = std::fs::remove_file(&out_path);
        return Err(e);
    }
    // The rename made durable; a failure here leaves a complete file.
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(Regrouped {
        samples: read,
        bytes,
    })
}

fn create_new(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
}

/// Pass one: families and series ranked at first sight, the sample lines
/// in sorted runs in `spool`. Returns the families, the runs' (offset,
/// length) and the number of sample lines.
#[allow(clippy::type_complexity)]
fn spool_runs(
    mut input: impl BufRead,
    spool: &File,
    name: &str,
) -> Result<(Vec<Family>, Vec<(u64, u64)>, u64), RegroupError> {
    let io = |source| RegroupError::Io {
        path: name.to_string(),
        source,
    };
    let bad = |line: u64, what: &'static str| RegroupError::Line {
        path: name.to_string(),
        line,
        what,
    };
    let mut ranks = Ranks::default();
    let mut runs = Runs::new(spool);
    let mut line = Vec::new();
    let mut number = 0u64;
    let mut eof = false;
    loop {
        line.clear();
        if input.read_until(b'\n', &mut line).map_err(io)? == 0 {
            break;
        }
        number += 1;
        if eof {
            return Err(bad(number, "a line after # EOF"));
        }
        if line.last() != Some(&b'\n') {
            return Err(bad(number, "no newline at the end of the file"));
        }
        let text = &line[..line.len() - 1];
        if text == b"# EOF" {
            eof = true;
            continue;
        }
        if let Some(meta) = text.strip_prefix(b"# ") {
            ranks
                .metadata(meta, &line)
                .map_err(|what| bad(number, what))?;
            continue;
        }
        let (family, series) = ranks.sample(text).map_err(|what| bad(number, what))?;
        runs.add(family, series, &line).map_err(io)?;
    }
    if !eof {
        return Err(bad(number, "no # EOF at the end"));
    }
    let (runs, samples) = runs.finish().map_err(io)?;
    Ok((ranks.families, runs, samples))
}

/// Pass one's ranks: families in order of first sight (with their
/// metadata lines and their series' ranks), and the family the last
/// metadata line named, which the sample lines after it belong to.
#[derive(Default)]
struct Ranks {
    families: Vec<Family>,
    by_name: HashMap<Vec<u8>, u32>,
    current: Option<u32>,
}

impl Ranks {
    /// A `# HELP`, `# TYPE` or `# UNIT` line (`meta` without its `# `,
    /// `line` as read): the family it names becomes the current one, and
    /// keeps the first line of each kind; `TYPE` also says which label
    /// groups a series' lines. The error is what is wrong with the line.
    fn metadata(&mut self, meta: &[u8], line: &[u8]) -> Result<(), &'static str> {
        const NOT_METADATA: &str = "a comment that is no HELP, TYPE or UNIT";
        let mut parts = meta.splitn(3, |b| *b == b' ');
        let (kind, family) = match (parts.next(), parts.next()) {
            (Some(k), Some(f)) if !f.is_empty() => (k, f),
            _ => return Err(NOT_METADATA),
        };
        let index = self.rank(family);
        self.current = Some(index);
        let f = &mut self.families[index as usize];
        let slot = match kind {
            b"HELP" => &mut f.help,
            b"TYPE" => {
                f.group_label = match parts.next() {
                    Some(b"histogram" | b"gaugehistogram") => Some("le"),
                    Some(b"summary") => Some("quantile"),
                    _ => None,
                };
                &mut f.typ
            }
            b"UNIT" => &mut f.unit,
            _ => return Err(NOT_METADATA),
        };
        if slot.is_none() {
            *slot = Some(line.to_vec());
        }
        Ok(())
    }

    /// The family's rank, given at first sight.
    fn rank(&mut self, family: &[u8]) -> u32 {
        if let Some(i) = self.by_name.get(family) {
            return *i;
        }
        let i = self.families.len() as u32;
        self.families.push(Family::default());
        self.by_name.insert(family.to_vec(), i);
        i
    }

    /// A sample line's (family, series) ranks: the current family, and
    /// its series by label set, ranked at first sight. The error is what
    /// is wrong with the line.
    fn sample(&mut self, text: &[u8]) -> Result<(u32, u32), &'static str> {
        let Some(family) = self.current else {
            return Err("a sample before any # TYPE line");
        };
        let f = &mut self.families[family as usize];
        let key = series_key(text, f.group_label).ok_or("a bad label set")?;
        let next = f.series.len() as u32;
        let series = *f.series.entry(key).or_insert(next);
        Ok((family, series))
    }
}

/// The sample lines of the run being filled (at most [`RUN_BYTES`] of
/// them in memory) and the runs already sorted into the spool.
struct Runs<'a> {
    spool: &'a File,
    /// Bytes written to the spool so far: where the next run starts.
    spooled: u64,
    arena: Vec<u8>,
    entries: Vec<Entry>,
    /// (offset, length) of each run in the spool.
    runs: Vec<(u64, u64)>,
    samples: u64,
}

impl<'a> Runs<'a> {
    fn new(spool: &'a File) -> Self {
        Runs {
            spool,
            spooled: 0,
            arena: Vec::new(),
            entries: Vec::new(),
            runs: Vec::new(),
            samples: 0,
        }
    }

    /// One sample line (`line` as read, newline included) of
    /// (`family`, `series`); the run is spooled once it is full.
    fn add(&mut self, family: u32, series: u32, line: &[u8]) -> std::io::Result<()> {
        let start = self.arena.len();
        self.arena.extend_from_slice(line);
        self.entries.push(Entry {
            family,
            series,
            start,
            end: self.arena.len(),
        });
        self.samples += 1;
        if self.arena.len() >= RUN_BYTES {
            self.spool_run()?;
        }
        Ok(())
    }

    /// The last run spooled (if it has a line); the runs and the number
    /// of sample lines.
    fn finish(mut self) -> std::io::Result<(Vec<(u64, u64)>, u64)> {
        if !self.entries.is_empty() {
            self.spool_run()?;
        }
        Ok((self.runs, self.samples))
    }

    /// The run being filled, sorted, to the end of the spool; memory holds
    /// the next one.
    fn spool_run(&mut self) -> std::io::Result<()> {
        let run = write_run(
            self.spool,
            &mut self.spooled,
            &mut self.entries,
            &mut self.arena,
        )?;
        self.runs.push(run);
        Ok(())
    }
}

/// The series a sample line belongs to: its label set as written, less
/// the `group` label; `None` when the labels do not parse.
fn series_key(line: &[u8], group: Option<&str>) -> Option<Vec<u8>> {
    let open = line.iter().position(|b| *b == b'{' || *b == b' ')?;
    if line[open] == b' ' {
        return Some(Vec::new());
    }
    let mut key = Vec::new();
    let mut i = open + 1;
    loop {
        if line.get(i) == Some(&b'}') {
            return Some(key);
        }
        let eq = i + line[i..].iter().position(|b| *b == b'=')?;
        let name = &line[i..eq];
        if line.get(eq + 1) != Some(&b'"') {
            return None;
        }
        let mut j = eq + 2;
        loop {
            match line.get(j)? {
                b'\\' => j += 2,
                b'"' => break,
                _ => j += 1,
            }
        }
        // `name="value"`, the closing quote included.
        if group.is_none_or(|g| name != g.as_bytes()) {
            key.extend_from_slice(&line[i..=j]);
            key.push(b',');
        }
        i = j + 1;
        match line.get(i)? {
            b',' => i += 1,
            b'}' => {}
            _ => return None,
        }
    }
}

/// Sort `entries` (stably: time order within a series) and append them to
/// `spool` as one run of `family u32, series u32, length u32, bytes`.
fn write_run(
    spool: &File,
    spooled: &mut u64,
    entries: &mut Vec<Entry>,
    arena: &mut Vec<u8>,
) -> std::io::Result<(u64, u64)> {
    entries.sort_by_key(|e| (e.family, e.series));
    let start = *spooled;
    // Written a chunk at a time, so the run is not held twice.
    let mut buf = Vec::with_capacity(READ_BUFFER * 2);
    for e in entries.iter() {
        buf.extend_from_slice(&e.family.to_le_bytes());
        buf.extend_from_slice(&e.series.to_le_bytes());
        buf.extend_from_slice(&((e.end - e.start) as u32).to_le_bytes());
        buf.extend_from_slice(&arena[e.start..e.end]);
        if buf.len() >= READ_BUFFER {
            spool.write_all_at(&buf, *spooled)?;
            *spooled += buf.len() as u64;
            buf.clear();
        }
    }
    spool.write_all_at(&buf, *spooled)?;
    *spooled += buf.len() as u64;
    entries.clear();
    arena.clear();
    Ok((start, *spooled - start))
}

/// One run of the spool, read ahead by position.
struct Run<'a> {
    spool: &'a File,
    pos: u64,
    end: u64,
    buf: Vec<u8>,
    at: usize,
}

impl Run<'_> {
    /// The next record's (family, series) and line, or `None` at the end.
    fn next(&mut self, line: &mut Vec<u8>) -> std::io::Result<Option<(u32, u32)>> {
        let mut head = [0u8; 12];
        if !self.take(&mut head)? {
            return Ok(None);
        }
        let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        line.clear();
        line.resize(word(8) as usize, 0);
        if !self.take(line)? {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "the spool ends inside a record",
            ));
        }
        Ok(Some((word(0), word(4))))
    }

    /// Fill `out` from the run; false when the run is at its end.
    fn take(&mut self, out: &mut [u8]) -> std::io::Result<bool> {
        let mut filled = 0;
        while filled < out.len() {
            if self.at == self.buf.len() {
                let left = self.end - self.pos;
                if left == 0 {
                    return Ok(false);
                }
                let n = left.min(READ_BUFFER as u64) as usize;
                self.buf.resize(n, 0);
                self.spool.read_exact_at(&mut self.buf, self.pos)?;
                self.pos += n as u64;
                self.at = 0;
            }
            let n = (out.len() - filled).min(self.buf.len() - self.at);
            out[filled..filled + n].copy_from_slice(&self.buf[self.at..self.at + n]);
            filled += n;
            self.at += n;
        }
        Ok(true)
    }
}

/// Pass two: merge the runs into `out`, each family's metadata before its
/// first sample, families without samples in their place, then `# EOF`;
/// synced. Returns the sample lines and bytes written.
fn merge(
    families: &[Family],
    runs: &[(u64, u64)],
    spool: &File,
    out: File,
) -> std::io::Result<(u64, u64)> {
    let mut w = BufWriter::with_capacity(256 << 10, out);
    let mut bytes = 0u64;
    let mut put = |w: &mut BufWriter<File>, b: &[u8]| -> std::io::Result<()> {
        bytes += b.len() as u64;
        w.write_all(b)
    };
    let mut readers: Vec<Run<'_>> = runs
        .iter()
        .map(|&(pos, len)| Run {
            spool,
            pos,
            end: pos + len,
            buf: Vec::new(),
            at: 0,
        })
        .collect();
    let mut lines: Vec<Vec<u8>> = vec![Vec::new(); readers.len()];
    let mut heap = BinaryHeap::new();
    for (i, r) in readers.iter_mut().enumerate() {
        if let Some((f, s)) = r.next(&mut lines[i])? {
            heap.push(Reverse((f, s, i)));
        }
    }
    let mut next_family = 0usize;
    let mut samples = 0u64;
    while let Some(Reverse((family, _series, i))) = heap.pop() {
        let family = family as usize;
        while next_family <= family && next_family < families.len() {
            for meta in metadata(&families[next_family]) {
                put(&mut w, meta)?;
            }
            next_family += 1;
        }
        put(&mut w, &lines[i])?;
        samples += 1;
        if let Some((f, s)) = readers[i].next(&mut lines[i])? {
            heap.push(Reverse((f, s, i)));
        }
    }
    while next_family < families.len() {
        for meta in metadata(&families[next_family]) {
            put(&mut w, meta)?;
        }
        next_family += 1;
    }
    put(&mut w, b"# EOF\n")?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok((samples, bytes))
}

fn metadata(f: &Family) -> impl Iterator<Item = &[u8]> {
    [&f.help, &f.typ, &f.unit]
        .into_iter()
        .filter_map(|m| m.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regrouped(input: &str) -> Result<String, RegroupError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("run.om");
        std::fs::write(&p, input).unwrap();
        let r = regroup(&p);
        let text = std::fs::read_to_string(&p).unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "nothing left beside the file");
        match r {
            Ok(r) => {
                assert_eq!(r.bytes, text.len() as u64);
                Ok(text)
            }
            Err(e) => {
                assert_eq!(text, input, "left as it was");
                Err(e)
            }
        }
    }

    #[test]
    fn families_and_series_come_together_in_time_order() {
        let input = "\
# HELP up Up.
# TYPE up gauge
up{i=\"a\",gpu=\"0\"} 1 10.000
up{i=\"a\",gpu=\"1\"} 1 10.000
# HELP used Used.
# TYPE used gauge
used{gpu=\"0\"} 5 10.000
# TYPE up gauge
up{i=\"a\",gpu=\"0\"} 0 11.000
up{i=\"a\",gpu=\"1\"} 1 11.000
# TYPE used gauge
used{gpu=\"0\"} 6 11.000
# HELP h H.
# TYPE h histogram
h_bucket{a=\"x\",le=\"1\"} 1 11.000
h_bucket{a=\"x\",le=\"+Inf\"} 2 11.000
h_sum{a=\"x\"} 3 11.000
h_count{a=\"x\"} 2 11.000
# TYPE up gauge
up{i=\"a\",gpu=\"1\"} 0 12.000
up{i=\"a\",gpu=\"2\"} 1 12.000
# TYPE h histogram
h_bucket{a=\"x\",le=\"1\"} 2 12.000
h_bucket{a=\"x\",le=\"+Inf\"} 3 12.000
h_sum{a=\"x\"} 4 12.000
h_count{a=\"x\"} 3 12.000
# EOF
";
        let want = "\
# HELP up Up.
# TYPE up gauge
up{i=\"a\",gpu=\"0\"} 1 10.000
up{i=\"a\",gpu=\"0\"} 0 11.000
up{i=\"a\",gpu=\"1\"} 1 10.000
up{i=\"a\",gpu=\"1\"} 1 11.000
up{i=\"a\",gpu=\"1\"} 0 12.000
up{i=\"a\",gpu=\"2\"} 1 12.000
# HELP used Used.
# TYPE used gauge
used{gpu=\"0\"} 5 10.000
used{gpu=\"0\"} 6 11.000
# HELP h H.
# TYPE h histogram
h_bucket{a=\"x\",le=\"1\"} 1 11.000
h_bucket{a=\"x\",le=\"+Inf\"} 2 11.000
h_sum{a=\"x\"} 3 11.000
h_count{a=\"x\"} 2 11.000
h_bucket{a=\"x\",le=\"1\"} 2 12.000
h_bucket{a=\"x\",le=\"+Inf\"} 3 12.000
h_sum{a=\"x\"} 4 12.000
h_count{a=\"x\"} 3 12.000
# EOF
";
        assert_eq!(regrouped(input).unwrap(), want);
        // Regrouping a regrouped file changes nothing.
        assert_eq!(regrouped(want).unwrap(), want);
    }

    #[test]
    fn escaped_label_values_and_empty_families() {
        let input = "\
# TYPE a gauge
# TYPE b gauge
b{v=\"x\\\"}le=\\\\\"} 1 1.000
b 2 1.000
# TYPE b gauge
b 3 2.000
b{v=\"x\\\"}le=\\\\\"} 4 2.000
# EOF
";
        let want = "\
# TYPE a gauge
# TYPE b gauge
b{v=\"x\\\"}le=\\\\\"} 1 1.000
b{v=\"x\\\"}le=\\\\\"} 4 2.000
b 2 1.000
b 3 2.000
# EOF
";
        assert_eq!(regrouped(input).unwrap(), want);
    }

    #[test]
    fn what_it_does_not_understand_is_left_alone() {
        for (input, want) in [
            ("# TYPE a gauge\na 1 1.000\n", "line 2: no # EOF at the end"),
            (
                "a 1 1.000\n# EOF\n",
                "line 1: a sample before any # TYPE line",
            ),
            (
                "# TYPE a gauge\na{x=1} 1 1.000\n# EOF\n",
                "line 2: a bad label set",
            ),
            (
                "# TYPE a gauge\n# EOF\na 1 1\n",
                "line 3: a line after # EOF",
            ),
            ("# NOTE a b\n# EOF\n", "line 1: a comment"),
            ("# TYPE a gauge\na 1 1.000", "line 2: no newline"),
        ] {
            let e = regrouped(input).unwrap_err().to_string();
            assert!(e.starts_with("regrouping "), "{e}");
            assert!(e.contains(want), "{input:?}: {e}");
        }
    }

    /// Runs spooled and merged (4 KiB runs in unit tests): lines of many
    /// runs keep their order within each series.
    #[test]
    fn many_runs_merge_in_order() {
        let mut input = String::new();
        let line = "x".repeat(200);
        let samples = (RUN_BYTES / 200) * 20;
        for t in 0..samples / 2 {
            input.push_str("# TYPE m gauge\n");
            for s in 0..2 {
                input.push_str(&format!("m{{s=\"{s}\",p=\"{line}\"}} {t} {t}.000\n"));
            }
        }
        input.push_str("# EOF\n");
        let out = regrouped(&input).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "# TYPE m gauge");
        assert_eq!(lines.len(), 2 + (samples / 2) * 2);
        let half = samples / 2;
        for (i, l) in lines[1..=half].iter().enumerate() {
            assert!(l.starts_with("m{s=\"0\""), "{i}");
            assert!(l.ends_with(&format!(" {i} {i}.000")), "{i}: {l}");
        }
        for (i, l) in lines[half + 1..lines.len() - 1].iter().enumerate() {
            assert!(l.starts_with("m{s=\"1\""), "{i}");
            assert!(l.ends_with(&format!(" {i} {i}.000")), "{i}");
        }
    }
}
