//! The `process_activity` collector's operation label: its call is
//! `process_utilization`'s query, counted under this label.

use crate::gpu::Operation;

pub(crate) const PROCESS_ACTIVITY: Operation = Operation::new("process_activity");

pub(crate) const OPERATIONS: &[Operation] = &[PROCESS_ACTIVITY];
