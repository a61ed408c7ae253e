//! Memory limits a pod's own annotations state: HAMi's
//! `hami.io/vgpu-devices-allocated` and KAI-Scheduler's `gpu-memory` /
//! `gpu-fraction`, parsed when the pod watcher indexes the pod.
//!
//! - **Keyed by the annotated pod's UID, nothing else.** HAMi's scheduler
//!   writes its annotation when it binds the pod, but anyone who may create
//!   a pod may set it (or KAI's) on their own pod. A limit is kept under the
//!   UID of the pod that carries it, and joins only that pod's processes:
//!   a forged annotation changes its author's own series and nobody
//!   else's. The GPU UUIDs it names only say which of the pod's own GPUs
//!   it speaks of, never whose processes.
//! - **HAMi's format, as its scheduler encodes it** (`pkg/device/devices.go`,
//!   `EncodePodSingleDevice` and `DecodeContainerDevices`): containers
//!   separated by `;`, a container's devices by `:`, both written with a
//!   trailing separator; a device is `UUID,Type,MemoryMiB,Cores` (more
//!   fields are tolerated, as HAMi does); an entry without a comma is
//!   skipped; fewer than four fields, or a memory or cores field that is
//!   not a 32-bit decimal integer, fails the annotation. A memory of 0 is
//!   "no limit" to HAMi's in-container library (`CUDA_DEVICE_MEMORY_LIMIT`
//!   of `0m`), so a GPU that any container holds with 0 has no limit. The
//!   pod's limit on a GPU is the sum over its containers, in bytes (MiB ×
//!   2^20, HAMi-core's `m`).
//! - **KAI's, as its scheduler reads them** (`pkg/scheduler/api/pod_info`):
//!   `gpu-memory` is a base-10 integer of MiB, used when positive;
//!   `gpu-fraction` a float, used when 0 < f ≤ 1, and the one used when
//!   both are. KAI does not enforce either, so the limit is `granted`, and
//!   it names no GPU: it applies to each GPU the pod's processes use.
//! - **Bounded, never fatal.** An annotation longer than
//!   [`MAX_ANNOTATION_BYTES`] (KAI's: [`MAX_KAI_VALUE_BYTES`]), with more
//!   than [`MAX_DEVICES`] devices, or malformed gives its pod no limit from
//!   it and a [`Problem`] that the watcher logs once per pod; values are
//!   quoted and cut short in messages.
//!
//! Written by hand: both schedulers are Go, and neither format is a
//! standard one a crate parses.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::sync::Arc;

use crate::model::{Amount, LimitKind, LimitSource, PodLimit};

/// HAMi's annotation of the NVIDIA devices its scheduler allocated.
pub(crate) const HAMI: &str = "hami.io/vgpu-devices-allocated";
/// KAI-Scheduler's request of GPU memory, in MiB.
pub(crate) const KAI_MEMORY: &str = "gpu-memory";
/// KAI-Scheduler's request of a share of a GPU.
pub(crate) const KAI_FRACTION: &str = "gpu-fraction";

/// The longest HAMi annotation read: a device is about 60 bytes, so this
/// holds [`MAX_DEVICES`] of them with room for many containers' `;`.
pub(crate) const MAX_ANNOTATION_BYTES: usize = 4096;
/// The most devices one pod's HAMi annotation may list.
pub(crate) const MAX_DEVICES: usize = 16;
/// The longest KAI value read (a number).
pub(crate) const MAX_KAI_VALUE_BYTES: usize = 32;
/// The longest UUID accepted (a GPU's is 40 bytes).
const MAX_UUID_BYTES: usize = 96;
/// How much of a bad value a message quotes.
const QUOTED_BYTES: usize = 40;

const MIB: u64 = 1 << 20;

/// What was wrong with one annotation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AnnotationError {
    #[error("{0} bytes long, more than the {1} read")]
    TooLong(usize, usize),
    #[error("more than {MAX_DEVICES} devices")]
    TooManyDevices,
    #[error("device {0} has fewer than 4 fields (UUID,Type,MemoryMiB,Cores)")]
    MissingFields(usize),
    #[error("device {device}: {field} {value:?} is not a 32-bit integer")]
    NotAnInteger {
        device: usize,
        field: &'static str,
        value: String,
    },
    #[error("device {0}: negative memory {1} MiB")]
    NegativeMemory(usize, i32),
    #[error("device {0}: {1:?} is not a GPU or MIG UUID")]
    NotAUuid(usize, String),
    #[error("{0:?} is not a positive whole number of MiB")]
    NotMebibytes(String),
    #[error("{0:?} is not a fraction above 0 and at most 1")]
    NotAFraction(String),
}

