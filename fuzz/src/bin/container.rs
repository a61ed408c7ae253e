//! AFL++ target: see `gpumem_exporter_fuzz::container`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::container(data));
}
