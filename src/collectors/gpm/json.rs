//! The `gpm` collector in `/api/v1/snapshot`: each GPU's `gpm` object,
//! its figures named as the families are (without `gpu_gpm_`), in their
//! units (ratios 0–1, bytes per second); `null` where not supported.

use serde::Serializer;
use serde::ser::SerializeMap;
use serde_json::value::RawValue;

use super::families::{family, value};
use super::{Gpm, GpmMetric, GpmReading};
use crate::collectors::{Json, to_json};
use crate::model::Readings;

pub(crate) const JSON: Json = Json {
    key: "gpm",
    gpu: Some(gpu),
    process: None,
};

/// The GPU's own figures, by family name.
struct Figures<'a>(&'a Gpm);

impl serde::Serialize for Figures<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(GpmMetric::ALL.len()))?;
        for m in GpmMetric::ALL {
            map.serialize_entry(family(m).0, &value(self.0, m))?;
        }
        map.end()
    }
}

fn gpu(r: &Readings) -> Option<Box<RawValue>> {
    let g = r.get::<GpmReading>()?.gpu.as_ref()?;
    to_json(&Figures(g))
}
