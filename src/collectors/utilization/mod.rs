//! `utilization`: how busy each GPU is (kernels, memory controller, video
//! encoder and decoder), three cheap calls per GPU per full sample; and
//! NVML's own utilisation samples (`nvmlDeviceGetSamples` with
//! `NVML_GPU_UTILIZATION_SAMPLES`, one every 1/6 s to 1 s depending on the
//! GPU), read with the timestamp of the last one seen so each is counted
//! once (at every full sample while the GPU is busy, every
//! [`IDLE_SAMPLES_EVERY`] while it is idle): what the ledger integrates into `gpu_busy_seconds_total`, so a
//! busy second between two of our reads is counted too. Where the driver
//! does not have them, the ledger integrates `utilization.gpu` held
//! between reads instead, and this says so once per GPU in the log.

pub(crate) mod calls;
pub(crate) mod families;
pub(crate) mod json;

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Collector, Context, PerGpu};
use crate::model::{Busy, Reading, Readings};

/// Busy percentages of one GPU over NVML's last sampling period. A field
/// is `None` when its call failed or is not supported: the family is then
/// absent for this GPU, never a fake 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Utilization {
    /// nvidia-smi `utilization.gpu`: time a kernel was running, percent.
    pub gpu: Option<u32>,
    /// nvidia-smi `utilization.memory`: memory controller busy, percent.
    pub memory: Option<u32>,
    pub encoder: Option<u32>,
    pub decoder: Option<u32>,
    /// What NVML's utilisation samples added since the last read; `None`
    /// where the driver has none (`gpu_busy_seconds_total` then
    /// integrates [`Self::gpu`]).
    pub samples: Option<BusySamples>,
}

pub(crate) use crate::model::BusySamples;

/// A sample counts for the time since the one before it, but never more
/// than this: NVML samples every 1/6 s to 1 s, so a longer gap means
/// samples were lost (the GPU was down, the buffer overran), and the one
/// after it says nothing of the gap.
pub(crate) const MAX_SAMPLE_GAP_US: u64 = 1_000_000;

/// Process-wide read counter for [`BusySamples::read`].
static READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Integrate `samples` (timestamp µs, percent; any order) newer than
/// `last_seen`: the newest timestamp, and Σ percent × gap. Without a
/// `last_seen` (the first read) the newest sample only starts the count.
pub(crate) fn integrate(last_seen: Option<u64>, samples: &[(u64, u32)]) -> (Option<u64>, u64) {
    let mut sorted: Vec<(u64, u32)> = samples.to_vec();
    sorted.sort_unstable_by_key(|s| s.0);
    let Some(mut prev) = last_seen else {
        return (sorted.last().map(|s| s.0), 0);
    };
    let mut sum = 0u64;
    for (t, pct) in sorted {
        if t <= prev {
            continue;
        }
        let gap = (t - prev).min(MAX_SAMPLE_GAP_US);
        sum = sum.saturating_add(u64::from(pct.min(100)) * gap);
        prev = t;
    }
    (Some(prev), sum)
}

/// While a GPU's `utilization.gpu` says 0 (nothing ran over NVML's last
/// period), its utilisation samples are read this often instead of at
/// every full sample: the call is the dearest of a full sample on the
/// H200 (2.8 ms wall whatever the number of new samples), and the driver
/// keeps about 14 s of them (71 at 200 ms), so a burst between two reads
/// is still counted, at the next one. A GPU that is busy now is read at
/// every full sample, as before. Between reads every snapshot carries the
/// last read (the ledger adds each read once), so an idle GPU's
/// `gpu_busy_seconds_total` moves in steps of up to 10 s.
pub(crate) const IDLE_SAMPLES_EVERY: Duration = Duration::from_secs(10);

/// One GPU's utilisation samples state.
#[derive(Debug, Default)]
struct SampleState {
    /// The newest sample's timestamp seen so far.
    last_seen: Option<u64>,
    /// When the samples were last read ([`IDLE_SAMPLES_EVERY`]), and what
    /// that read added (carried until the next one).
    last_read: Option<(Instant, BusySamples)>,
    /// The driver said the call is not supported (asked again after NVML
    /// is re-opened, when this collector is made afresh).
    unsupported: bool,
}

