//! AFL++ target: see `gpumem_exporter_fuzz::accept`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::accept(data));
}
