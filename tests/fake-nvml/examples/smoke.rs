//! Drives the built fake through nvml-wrapper, as the exporter does.
//!
//! ```text
//! cargo build -p fake-nvml
//! FAKE_NVML_CONFIG=tests/fake-nvml/scenarios/example.yaml \
//!     cargo run -p fake-nvml --example smoke [-- path/to/libfake_nvml.so]
//! ```

use std::path::PathBuf;

use nvml_wrapper::Nvml;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let lib = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/libfake_nvml.so")
        });
    let nvml = Nvml::builder().lib_path(lib.as_os_str()).init()?;
    println!(
        "driver {} nvml {} cuda {}",
        nvml.sys_driver_version()?,
        nvml.sys_nvml_version()?,
        nvml.sys_cuda_driver_version()?
    );
    let count = nvml.device_count()?;
    println!("device_count {count}");
    for i in 0..count {
        let d = nvml.device_by_index(i)?;
        let pci = d.pci_info()?;
        let m = d.memory_info()?;
        println!(
            "[{i}] {} {} bus_id={} domain={} bus={} device={}",
            d.name()?,
            d.uuid()?,
            pci.bus_id,
            pci.domain,
            pci.bus,
            pci.device
        );
        println!(
            "    memory total={} reserved={} used={} free={}",
            m.total, m.reserved, m.used, m.free
        );
        println!("    compute  {:?}", d.running_compute_processes()?);
        println!("    graphics {:?}", d.running_graphics_processes()?);
        println!("    mps      {:?}", d.mps_running_compute_processes()?);
        let mig = d.mig_mode()?;
        if mig.current == 1 {
            for m in 0..d.mig_device_count()? {
                let md = match d.mig_device_by_index(m) {
                    Ok(md) => md,
                    Err(nvml_wrapper::error::NvmlError::NotFound) => continue,
                    Err(e) => return Err(e.into()),
                };
                // nvml-wrapper 0.13 has no safe wrapper for the instance ids.
                let (mut gi, mut ci) = (0, 0);
                // SAFETY: a live handle from this Nvml and valid out-pointers.
                unsafe {
                    nvml.lib().nvmlDeviceGetGpuInstanceId(md.handle(), &mut gi);
                    nvml.lib()
                        .nvmlDeviceGetComputeInstanceId(md.handle(), &mut ci);
                }
                println!(
                    "    mig[{m}] {} gi={gi} ci={ci} used={} compute {:?}",
                    md.uuid()?,
                    md.memory_info()?.used,
                    md.running_compute_processes()?
                );
            }
        }
    }
    Ok(())
}
