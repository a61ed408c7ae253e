//! AFL++ target: see `gpumem_exporter_fuzz::proc`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::proc(data));
}