/// An annotation a pod carries that gave it no limit, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Problem {
    pub(crate) annotation: &'static str,
    pub(crate) error: AnnotationError,
}

/// What a pod's annotations give it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct AnnotatedLimits {
    /// Sorted by GPU UUID; HAMi's first.
    pub(crate) limits: Vec<PodLimit>,
    pub(crate) problems: Vec<Problem>,
}

/// The limits of the pod `pod_uid` from its annotations (`get` looks one
/// up by name).
pub(crate) fn limits_of<'a>(
    pod_uid: &Arc<str>,
    get: impl Fn(&str) -> Option<&'a str>,
) -> AnnotatedLimits {
    let mut out = AnnotatedLimits::default();
    if let Some(value) = get(HAMI) {
        match hami(pod_uid, value) {
            Ok(l) => out.limits.extend(l),
            Err(error) => out.problems.push(Problem {
                annotation: HAMI,
                error,
            }),
        }
    }
    let (kai, problems) = kai(pod_uid, get(KAI_MEMORY), get(KAI_FRACTION));
    out.limits.extend(kai);
    out.problems.extend(problems);
    out
}

/// HAMi's `hami.io/vgpu-devices-allocated`: per GPU, the sum of its
/// containers' memory (none where one holds it with 0).
pub(crate) fn hami(pod_uid: &Arc<str>, value: &str) -> Result<Vec<PodLimit>, AnnotationError> {
    if value.len() > MAX_ANNOTATION_BYTES {
        return Err(AnnotationError::TooLong(value.len(), MAX_ANNOTATION_BYTES));
    }
    // GPU → MiB over the pod's containers; `None`: one holds it unlimited.
    let mut per_gpu: BTreeMap<&str, Option<u64>> = BTreeMap::new();
    let mut devices = 0;
    for entry in value.split(';').flat_map(|c| c.split(':')) {
        if !entry.contains(',') {
            continue;
        }
        devices += 1;
        if devices > MAX_DEVICES {
            return Err(AnnotationError::TooManyDevices);
        }
        let mut fields = entry.split(',');
        let (Some(uuid), Some(_kind), Some(memory), Some(cores)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return Err(AnnotationError::MissingFields(devices));
        };
        let memory = go_int32(devices, "memory", memory)?;
        go_int32(devices, "cores", cores)?;
        let uuid = gpu_uuid(uuid).ok_or_else(|| AnnotationError::NotAUuid(devices, quote(uuid)))?;
        let memory =
            u64::try_from(memory).map_err(|_| AnnotationError::NegativeMemory(devices, memory))?;
        let unlimited = memory == 0;
        match per_gpu.entry(uuid) {
            Entry::Vacant(e) => {
                e.insert((!unlimited).then_some(memory));
            }
            Entry::Occupied(mut e) => {
                let sum = e.get_mut();
                *sum = sum.filter(|_| !unlimited).map(|s| s + memory);
            }
        }
    }
    Ok(per_gpu
        .into_iter()
        .filter_map(|(uuid, mib)| {
            Some(PodLimit {
                pod_uid: Arc::clone(pod_uid),
                uuid: Some(Arc::from(uuid)),
                source: LimitSource::Hami,
                kind: LimitKind::Hard,
                // At most 16 × i32::MAX MiB: no overflow.
                amount: Amount::Bytes(mib? * MIB),
            })
        })
        .collect())
}

/// Go's `strconv.ParseInt(s, 10, 32)`, which HAMi decodes with: an
/// optional sign and decimal digits, within 32 bits.
fn go_int32(device: usize, field: &'static str, s: &str) -> Result<i32, AnnotationError> {
    s.parse::<i32>().map_err(|_| AnnotationError::NotAnInteger {
        device,
        field,
        value: quote(s),
    })
}

/// A GPU's (`GPU-…`) or MIG device's (`MIG-…`) UUID; HAMi's older MIG
/// entries carry a `[gi-ci]` suffix after the GPU's, which is dropped (the
/// limit is then on that GPU, where the join finds its MIG devices).
fn gpu_uuid(s: &str) -> Option<&str> {
    let uuid = match s.strip_suffix(']').and_then(|s| s.split_once('[')) {
        Some((uuid, slot)) if slot.bytes().all(|b| b.is_ascii_digit() || b == b'-') => uuid,
        Some(_) => return None,
        None => s,
    };
    let plausible = (uuid.starts_with("GPU-") || uuid.starts_with("MIG-"))
        && uuid.len() > 4
        && uuid.len() <= MAX_UUID_BYTES
        && uuid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/'));
    plausible.then_some(uuid)
}

