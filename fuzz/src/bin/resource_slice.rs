//! AFL++ target: see `gpumem_exporter_fuzz::resource_slice`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::resource_slice(data));
}
