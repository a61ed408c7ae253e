//! AFL++ target: see `gpumem_exporter::testing::fuzzing::torch_message` (src/fuzzing.rs).
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter::testing::fuzzing::torch_message(data));
}