/// KAI's annotations: a fraction when one is valid, else a memory when one
/// is; each present value that is not valid is a problem.
pub(crate) fn kai(
    pod_uid: &Arc<str>,
    memory: Option<&str>,
    fraction: Option<&str>,
) -> (Option<PodLimit>, Vec<Problem>) {
    let mut problems = Vec::new();
    let mut problem = |annotation, error| problems.push(Problem { annotation, error });
    let memory = memory.and_then(|v| match kai_memory(v) {
        Ok(bytes) => Some(Amount::Bytes(bytes)),
        Err(e) => {
            problem(KAI_MEMORY, e);
            None
        }
    });
    let fraction = fraction.and_then(|v| match kai_fraction(v) {
        Ok(f) => Some(Amount::Fraction(f)),
        Err(e) => {
            problem(KAI_FRACTION, e);
            None
        }
    });
    let limit = fraction.or(memory).map(|amount| PodLimit {
        pod_uid: Arc::clone(pod_uid),
        uuid: None,
        source: LimitSource::Kai,
        kind: LimitKind::Granted,
        amount,
    });
    (limit, problems)
}

/// `gpu-memory`: positive MiB (KAI: `strconv.ParseInt(v, 10, 64)`, `> 0`),
/// in bytes.
fn kai_memory(v: &str) -> Result<u64, AnnotationError> {
    if v.len() > MAX_KAI_VALUE_BYTES {
        return Err(AnnotationError::TooLong(v.len(), MAX_KAI_VALUE_BYTES));
    }
    v.parse::<i64>()
        .ok()
        .and_then(|mib| u64::try_from(mib).ok())
        .filter(|&mib| mib > 0)
        .and_then(|mib| mib.checked_mul(MIB))
        .ok_or_else(|| AnnotationError::NotMebibytes(quote(v)))
}

/// `gpu-fraction`: 0 < f ≤ 1 (KAI: `strconv.ParseFloat(v, 64)`).
fn kai_fraction(v: &str) -> Result<f64, AnnotationError> {
    if v.len() > MAX_KAI_VALUE_BYTES {
        return Err(AnnotationError::TooLong(v.len(), MAX_KAI_VALUE_BYTES));
    }
    v.parse::<f64>()
        .ok()
        .filter(|f| f.is_finite() && *f > 0.0 && *f <= 1.0)
        .ok_or_else(|| AnnotationError::NotAFraction(quote(v)))
}

