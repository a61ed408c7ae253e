//! AFL++ target: see `gpumem_exporter::testing::fuzzing::web_config` (src/fuzzing.rs).
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter::testing::fuzzing::web_config(data));
}
