//! AFL++ target: see `gpumem_exporter::testing::fuzzing::accept` (src/fuzzing.rs).
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter::testing::fuzzing::accept(data));
}
