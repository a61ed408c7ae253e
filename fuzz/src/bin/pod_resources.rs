//! AFL++ target: see `gpumem_exporter_fuzz::pod_resources`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::pod_resources(data));
}