/// At most [`QUOTED_BYTES`] of a tenant's text, for a log line (which
/// escapes it: the errors print it with `{:?}`).
fn quote(s: &str) -> String {
    let mut end = s.len().min(QUOTED_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let mut q = s[..end].to_owned();
    if end < s.len() {
        q.push('…');
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-8dcd427f-483b-b48f-d7e5-75fb19a52b76";
    const B: &str = "GPU-ebe7c3f7-303d-558d-435e-99a160631fe4";
    const MIG: &str = "MIG-1d2c3b4a-0000-5e6f-8a9b-000000000002";

    fn uid() -> Arc<str> {
        Arc::from("pod-uid-1")
    }

    fn hard(uuid: &str, mib: u64) -> PodLimit {
        PodLimit {
            pod_uid: uid(),
            uuid: Some(Arc::from(uuid)),
            source: LimitSource::Hami,
            kind: LimitKind::Hard,
            amount: Amount::Bytes(mib << 20),
        }
    }

    /// HAMi's annotations as its scheduler writes them, and what goes
    /// wrong with them.
    #[test]
    fn hami_annotations() {
        let long = "x".repeat(MAX_ANNOTATION_BYTES + 1);
        let seventeen: String = (0..17).map(|_| format!("{A},NVIDIA,1,0:;")).collect();
        let sixteen: String = (0..16).map(|_| format!("{A},NVIDIA,1,0:;")).collect();
        let cases: Vec<(String, Result<Vec<PodLimit>, AnnotationError>)> = vec![
            // One container, one device (HAMi's own test's form).
            (format!("{A},NVIDIA,500,3:;"), Ok(vec![hard(A, 500)])),
            // Two containers on two GPUs, trailing separators.
            (
                format!("{A},NVIDIA,500,3:;{B},NVIDIA,20000,30:;"),
                Ok(vec![hard(A, 500), hard(B, 20000)]),
            ),
            // One container, two devices; then a container without any
            // (an init container), kept by HAMi as an empty entry.
            (
                format!("{A},NVIDIA,1024,0:{B},NVIDIA,2048,0:;;"),
                Ok(vec![hard(A, 1024), hard(B, 2048)]),
            ),
            // Two containers on one GPU: the pod's limit is their sum.
            (
                format!("{A},NVIDIA,1000,10:;{A},NVIDIA,3000,10:;"),
                Ok(vec![hard(A, 4000)]),
            ),
            // No trailing separators; more fields than four.
            (format!("{A},NVIDIA,100,0,extra"), Ok(vec![hard(A, 100)])),
            // A signed number, as Go's ParseInt takes it.
            (format!("{A},NVIDIA,+100,0:;"), Ok(vec![hard(A, 100)])),
            // HAMi's older MIG slot suffix: the GPU's UUID.
            (format!("{A}[7-9],NVIDIA,100,0:;"), Ok(vec![hard(A, 100)])),
            (format!("{MIG},NVIDIA,100,0:;"), Ok(vec![hard(MIG, 100)])),
            // 0 MiB: no limit on that GPU, whoever else holds it.
            (format!("{A},NVIDIA,0,0:;"), Ok(vec![])),
            (
                format!("{A},NVIDIA,1000,0:;{A},NVIDIA,0,0:;{B},NVIDIA,5,0:;"),
                Ok(vec![hard(B, 5)]),
            ),
            (format!("{A},NVIDIA,0,0:;{A},NVIDIA,1000,0:;"), Ok(vec![])),
            // Nothing allocated yet.
            (String::new(), Ok(vec![])),
            (";;".into(), Ok(vec![])),
            (":;:".into(), Ok(vec![])),
            (sixteen, Ok(vec![hard(A, 16)])),
            // Malformed.
            (
                format!("{A},NVIDIA,500:;"),
                Err(AnnotationError::MissingFields(1)),
            ),
            (
                format!("{A},NVIDIA,500,3:;{B},NVIDIA:;"),
                Err(AnnotationError::MissingFields(2)),
            ),
            (
                format!("{A},NVIDIA,-500,3:;"),
                Err(AnnotationError::NegativeMemory(1, -500)),
            ),
            (
                format!("{A},NVIDIA,500MiB,3:;"),
                Err(AnnotationError::NotAnInteger {
                    device: 1,
                    field: "memory",
                    value: "500MiB".into(),
                }),
            ),
            (
                format!("{A},NVIDIA,2147483648,3:;"),
                Err(AnnotationError::NotAnInteger {
                    device: 1,
                    field: "memory",
                    value: "2147483648".into(),
                }),
            ),
            (
                format!("{A},NVIDIA, 500,3:;"),
                Err(AnnotationError::NotAnInteger {
                    device: 1,
                    field: "memory",
                    value: " 500".into(),
                }),
            ),
            (
                format!("{A},NVIDIA,500,x:;"),
                Err(AnnotationError::NotAnInteger {
                    device: 1,
                    field: "cores",
                    value: "x".into(),
                }),
            ),
            (
                "0000:3b:00.0,NVIDIA,500,3:;".into(),
                Err(AnnotationError::NotAUuid(1, "00.0".into())),
            ),
            (
                ",NVIDIA,500,3".into(),
                Err(AnnotationError::NotAUuid(1, String::new())),
            ),
            (
                format!("{A}[x],NVIDIA,500,3"),
                Err(AnnotationError::NotAUuid(1, format!("{A}…"))),
            ),
            (
                "GPU-\u{202e}evil,NVIDIA,500,3".into(),
                Err(AnnotationError::NotAUuid(1, "GPU-\u{202e}evil".into())),
            ),
            (
                format!("GPU-{},NVIDIA,1,0", "a".repeat(MAX_UUID_BYTES)),
                Err(AnnotationError::NotAUuid(
                    1,
                    format!("GPU-{}…", "a".repeat(QUOTED_BYTES - 4)),
                )),
            ),
            // Oversized.
            (
                long,
                Err(AnnotationError::TooLong(
                    MAX_ANNOTATION_BYTES + 1,
                    MAX_ANNOTATION_BYTES,
                )),
            ),
            (seventeen, Err(AnnotationError::TooManyDevices)),
        ];
        for (value, want) in cases {
            assert_eq!(hami(&uid(), &value), want, "{value:?}");
        }
    }

    /// KAI's annotations: (gpu-memory, gpu-fraction) → the limit and the
    /// problems.
    #[test]
    fn kai_annotations() {
        let granted = |amount| {
            Some(PodLimit {
                pod_uid: uid(),
                uuid: None,
                source: LimitSource::Kai,
                kind: LimitKind::Granted,
                amount,
            })
        };
        let mem = |e| Problem {
            annotation: KAI_MEMORY,
            error: e,
        };
        let frac = |e| Problem {
            annotation: KAI_FRACTION,
            error: e,
        };
        let not_mib = |v: &str| mem(AnnotationError::NotMebibytes(v.into()));
        let not_frac = |v: &str| frac(AnnotationError::NotAFraction(v.into()));
        let long = "1".repeat(MAX_KAI_VALUE_BYTES + 1);
        type Case<'a> = (
            Option<&'a str>,
            Option<&'a str>,
            Option<PodLimit>,
            Vec<Problem>,
        );
        let cases: Vec<Case> = vec![
            (None, None, None, vec![]),
            // KAI's own example: 2000 MiB.
            (
                Some("2000"),
                None,
                granted(Amount::Bytes(2000 << 20)),
                vec![],
            ),
            (Some("+7"), None, granted(Amount::Bytes(7 << 20)), vec![]),
            (None, Some("0.5"), granted(Amount::Fraction(0.5)), vec![]),
            (None, Some("1"), granted(Amount::Fraction(1.0)), vec![]),
            (None, Some(".25"), granted(Amount::Fraction(0.25)), vec![]),
            (None, Some("5e-1"), granted(Amount::Fraction(0.5)), vec![]),
            // Both: the fraction, as KAI's scheduler takes it.
            (
                Some("2000"),
                Some("0.5"),
                granted(Amount::Fraction(0.5)),
                vec![],
            ),
            (
                Some("2000"),
                Some("1.5"),
                granted(Amount::Bytes(2000 << 20)),
                vec![not_frac("1.5")],
            ),
            // Zero, negative, not a number, too big, too long.
            (Some("0"), None, None, vec![not_mib("0")]),
            (Some("-2000"), None, None, vec![not_mib("-2000")]),
            (Some("2Gi"), None, None, vec![not_mib("2Gi")]),
            (Some("20.5"), None, None, vec![not_mib("20.5")]),
            (Some(""), None, None, vec![not_mib("")]),
            (
                Some("9223372036854775807"),
                None,
                None,
                vec![not_mib("9223372036854775807")],
            ),
            (
                Some(&long),
                None,
                None,
                vec![mem(AnnotationError::TooLong(
                    MAX_KAI_VALUE_BYTES + 1,
                    MAX_KAI_VALUE_BYTES,
                ))],
            ),
            (None, Some("0"), None, vec![not_frac("0")]),
            (None, Some("-0.5"), None, vec![not_frac("-0.5")]),
            (None, Some("1.0001"), None, vec![not_frac("1.0001")]),
            (None, Some("NaN"), None, vec![not_frac("NaN")]),
            (None, Some("inf"), None, vec![not_frac("inf")]),
            (None, Some("half"), None, vec![not_frac("half")]),
            (
                Some("x"),
                Some("y"),
                None,
                vec![not_mib("x"), not_frac("y")],
            ),
        ];
        for (memory, fraction, want, problems) in cases {
            assert_eq!(
                kai(&uid(), memory, fraction),
                (want, problems),
                "{memory:?} {fraction:?}"
            );
        }
    }

    /// Both schedulers' annotations on one pod, and one that is broken
    /// beside one that is not.
    #[test]
    fn a_pods_annotations_together() {
        let annotations = [
            (HAMI, format!("{A},NVIDIA,500,3:;")),
            (KAI_FRACTION, "2".to_string()),
            ("other", "x".to_string()),
        ];
        let got = limits_of(&uid(), |k| {
            annotations
                .iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.as_str())
        });
        assert_eq!(got.limits, vec![hard(A, 500)]);
        assert_eq!(
            got.problems,
            vec![Problem {
                annotation: KAI_FRACTION,
                error: AnnotationError::NotAFraction("2".into())
            }]
        );
        assert_eq!(
            got.problems[0].error.to_string(),
            "\"2\" is not a fraction above 0 and at most 1"
        );
    }
}
