//! The `health` collector in `/api/v1/snapshot`: each GPU's `health`
//! object (ECC errors, row remapping, retired pages, critical Xid events
//! by Xid); `null` for what the GPU does not report.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::value::RawValue;

use super::{EccCounter, Health};
use crate::collectors::{Json, to_json};
use crate::model::Readings;

pub(crate) const JSON: Json = Json {
    key: "health",
    gpu: Some(gpu),
    process: None,
};

#[derive(Serialize)]
struct Figures<'a> {
    ecc_enabled: Option<bool>,
    ecc_corrected_volatile_errors: Option<u64>,
    ecc_corrected_aggregate_errors: Option<u64>,
    ecc_uncorrected_volatile_errors: Option<u64>,
    ecc_uncorrected_aggregate_errors: Option<u64>,
    remapped_rows_correctable: Option<u32>,
    remapped_rows_uncorrectable: Option<u32>,
    remapped_rows_pending: Option<bool>,
    remapped_rows_failed: Option<bool>,
    retired_pages_single_bit_ecc: Option<u32>,
    retired_pages_double_bit_ecc: Option<u32>,
    retired_pages_pending: Option<bool>,
    xid_errors: Option<&'a BTreeMap<u64, u64>>,
}

fn gpu(r: &Readings) -> Option<Box<RawValue>> {
    let h = r.get::<Health>()?;
    let ecc = |c: EccCounter| h.ecc_errors[c as usize];
    let rows = h.remapped_rows;
    let pages = h.retired_pages;
    to_json(&Figures {
        ecc_enabled: h.ecc_enabled,
        ecc_corrected_volatile_errors: ecc(EccCounter::CorrectedVolatile),
        ecc_corrected_aggregate_errors: ecc(EccCounter::CorrectedAggregate),
        ecc_uncorrected_volatile_errors: ecc(EccCounter::UncorrectedVolatile),
        ecc_uncorrected_aggregate_errors: ecc(EccCounter::UncorrectedAggregate),
        remapped_rows_correctable: rows.map(|r| r.correctable),
        remapped_rows_uncorrectable: rows.map(|r| r.uncorrectable),
        remapped_rows_pending: rows.map(|r| r.pending),
        remapped_rows_failed: rows.map(|r| r.failed),
        retired_pages_single_bit_ecc: pages.and_then(|p| p.single_bit_ecc),
        retired_pages_double_bit_ecc: pages.and_then(|p| p.double_bit_ecc),
        retired_pages_pending: pages.and_then(|p| p.pending),
        xid_errors: h.xid_errors.as_deref(),
    })
}
