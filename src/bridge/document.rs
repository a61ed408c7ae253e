//! The bridge's document: one small JSON object (at most
//! [`MAX_DOCUMENT_BYTES`]) of allocator figures per device, the same
//! whichever way it travels (a socket message, [`super::frame`], or the
//! memfd of the fd fallback, [`super::fdscan`]):
//!
//! ```json
//! {"v":1,"seq":7,
//!  "allocator":{"backend":"native","expandable_segments":false,"max_split_size":null},
//!  "devices":[{"uuid":"GPU-…","allocated":0,"reserved":0,
//!   "allocated_peak":0,"reserved_peak":0,"active":0,"inactive_split":0,
//!   "alloc_retries":0,"ooms":0,
//!   "pools":{"large":{"allocated":0,"reserved":0,"inactive_split":0,"segments":0},
//!            "small":{"allocated":0,"reserved":0,"inactive_split":0,"segments":0}},
//!   "limit":75377410048,"oom_snapshots":0,
//!   "steps":{"total":812,"ring":[[749,1764633600.125,8589934592],…]},
//!   "threshold":{"bytes":64424509440,"crossings":1,"above":true}}]}
//! ```
//!
//! `steps` (the bridge's optimizer step hook: per step end, the step
//! number, the time and allocated bytes, the last ≤ 128 steps) is reduced
//! here to what is exported: the total, allocated at the last step, the
//! least-squares growth per step over the last [`trend::MAX_GROWTH_STEPS`]
//! (none under [`trend::MIN_GROWTH_STEPS`]) and the steps per second over
//! them; nothing of the ring is kept. `threshold` is the bridge's
//! `GPUMEM_BRIDGE_WARN_AT` in bytes and its upward crossings.
//!
//! The eight figures of a device are required. `pools`, `limit`,
//! `oom_snapshots`, `steps`, `threshold` and the process-wide `allocator`
//! are optional (a bridge before them, a torch without the figure, a
//! setting not made: their series are simply absent), but each is strict
//! when present: `pools` needs both pools with all four figures,
//! `allocator` all three fields (`max_split_size` a number or `null`) and a
//! known backend, so label values stay a closed set. The document carries
//! no pid that counts: a claimed one is ignored, the kernel says who sent
//! it.

use serde::Deserialize;

use crate::model::{
    AllocatorBackend, AllocatorSettings, TorchPool, TorchPools, TorchStats, TorchSteps,
    TorchThreshold,
};
use crate::trend;

/// Why a document was dropped: the `reason` label of
/// `gpumem_exporter_torch_reports_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum DropReason {
    /// Not JSON, wrong types, a missing field, an unknown version, no
    /// socket header, or the file is not a sealed memfd.
    Malformed,
    /// Larger than [`MAX_DOCUMENT_BYTES`] (a socket message: than
    /// [`super::frame::MAX_MESSAGE_BYTES`]).
    Oversized,
    /// The exporter may not look at the process's fds (counted once per
    /// process).
    Permission,
}

impl DropReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::Oversized => "oversized",
            DropReason::Permission => "permission",
        }
    }
}

/// Larger documents are dropped (reason `oversized`) without being parsed.
pub(crate) const MAX_DOCUMENT_BYTES: u64 = 64 * 1024;
/// A step ring longer than this is malformed (the bridge keeps 128).
pub(crate) const MAX_RING: usize = 1024;
/// The `v` field this reader understands.
pub(crate) const PROTOCOL_VERSION: u32 = 1;

/// A parsed document: allocator figures per device UUID, in the
/// document's order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Document {
    pub devices: Vec<(String, TorchStats)>,
}

