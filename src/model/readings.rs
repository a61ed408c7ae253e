//! What the collectors leave in a sample, by type: [`Reading`] and
//! [`Readings`]. The collector's folder defines its reading type; this
//! module does not need to know it, so a new collector adds nothing here.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// What one collector read of one GPU or process in one sample: any plain
/// data type (`Debug`, `Eq`, shareable), found again by its type. The
/// collector module and its family group in `expose/` agree on the type;
/// this file does not need to know it, so a new collector adds none here.
pub trait Reading: Any + fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;
    /// Equal to `other` (same type, same value).
    fn same(&self, other: &dyn Reading) -> bool;
}

impl<T: Any + fmt::Debug + Send + Sync + Eq> Reading for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn same(&self, other: &dyn Reading) -> bool {
        other.as_any().downcast_ref::<T>() == Some(self)
    }
}

/// The readings of one GPU (or process) in one sample, at most one per
/// type. Cloning shares them (`Arc`): a memory-only sample carries the
/// last full sample's readings at the cost of a few pointer copies.
#[derive(Debug, Clone, Default)]
pub struct Readings(Vec<Arc<dyn Reading>>);

impl Readings {
    /// The reading of type `T`, if a collector left one.
    pub fn get<T: Reading>(&self) -> Option<&T> {
        self.0
            .iter()
            .find_map(|r| (**r).as_any().downcast_ref::<T>())
    }

    /// Add a reading (replacing one of the same type).
    pub fn put(&mut self, reading: Arc<dyn Reading>) {
        let id = (*reading).as_any().type_id();
        self.0.retain(|r| (**r).as_any().type_id() != id);
        self.0.push(reading);
    }

    /// These readings and `reading` (building a sample by hand).
    pub fn with<T: Reading>(mut self, reading: T) -> Self {
        self.put(Arc::new(reading));
        self
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The very same readings as `other` (the same `Arc`s, in order):
    /// what a memory-only sample carries over from the last full one.
    pub fn same_arcs(&self, other: &Readings) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .all(|(a, b)| std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b)))
    }
}

impl PartialEq for Readings {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .all(|a| other.0.iter().any(|b| (**a).same(&**b)))
    }
}

impl Eq for Readings {}

/// How busy a GPU was, for the ledger's busy time (`gpu_busy_seconds_total`):
/// a reading of a shared type, left by the collector that reads it (today
/// `utilization`), so accounting reads it without naming a collector.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Busy {
    /// The busy percentage over NVML's last sampling period
    /// (`utilization.gpu`), held between reads where there are no samples.
    pub percent: Option<u32>,
    /// What NVML's utilisation samples added since the last read; `None`
    /// where the driver has none.
    pub samples: Option<BusySamples>,
}

/// The busy time in NVML's utilisation samples newer than the last read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BusySamples {
    /// Which read this is: unique in the process, so the ledger adds each
    /// read's [`Self::percent_us`] once however many snapshots carry it.
    pub read: u64,
    /// Σ over the new samples of percent × the µs since the sample before
    /// (each counted for at most one second).
    pub percent_us: u64,
}

impl BusySamples {
    /// Busy seconds: `percent_us` / 100 / 10⁶.
    pub fn seconds(&self) -> f64 {
        self.percent_us as f64 / 1e8
    }
}
