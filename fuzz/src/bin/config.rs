//! AFL++ target: see `gpumem_exporter_fuzz::config`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::config(data));
}