impl Document {
    /// What it takes on the heap (its devices and their UUIDs): what the
    /// socket's memory bounds count.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.devices.capacity() * std::mem::size_of::<(String, TorchStats)>()
            + self
                .devices
                .iter()
                .map(|(u, _)| u.capacity())
                .sum::<usize>()
    }

    /// The figures of the first entry naming one of `uuids` (a MIG
    /// instance's UUID and its GPU's, or just the GPU's).
    pub(crate) fn stats_for(&self, uuids: &[&str]) -> Option<TorchStats> {
        uuids.iter().find_map(|want| {
            self.devices
                .iter()
                .find(|(u, _)| same_uuid(u, want))
                .map(|(_, s)| *s)
        })
    }
}

#[derive(Deserialize)]
struct WireDocument {
    v: u32,
    devices: Vec<WireDevice>,
    allocator: Option<WireAllocator>,
}

#[derive(Deserialize)]
struct WireDevice {
    uuid: String,
    allocated: u64,
    reserved: u64,
    allocated_peak: u64,
    reserved_peak: u64,
    active: u64,
    inactive_split: u64,
    alloc_retries: u64,
    ooms: u64,
    pools: Option<WirePools>,
    limit: Option<u64>,
    oom_snapshots: Option<u64>,
    steps: Option<WireSteps>,
    threshold: Option<WireThreshold>,
}

#[derive(Deserialize)]
struct WireSteps {
    total: u64,
    /// `[step, unix seconds, allocated bytes]`, oldest first, steps
    /// strictly increasing.
    ring: Vec<(u64, f64, u64)>,
}

#[derive(Deserialize)]
struct WireThreshold {
    bytes: u64,
    crossings: u64,
    above: bool,
}

#[derive(Deserialize)]
struct WirePools {
    large: WirePool,
    small: WirePool,
}

#[derive(Deserialize)]
struct WirePool {
    allocated: u64,
    reserved: u64,
    inactive_split: u64,
    segments: u64,
}

impl WirePool {
    // A method of the wire type, not `From` on the model's: the model
    // module must not depend on this one (scripts/ci/check-cycles).
    fn into_pool(self) -> TorchPool {
        TorchPool {
            allocated: self.allocated,
            reserved: self.reserved,
            inactive_split: self.inactive_split,
            segments: self.segments,
        }
    }
}

#[derive(Deserialize)]
struct WireAllocator {
    backend: WireBackend,
    expandable_segments: bool,
    /// Required, `null` for unlimited (a plain `Option` would also take a
    /// missing field as unlimited).
    #[serde(deserialize_with = "Option::deserialize")]
    max_split_size: Option<u64>,
}

#[derive(Deserialize)]
enum WireBackend {
    #[serde(rename = "native")]
    Native,
    #[serde(rename = "cudaMallocAsync")]
    CudaMallocAsync,
}

/// The exported step figures of a ring, or `None` (malformed) when its
/// steps do not strictly increase, a time is not a finite non-negative
/// number, or it holds more steps than `total` or than [`MAX_RING`].
fn steps(w: WireSteps) -> Option<TorchSteps> {
    let ring = &w.ring;
    if ring.len() > MAX_RING || ring.len() as u64 > w.total {
        return None;
    }
    if ring.windows(2).any(|p| p[0].0 >= p[1].0)
        || ring.iter().any(|e| !e.1.is_finite() || e.1 < 0.0)
    {
        return None;
    }
    let window = &ring[ring.len().saturating_sub(trend::MAX_GROWTH_STEPS)..];
    let growth = if window.len() >= trend::MIN_GROWTH_STEPS {
        trend::slope(&window.iter().map(|e| (e.0, e.2)).collect::<Vec<_>>())
    } else {
        None
    };
    let pace = match (window.first(), window.last()) {
        (Some(a), Some(b)) => {
            let ms = ((b.1 - a.1) * 1000.0).round();
            (ms >= 1.0 && b.0 > a.0).then(|| (b.0 - a.0, ms as u64))
        }
        _ => None,
    };
    Some(TorchSteps {
        total: w.total,
        allocated: window.last().map(|e| e.2),
        growth,
        pace,
        window: window.len() as u32,
    })
}

