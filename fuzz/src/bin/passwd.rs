//! AFL++ target: see `gpumem_exporter_fuzz::passwd`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::passwd(data));
}
