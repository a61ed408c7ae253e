//! The hidden door for the end-to-end tests (`tests/e2e`), the benchmarks
//! (`benches/`) and the fuzz targets (`fuzz/`): what they reach inside
//! the crate for, re-exported here and nowhere else. Not a public
//! contract (hidden from the docs); everything else stays `pub(crate)`.
//!
//! Its modules mirror the crate's paths, so a test reads
//! `testing::expose::encode` where the code says `expose::encode`.

/// The snapshot's plain data, whole: the golden tests and benchmarks
/// build snapshots by hand.
pub mod model {
    pub use crate::model::*;
}

pub mod accounting {
    pub use crate::accounting::Ledger;
}

pub mod trend {
    pub use crate::trend::*;
}

pub mod history {
    pub use crate::history::History;
}

pub mod expose {
    pub use crate::expose::{
        Format, REVISION, Reuse, VERSION, count_series, encode, encode_reusing,
    };
}

pub mod gpu {
    pub use crate::gpu::nvml::NvmlSource;
    pub use crate::gpu::{ErrorKind, GpuSource, Operation, RawProcess};
}

/// The collectors' reading types, which a hand-built snapshot carries.
pub mod readings {
    pub use crate::collectors::health::{Health, RemappedRows, RetiredPages};
    pub use crate::collectors::power_thermal::PowerThermal;
    pub use crate::collectors::process_utilization::ProcessUtilization;
    pub use crate::collectors::utilization::Utilization;
}

/// The latest snapshot's owner (the wake-cost tool publishes through it).
pub mod publish {
    pub use crate::publish::Shared;
    pub use crate::telemetry::Telemetry;
}

pub mod sample {
    pub use crate::sample::{SAMPLE_DURATION_BUCKETS, Sampler, select};
}

pub mod config {
    pub use crate::config::{Config, KubeConfig, Overrides, SamplerConfig, Timing, load};
}

pub mod attribute {
    pub use crate::attribute::{ProcCache, ProcessLookup};

    pub mod procfs {
        pub use crate::attribute::procfs::ProcRoot;
    }
}

pub mod kube {
    pub use crate::kube::{PodIndex, PodRef, run_watcher};
}

pub mod http {
    pub use crate::http::cache::BodyCache;

    pub mod web_config {
        pub use crate::http::web_config::{ClientAuth, Limits, WebConfig};
    }
}

/// The fuzz targets' checks (`fuzz/`, and their proptest twins in
/// `tests/e2e/fuzz.rs`).
pub mod fuzzing {
    pub use crate::fuzzing::*;
}