/// Parse a document strictly: every device field is required and must be a
/// non-negative integer; unknown fields (such as a claimed `pid`) are
/// ignored.
pub(crate) fn parse(bytes: &[u8]) -> Result<Document, DropReason> {
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(DropReason::Oversized);
    }
    let w: WireDocument = serde_json::from_slice(bytes).map_err(|_| DropReason::Malformed)?;
    if w.v != PROTOCOL_VERSION {
        return Err(DropReason::Malformed);
    }
    let allocator = w.allocator.map(|a| AllocatorSettings {
        backend: match a.backend {
            WireBackend::Native => AllocatorBackend::Native,
            WireBackend::CudaMallocAsync => AllocatorBackend::CudaMallocAsync,
        },
        expandable_segments: a.expandable_segments,
        max_split_size: a.max_split_size,
    });
    let mut devices = Vec::with_capacity(w.devices.len());
    for d in w.devices {
        let steps = match d.steps {
            Some(st) => Some(steps(st).ok_or(DropReason::Malformed)?),
            None => None,
        };
        devices.push((
            d.uuid,
            TorchStats {
                allocated: d.allocated,
                reserved: d.reserved,
                allocated_peak: d.allocated_peak,
                reserved_peak: d.reserved_peak,
                active: d.active,
                inactive_split: d.inactive_split,
                alloc_retries: d.alloc_retries,
                ooms: d.ooms,
                pools: d.pools.map(|p| TorchPools {
                    large: p.large.into_pool(),
                    small: p.small.into_pool(),
                }),
                limit: d.limit,
                allocator,
                oom_snapshots: d.oom_snapshots,
                steps,
                threshold: d.threshold.map(|t| TorchThreshold {
                    bytes: t.bytes,
                    crossings: t.crossings,
                    above: t.above,
                }),
            },
        ));
    }
    Ok(Document { devices })
}

/// The UUID without NVML's `GPU-` / `MIG-` prefix.
fn bare_uuid(u: &str) -> &str {
    let u = u.trim();
    match u.get(..4) {
        Some(p) if p.eq_ignore_ascii_case("GPU-") || p.eq_ignore_ascii_case("MIG-") => &u[4..],
        _ => u,
    }
}

