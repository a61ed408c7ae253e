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
    let mut events = Some(nvml.create_event_set()?);
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
        print_telemetry(&nvml, &d);
        if let Ok(types) = d.supported_event_types()
            && let Some(set) = events.take()
        {
            events = Some(d.register_events(types, set).map_err(|e| e.error)?);
        }
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
    if let Some(set) = events {
        while let Ok(e) = set.wait(0) {
            println!(
                "event {:?} data={:?} on {}",
                e.event_type,
                e.event_data,
                e.device.uuid()?
            );
        }
    }
    Ok(())
}

/// The issue-12 calls through nvml-wrapper; NOT_SUPPORTED prints as an error.
fn print_telemetry(nvml: &Nvml, d: &nvml_wrapper::Device<'_>) {
    use nvml_wrapper::enum_wrappers::device::{
        Clock, EccCounter, MemoryError, RetirementCause, TemperatureSensor,
    };
    println!("    utilization {:?}", d.utilization_rates());
    println!(
        "    encoder {:?} decoder {:?}",
        d.encoder_utilization(),
        d.decoder_utilization()
    );
    println!(
        "    process utilization {:?}",
        d.process_utilization_stats(None)
    );
    println!(
        "    temperature {:?} power {:?} limit {:?} energy {:?}",
        d.temperature(TemperatureSensor::Gpu),
        d.power_usage(),
        d.enforced_power_limit(),
        d.total_energy_consumption()
    );
    println!(
        "    clocks sm {:?} mem {:?} graphics {:?} video {:?} pstate {:?} reasons {:?}",
        d.clock_info(Clock::SM),
        d.clock_info(Clock::Memory),
        d.clock_info(Clock::Graphics),
        d.clock_info(Clock::Video),
        d.performance_state(),
        d.current_throttle_reasons()
    );
    println!(
        "    ecc {:?} uncorrected volatile {:?}",
        d.is_ecc_enabled(),
        d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
    );
    // nvml-wrapper 0.13 has no safe wrapper for remapped rows.
    let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: a live handle from this Nvml and valid out-pointers.
    let rc = unsafe {
        nvml.lib().nvmlDeviceGetRemappedRows(
            d.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failed,
        )
    };
    println!(
        "    remapped rows rc={rc} correctable={corr} uncorrectable={unc} pending={pending} failed={failed}"
    );
    println!(
        "    retired sbe {:?} dbe {:?} pending {:?}",
        d.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
        d.retired_pages(RetirementCause::DoubleBitEccError),
        d.are_pages_pending_retired()
    );
}
