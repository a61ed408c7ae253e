//! AFL++ target: see `gpumem_exporter_fuzz::cgroup`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::cgroup(data));
}