/// One GPU's last full sample: its figures and the [`Busy`] reading made
/// of them, each made once, so every snapshot until the next full sample
/// carries the very same `Arc`s (what lets a body after a memory-only
/// sample reuse the last full sample's families, `expose::segments`).
#[derive(Debug, Clone)]
struct Read {
    utilization: Arc<Utilization>,
    busy: Arc<Busy>,
}

#[derive(Default)]
pub(super) struct UtilizationCollector {
    /// Per GPU: the last full sample's figures.
    read: PerGpu<Option<Read>>,
    samples: PerGpu<SampleState>,
}

impl UtilizationCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<UtilizationCollector>::default()
    }

    /// The samples since the last read of GPU `gpu`; `None` while the
    /// driver has none or the call failed.
    /// `idle_now`: `utilization.gpu` read 0 in this full sample.
    fn read_samples(
        &mut self,
        cx: &mut Context<'_>,
        gpu: usize,
        idle_now: bool,
    ) -> Option<BusySamples> {
        let st = self.samples.at(gpu);
        if st.unsupported {
            return None;
        }
        if let Some((at, last)) = st.last_read
            && idle_now
            && cx.now.saturating_duration_since(at) < IDLE_SAMPLES_EVERY
        {
            return Some(last);
        }
        let last_seen = st.last_seen;
        match cx.call(gpu, calls::UTILIZATION_SAMPLES, |h| {
            calls::samples(h, last_seen)
        }) {
            Ok(list) => {
                let (seen, percent_us) = integrate(last_seen, &list);
                let st = self.samples.at(gpu);
                st.last_seen = seen.or(last_seen);
                // Only once a count has started (until then the next
                // full sample reads again).
                st.last_seen?;
                let read = BusySamples {
                    read: READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                    percent_us,
                };
                st.last_read = Some((cx.now, read));
                Some(read)
            }
            Err(e) if e.kind.is_unsupported() => {
                self.samples.at(gpu).unsupported = true;
                tracing::info!(
                    gpu,
                    call = calls::UTILIZATION_SAMPLES.label(),
                    "NVML has no utilisation samples for this GPU; gpu_busy_seconds_total integrates utilization.gpu held between full samples instead"
                );
                None
            }
            Err(e) => {
                cx.failed(gpu, e);
                None
            }
        }
    }
}

impl Collector for UtilizationCollector {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let mut u = cx.read_all(gpu, calls::UTILIZATION_RATES, calls::read);
        u.samples = self.read_samples(cx, gpu, u.gpu == Some(0));
        *self.read.at(gpu) = Some(Read {
            busy: Arc::new(Busy {
                percent: u.gpu,
                samples: u.samples,
            }),
            utilization: Arc::new(u),
        });
    }

    fn forget(&mut self, gpu: usize) {
        *self.read.at(gpu) = None;
        // Samples from before the gap are not counted again, nor the gap.
        let st = self.samples.at(gpu);
        st.last_seen = None;
        st.last_read = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let r = self.read.get(gpu)?.as_ref()?;
        Some(Arc::clone(&r.utilization) as _)
    }

    /// Its [`Utilization`], and the [`Busy`] reading the ledger reads.
    fn readings(&self, gpu: usize, out: &mut Readings) {
        let Some(r) = self.read.get(gpu).and_then(Option::as_ref) else {
            return;
        };
        out.put(Arc::clone(&r.busy) as _);
        out.put(Arc::clone(&r.utilization) as _);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_integrate_over_their_gaps_once_each() {
        // The first read only starts the count.
        assert_eq!(integrate(None, &[(100, 50), (300, 50)]), (Some(300), 0));
        assert_eq!(integrate(None, &[]), (None, 0));
        // 50 % for 200 µs, then 100 % for 100 µs; out of order; the one
        // already seen is skipped.
        assert_eq!(
            integrate(Some(300), &[(600, 100), (300, 90), (500, 50)]),
            (Some(600), 50 * 200 + 100 * 100)
        );
        // A gap over a second counts a second; percent over 100 as 100.
        assert_eq!(
            integrate(Some(0), &[(5_000_000, 150)]),
            (Some(5_000_000), 100 * MAX_SAMPLE_GAP_US)
        );
        assert_eq!(integrate(Some(7), &[]), (Some(7), 0));
    }
}