/// Whether two device UUIDs name the same device. Torch gives the bare
/// 8-4-4-4-12 form (the bridge prefixes `GPU-`); under MIG the same bytes
/// are the instance's UUID, which NVML spells `MIG-…`: compare what follows
/// the prefix, ignoring case.
pub(crate) fn same_uuid(a: &str, b: &str) -> bool {
    let (a, b) = (bare_uuid(a), bare_uuid(b));
    !a.is_empty() && a.eq_ignore_ascii_case(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const U0: &str = "GPU-8f2c1d3e-0000-4000-8000-000000000000";

    fn dev(uuid: &str, base: u64) -> String {
        format!(
            r#"{{"uuid":"{uuid}","allocated":{},"reserved":{},"allocated_peak":{},"reserved_peak":{},"active":{},"inactive_split":{},"alloc_retries":{},"ooms":{}}}"#,
            base,
            base + 1,
            base + 2,
            base + 3,
            base + 4,
            base + 5,
            base + 6,
            base + 7
        )
    }

    fn stats(base: u64) -> TorchStats {
        TorchStats {
            allocated: base,
            reserved: base + 1,
            allocated_peak: base + 2,
            reserved_peak: base + 3,
            active: base + 4,
            inactive_split: base + 5,
            alloc_retries: base + 6,
            ooms: base + 7,
            ..TorchStats::default()
        }
    }

    /// `dev(uuid, base)` with the optional fields: pools from `base`,
    /// `extra` appended verbatim (e.g. `,"limit":5`).
    fn dev_with(uuid: &str, base: u64, extra: &str) -> String {
        let pool = |b: u64| {
            format!(
                r#"{{"allocated":{},"reserved":{},"inactive_split":{},"segments":{}}}"#,
                b,
                b + 1,
                b + 2,
                b + 3
            )
        };
        let d = dev(uuid, base);
        format!(
            r#"{},"pools":{{"large":{},"small":{}}}{extra}}}"#,
            &d[..d.len() - 1],
            pool(base + 100),
            pool(base + 200)
        )
    }

    fn pools(base: u64) -> TorchPools {
        let pool = |b: u64| TorchPool {
            allocated: b,
            reserved: b + 1,
            inactive_split: b + 2,
            segments: b + 3,
        };
        TorchPools {
            large: pool(base + 100),
            small: pool(base + 200),
        }
    }

    fn ok_devices(devs: Vec<(&str, u64)>) -> Result<Document, DropReason> {
        Ok(Document {
            devices: devs
                .into_iter()
                .map(|(u, b)| (u.to_string(), stats(b)))
                .collect(),
        })
    }

    fn check_parse_cases(cases: Vec<(&str, String, Result<Document, DropReason>)>) {
        for (name, input, want) in cases {
            assert_eq!(parse(input.as_bytes()), want, "case {name:?}");
        }
    }

    #[test]
    fn parse_accepts_documents() {
        check_parse_cases(vec![
            (
                "one device",
                format!(r#"{{"v":1,"seq":3,"devices":[{}]}}"#, dev(U0, 10)),
                ok_devices(vec![(U0, 10)]),
            ),
            (
                "two devices, order kept",
                format!(
                    r#"{{"v":1,"devices":[{},{}]}}"#,
                    dev("GPU-b", 1),
                    dev("GPU-a", 2)
                ),
                ok_devices(vec![("GPU-b", 1), ("GPU-a", 2)]),
            ),
            (
                "no devices",
                r#"{"v":1,"devices":[]}"#.into(),
                ok_devices(vec![]),
            ),
            (
                "unknown fields, a claimed pid among them, are ignored",
                format!(
                    r#"{{"v":1,"pid":1,"host":"x","devices":[{}]}}"#,
                    dev(U0, 0).replace("{\"uuid\"", "{\"pid\":1,\"extra\":[1,2],\"uuid\"")
                ),
                ok_devices(vec![(U0, 0)]),
            ),
            (
                "u64 max",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 0).replace("\"allocated\":0", &format!("\"allocated\":{}", u64::MAX))
                ),
                Ok(Document {
                    devices: vec![(
                        U0.to_string(),
                        TorchStats {
                            allocated: u64::MAX,
                            ..stats(0)
                        },
                    )],
                }),
            ),
            (
                "surrounding whitespace",
                "\n {\"v\":1,\"devices\":[]} \n".into(),
                ok_devices(vec![]),
            ),
        ]);
    }

    #[test]
    fn parse_size_limit() {
        let padded = format!(
            r#"{{"v":1,"devices":[],"pad":"{}"}}"#,
            "x".repeat(MAX_DOCUMENT_BYTES as usize)
        );
        let just_fits = {
            let head = r#"{"v":1,"devices":[]}"#;
            format!(
                "{head}{}",
                " ".repeat(MAX_DOCUMENT_BYTES as usize - head.len())
            )
        };
        check_parse_cases(vec![
            ("just fits", just_fits, ok_devices(vec![])),
            ("oversized", padded, Err(DropReason::Oversized)),
        ]);
    }

    #[test]
    fn parse_rejects_malformed_json() {
        check_parse_cases(vec![
            ("empty", "".into(), Err(DropReason::Malformed)),
            ("not json", "hello".into(), Err(DropReason::Malformed)),
            ("array", "[]".into(), Err(DropReason::Malformed)),
            ("null", "null".into(), Err(DropReason::Malformed)),
            (
                "trailing garbage",
                r#"{"v":1,"devices":[]}x"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "truncated",
                r#"{"v":1,"devices":[{"uuid":"GPU-a","#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "missing v",
                r#"{"devices":[]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "future version",
                r#"{"v":2,"devices":[]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "missing devices",
                r#"{"v":1}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "devices not a list",
                r#"{"v":1,"devices":{}}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "deep nesting",
                format!(r#"{{"v":1,"devices":[],"x":{}}}"#, "[".repeat(10_000)),
                Err(DropReason::Malformed),
            ),
        ]);
    }

    #[test]
    fn parse_rejects_malformed_device_entries() {
        check_parse_cases(vec![
            (
                "string figure",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 5).replace("\"allocated\":5", "\"allocated\":\"5\"")
                ),
                Err(DropReason::Malformed),
            ),
            (
                "negative figure",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 5).replace("\"ooms\":12", "\"ooms\":-1")
                ),
                Err(DropReason::Malformed),
            ),
            (
                "fractional figure",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 5).replace("\"reserved\":6", "\"reserved\":6.5")
                ),
                Err(DropReason::Malformed),
            ),
            (
                "figure beyond u64",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 5).replace("\"active\":9", "\"active\":18446744073709551616")
                ),
                Err(DropReason::Malformed),
            ),
            (
                "missing figure",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 5).replace(",\"ooms\":12", "")
                ),
                Err(DropReason::Malformed),
            ),
            (
                "uuid not a string",
                format!(
                    r#"{{"v":1,"devices":[{}]}}"#,
                    dev(U0, 5).replace(&format!("\"{U0}\""), "7")
                ),
                Err(DropReason::Malformed),
            ),
        ]);
        // A UUID that is not UTF-8. (Fields that are ignored are skipped
        // without being decoded.)
        let mut bytes = format!(r#"{{"v":1,"devices":[{}]}}"#, dev("GPU-\u{1}", 0)).into_bytes();
        let at = bytes.iter().position(|b| *b == 1).unwrap();
        bytes[at] = 0xff;
        assert_eq!(parse(&bytes), Err(DropReason::Malformed));
    }

    fn settings(
        backend: AllocatorBackend,
        expandable_segments: bool,
        max_split_size: Option<u64>,
    ) -> Option<AllocatorSettings> {
        Some(AllocatorSettings {
            backend,
            expandable_segments,
            max_split_size,
        })
    }

    /// A one-device document: `alloc` is the allocator member with its
    /// trailing comma (or nothing), `dev` the device entry.
    fn one(alloc: &str, dev: String) -> String {
        format!(r#"{{"v":1,{alloc}"devices":[{dev}]}}"#)
    }

    const A_NATIVE: &str =
        r#""allocator":{"backend":"native","expandable_segments":false,"max_split_size":null}"#;

    fn check_optional_cases(cases: Vec<(&str, String, Result<Document, DropReason>)>) {
        for (name, input, want) in cases {
            assert_eq!(parse(input.as_bytes()), want, "case {name:?}: {input}");
        }
    }

    /// Pools, the limit and the OOM snapshot count, present or not.
    #[test]
    fn optional_fields_are_read() {
        let full = TorchStats {
            pools: Some(pools(10)),
            limit: Some(75_377_410_048),
            allocator: settings(AllocatorBackend::Native, false, None),
            oom_snapshots: Some(2),
            ..stats(10)
        };
        let with = |extra: &str| dev_with(U0, 10, extra);
        let ok = |s: TorchStats| {
            Ok(Document {
                devices: vec![(U0.to_string(), s)],
            })
        };
        check_optional_cases(vec![
            (
                "everything",
                one(
                    &format!("{A_NATIVE},"),
                    with(r#","limit":75377410048,"oom_snapshots":2"#),
                ),
                ok(full),
            ),
            (
                "pools only",
                one("", with("")),
                ok(TorchStats {
                    pools: Some(pools(10)),
                    ..stats(10)
                }),
            ),
            (
                "null limit and snapshots are absent",
                one(
                    "",
                    dev(U0, 10).replace('}', r#","limit":null,"oom_snapshots":null}"#),
                ),
                ok(stats(10)),
            ),
            (
                "a limit of 0 is a limit",
                one("", dev(U0, 10).replace('}', r#","limit":0}"#)),
                ok(TorchStats {
                    limit: Some(0),
                    ..stats(10)
                }),
            ),
        ]);
    }

    /// The allocator settings reach every device; any other spelling of
    /// them drops the document.
    #[test]
    fn allocator_settings_table() {
        check_optional_cases(vec![
            (
                "settings reach every device",
                format!(
                    r#"{{"devices":[{},{}],"allocator":{{"max_split_size":134217728,"expandable_segments":true,"backend":"cudaMallocAsync","future":1}},"v":1}}"#,
                    dev("GPU-a", 1),
                    dev("GPU-b", 2)
                ),
                Ok(Document {
                    devices: vec![
                        (
                            "GPU-a".into(),
                            TorchStats {
                                allocator: settings(
                                    AllocatorBackend::CudaMallocAsync,
                                    true,
                                    Some(134_217_728),
                                ),
                                ..stats(1)
                            },
                        ),
                        (
                            "GPU-b".into(),
                            TorchStats {
                                allocator: settings(
                                    AllocatorBackend::CudaMallocAsync,
                                    true,
                                    Some(134_217_728),
                                ),
                                ..stats(2)
                            },
                        ),
                    ],
                }),
            ),
            (
                "unknown backend",
                one(
                    &format!("{},", A_NATIVE.replace("native", "async")),
                    dev(U0, 10),
                ),
                Err(DropReason::Malformed),
            ),
            (
                "backend spelled otherwise",
                one(
                    &format!("{},", A_NATIVE.replace("native", "Native")),
                    dev(U0, 10),
                ),
                Err(DropReason::Malformed),
            ),
            (
                "max_split_size missing (null is unlimited, absent is broken)",
                one(
                    r#""allocator":{"backend":"native","expandable_segments":false},"#,
                    dev(U0, 10),
                ),
                Err(DropReason::Malformed),
            ),
            (
                "expandable_segments as a string",
                one(
                    &format!("{},", A_NATIVE.replace("false", r#""False""#)),
                    dev(U0, 10),
                ),
                Err(DropReason::Malformed),
            ),
            (
                "the raw environment instead of settings",
                one(r#""allocator":"expandable_segments:True","#, dev(U0, 10)),
                Err(DropReason::Malformed),
            ),
        ]);
    }

    /// A malformed pool, limit or snapshot count drops the document.
    #[test]
    fn malformed_optional_fields_table() {
        let with = |extra: &str| dev_with(U0, 10, extra);
        check_optional_cases(vec![
            (
                "a pool missing",
                one("", dev(U0, 10).replace('}', r#","pools":{"large":{"allocated":1,"reserved":1,"inactive_split":1,"segments":1}}}"#)),
                Err(DropReason::Malformed),
            ),
            (
                "a pool figure missing",
                one("", with("").replace(r#","segments":113"#, "")),
                Err(DropReason::Malformed),
            ),
            (
                "a pool figure negative",
                one("", with("").replace(r#""segments":213"#, r#""segments":-1"#)),
                Err(DropReason::Malformed),
            ),
            (
                "pools not an object",
                one("", dev(U0, 10).replace('}', r#","pools":[1,2]}"#)),
                Err(DropReason::Malformed),
            ),
            (
                "negative limit",
                one("", dev(U0, 10).replace('}', r#","limit":-1}"#)),
                Err(DropReason::Malformed),
            ),
            (
                "fractional snapshot count",
                one("", dev(U0, 10).replace('}', r#","oom_snapshots":1.5}"#)),
                Err(DropReason::Malformed),
            ),
        ]);
    }

    const MIB: u64 = 1 << 20;

    /// `n` steps ending at step `last`, 0.1 s apart, allocated growing by
    /// `per` bytes per step from 1 GiB.
    fn ring(n: u64, last: u64, per: u64) -> String {
        let entries: Vec<String> = (last + 1 - n..=last)
            .map(|s| {
                format!(
                    "[{s},{:.3},{}]",
                    1000.0 + s as f64 * 0.1,
                    (1 << 30) + s * per
                )
            })
            .collect();
        format!("[{}]", entries.join(","))
    }

    /// The step figures of a one-device document whose entry's `steps` is
    /// `steps`.
    fn parse_steps(steps: &str) -> Result<Option<TorchSteps>, DropReason> {
        let d = dev_with(U0, 10, &format!(r#","steps":{steps}"#));
        parse(format!(r#"{{"v":1,"devices":[{d}]}}"#).as_bytes()).map(|d| d.devices[0].1.steps)
    }

    type StepWant = Result<Option<(u64, Option<u64>, Option<f64>, u32)>, DropReason>;

    fn check_step_cases(cases: Vec<(&str, String, StepWant)>) {
        for (name, steps, want) in cases {
            let got = parse_steps(&steps)
                .map(|s| s.map(|s| (s.total, s.allocated, s.growth_bytes(), s.window)));
            assert_eq!(got, want, "{name}: {steps}");
        }
    }

    /// The step figures a device entry's `steps` becomes, case by case.
    #[test]
    fn step_rings() {
        check_step_cases(vec![
            (
                "70 steps keeping 3 MiB: the last 64 give exactly 3 MiB",
                format!(r#"{{"total":70,"ring":{}}}"#, ring(70, 70, 3 * MIB)),
                Ok(Some((
                    70,
                    Some((1 << 30) + 70 * 3 * MIB),
                    Some(3.0 * MIB as f64),
                    64,
                ))),
            ),
            (
                "16 steps: enough",
                format!(r#"{{"total":900,"ring":{}}}"#, ring(16, 900, MIB)),
                Ok(Some((
                    900,
                    Some((1 << 30) + 900 * MIB),
                    Some(MIB as f64),
                    16,
                ))),
            ),
            (
                "15 steps: no growth yet",
                format!(r#"{{"total":15,"ring":{}}}"#, ring(15, 15, MIB)),
                Ok(Some((15, Some((1 << 30) + 15 * MIB), None, 15))),
            ),
            (
                "a steady loop",
                format!(r#"{{"total":128,"ring":{}}}"#, ring(128, 128, 0)),
                Ok(Some((128, Some(1 << 30), Some(0.0), 64))),
            ),
            (
                "hooked, no step yet",
                r#"{"total":0,"ring":[]}"#.into(),
                Ok(Some((0, None, None, 0))),
            ),
            (
                "unknown fields inside steps are ignored",
                format!(r#"{{"total":20,"ring":{},"later":1}}"#, ring(20, 20, 0)),
                Ok(Some((20, Some(1 << 30), Some(0.0), 20))),
            ),
        ]);
        // The pace: 63 steps over the last 64 entries, 6.3 s apart.
        let s = parse_steps(&format!(r#"{{"total":70,"ring":{}}}"#, ring(70, 70, 0)));
        let s = s.ok().flatten().and_then(|s| s.steps_per_second());
        assert!(s.is_some_and(|s| (s - 10.0).abs() < 1e-9), "{s:?}");
        // No steps field: an older bridge.
        assert_eq!(
            parse(format!(r#"{{"v":1,"devices":[{}]}}"#, dev(U0, 10)).as_bytes())
                .map(|d| d.devices[0].1.steps),
            Ok(None)
        );
    }

    /// Steps that break the contract drop the whole document.
    #[test]
    fn step_rings_malformed() {
        check_step_cases(vec![
            (
                "steps going back",
                r#"{"total":3,"ring":[[2,1.0,5],[1,2.0,5]]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "a step twice",
                r#"{"total":3,"ring":[[2,1.0,5],[2,2.0,5]]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "a negative time",
                r#"{"total":3,"ring":[[1,-1.0,5]]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "more steps than total",
                format!(r#"{{"total":3,"ring":{}}}"#, ring(4, 4, 0)),
                Err(DropReason::Malformed),
            ),
            (
                "a ring over 1024",
                format!(r#"{{"total":5000,"ring":{}}}"#, ring(1025, 5000, 0)),
                Err(DropReason::Malformed),
            ),
            (
                "no ring",
                r#"{"total":3}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "an entry of two",
                r#"{"total":3,"ring":[[1,1.0]]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "negative bytes",
                r#"{"total":3,"ring":[[1,1.0,-5]]}"#.into(),
                Err(DropReason::Malformed),
            ),
            (
                "a string total",
                r#"{"total":"3","ring":[]}"#.into(),
                Err(DropReason::Malformed),
            ),
        ]);
    }

    #[test]
    fn thresholds() {
        let with = |t: &str| {
            let d = dev_with(U0, 10, &format!(r#","threshold":{t}"#));
            parse(format!(r#"{{"v":1,"devices":[{d}]}}"#).as_bytes())
                .map(|d| d.devices[0].1.threshold)
        };
        let cases = [
            (
                r#"{"bytes":1000,"crossings":2,"above":true}"#,
                Ok(Some(TorchThreshold {
                    bytes: 1000,
                    crossings: 2,
                    above: true,
                })),
            ),
            (
                r#"{"bytes":1000,"crossings":0,"above":false,"later":1}"#,
                Ok(Some(TorchThreshold {
                    bytes: 1000,
                    crossings: 0,
                    above: false,
                })),
            ),
            (
                r#"{"bytes":1000,"crossings":0}"#,
                Err(DropReason::Malformed),
            ),
            (
                r#"{"bytes":0.5,"crossings":0,"above":false}"#,
                Err(DropReason::Malformed),
            ),
            (
                r#"{"bytes":1000,"crossings":0,"above":"yes"}"#,
                Err(DropReason::Malformed),
            ),
        ];
        for (t, want) in cases {
            assert_eq!(with(t), want, "{t}");
        }
    }

    #[test]
    fn uuid_matching() {
        let bare = "8f2c1d3e-0000-4000-8000-000000000000";
        let cases = [
            (U0, U0, true),
            (U0, bare, true),
            (&U0.to_lowercase(), &U0.to_uppercase(), true),
            (U0, "MIG-8f2c1d3e-0000-4000-8000-000000000000", true),
            (U0, "GPU-8f2c1d3e-0000-4000-8000-000000000001", false),
            ("GPU-", "MIG-", false),
            ("", "", false),
            (U0, "GPU-8f2c1d3e", false),
        ];
        for (a, b, want) in cases {
            assert_eq!(same_uuid(a, b), want, "{a:?} vs {b:?}");
            assert_eq!(same_uuid(b, a), want, "{b:?} vs {a:?}");
        }
        let doc = Document {
            devices: vec![
                ("GPU-aaaa".into(), stats(1)),
                ("GPU-bbbb".into(), stats(2)),
                ("GPU-bbbb".into(), stats(3)),
            ],
        };
        assert_eq!(doc.stats_for(&["GPU-bbbb"]), Some(stats(2)), "first wins");
        assert_eq!(doc.stats_for(&["MIG-aaaa", "GPU-zzzz"]), Some(stats(1)));
        assert_eq!(doc.stats_for(&["MIG-cccc", "GPU-bbbb"]), Some(stats(2)));
        assert_eq!(doc.stats_for(&["GPU-cccc"]), None);
        assert_eq!(doc.stats_for(&[]), None);
    }
}
