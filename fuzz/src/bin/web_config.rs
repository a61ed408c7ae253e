//! AFL++ target: see `gpumem_exporter_fuzz::web_config`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::web_config(data));
}
