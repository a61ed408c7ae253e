//! AFL++ target: see `gpumem_exporter_fuzz::torch`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::torch(data));
}
