//! AFL++ target: see `gpumem_exporter_fuzz::slurm`.
fn main() {
    afl::fuzz!(|data: &[u8]| gpumem_exporter_fuzz::slurm(data));
}
