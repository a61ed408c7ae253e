//! Unit tests: call the exported C functions directly, as a C caller would.
//!
//! The library state is process-wide (like NVML's), so tests take `SERIAL`
//! and point the library at their own scenario file without touching the
//! environment.

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::*;

use crate::events::*;
use crate::gpm::*;
use crate::health::*;
use crate::telemetry::*;
use crate::*;

static SERIAL: Mutex<()> = Mutex::new(());
static NEXT_FILE: AtomicUsize = AtomicUsize::new(0);

const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const UNINITIALIZED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const NA: u64 = u64::MAX;
const NO_ID: u32 = 0xFFFF_FFFF;

/// One test's scenario file, and exclusive use of the library.
struct Fixture {
    path: PathBuf,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    fn new(yaml: &str) -> Self {
        let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        let path = std::env::temp_dir().join(format!(
            "fake-nvml-test-{}-{}.yaml",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        ));
        let fixture = Fixture {
            path,
            _serial: serial,
        };
        fixture.write(yaml);
        state::reset_for_test(Some(fixture.path.clone()));
        fixture
    }

    /// What tests of the exporter do: write a temp file, rename it over.
    fn write(&self, yaml: &str) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, yaml).expect("write scenario");
        std::fs::rename(&tmp, &self.path).expect("rename scenario");
    }

    fn init(&self) {
        assert_eq!(nvmlInit_v2(), SUCCESS);
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        state::reset_for_test(None);
        let _ = std::fs::remove_file(&self.path);
    }
}

fn dev(index: u32) -> nvmlDevice_t {
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(index, &mut h) },
        SUCCESS
    );
    h
}

fn mig(parent: nvmlDevice_t, index: u32) -> nvmlDevice_t {
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(parent, index, &mut h) },
        SUCCESS
    );
    h
}

type ProcFn =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;

/// As nvml-wrapper does it: count with NULL, then a buffer of count + 5.
fn procs(f: ProcFn, d: nvmlDevice_t) -> Vec<(u32, u64, u32, u32)> {
    let mut count: c_uint = 0;
    let rc = unsafe { f(d, &mut count, ptr::null_mut()) };
    if count == 0 {
        assert_eq!(rc, SUCCESS);
        return Vec::new();
    }
    assert_eq!(rc, INSUFFICIENT_SIZE);
    let mut buf = vec![
        nvmlProcessInfo_t {
            pid: 0,
            usedGpuMemory: 0,
            gpuInstanceId: 0,
            computeInstanceId: 0,
        };
        count as usize + 5
    ];
    let mut n = buf.len() as c_uint;
    assert_eq!(unsafe { f(d, &mut n, buf.as_mut_ptr()) }, SUCCESS);
    assert_eq!(n, count);
    buf.truncate(n as usize);
    buf.iter()
        .map(|p| (p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId))
        .collect()
}

fn name_of(d: nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; NVML_DEVICE_NAME_V2_BUFFER_SIZE as usize];
    assert_eq!(
        unsafe { nvmlDeviceGetName(d, buf.as_mut_ptr(), buf.len() as c_uint) },
        SUCCESS
    );
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn memory_v2(d: nvmlDevice_t) -> Result<nvmlMemory_v2_t, nvmlReturn_t> {
    let mut m = nvmlMemory_v2_t {
        version: MEMORY_V2_VERSION,
        total: 0,
        reserved: 0,
        free: 0,
        used: 0,
    };
    match unsafe { nvmlDeviceGetMemoryInfo_v2(d, &mut m) } {
        SUCCESS => Ok(m),
        code => Err(code),
    }
}

const TWO_GPUS: &str = r#"
devices:
  - uuid: GPU-aaaaaaaa-0000-0000-0000-000000000000
    pci_bus_id: "00000000:1b:00.0"
    memory: {total: 1000, reserved: 100, used: 300}
    processes:
      - {pid: 10, used: 200}
      - {pid: 11, used: null, type: graphics}
      - {pid: 12, used: 50, type: both}
      - {pid: 13, used: 40, type: mps}
  - uuid: GPU-bbbbbbbb-0000-0000-0000-000000000000
    name: NVIDIA H100
    memory: {total: 1000, reserved: 100, used: 950}
"#;

/// Every export has the exact type nvml-wrapper-sys loads it as.
#[test]
fn signatures_match_nvml_wrapper_sys() {
    fn same<T, E>(_: &Result<T, E>, _: T) {}
    #[allow(dead_code)]
    fn check(lib: &NvmlLib) {
        macro_rules! check { ($($f:ident),* $(,)?) => { $( same(&lib.$f, $f); )* } }
        check!(
            nvmlInit_v2,
            nvmlInitWithFlags,
            nvmlShutdown,
            nvmlErrorString,
            nvmlSystemGetDriverVersion,
            nvmlSystemGetNVMLVersion,
            nvmlSystemGetCudaDriverVersion,
            nvmlSystemGetCudaDriverVersion_v2,
            nvmlDeviceGetCount_v2,
            nvmlDeviceGetHandleByIndex_v2,
            nvmlDeviceGetHandleByUUID,
            nvmlDeviceGetIndex,
            nvmlDeviceGetName,
            nvmlDeviceGetUUID,
            nvmlDeviceGetPciInfo_v3,
            nvmlDeviceGetMemoryInfo,
            nvmlDeviceGetMemoryInfo_v2,
            nvmlDeviceGetComputeRunningProcesses_v3,
            nvmlDeviceGetGraphicsRunningProcesses_v3,
            nvmlDeviceGetMPSComputeRunningProcesses_v3,
            nvmlDeviceGetMigMode,
            nvmlDeviceGetMaxMigDeviceCount,
            nvmlDeviceGetMigDeviceHandleByIndex,
            nvmlDeviceIsMigDeviceHandle,
            nvmlDeviceGetGpuInstanceId,
            nvmlDeviceGetComputeInstanceId,
            nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
            nvmlDeviceGetUtilizationRates,
            nvmlDeviceGetEncoderUtilization,
            nvmlDeviceGetDecoderUtilization,
            nvmlDeviceGetProcessUtilization,
            nvmlDeviceGetTemperature,
            nvmlDeviceGetPowerUsage,
            nvmlDeviceGetEnforcedPowerLimit,
            nvmlDeviceGetTotalEnergyConsumption,
            nvmlDeviceGetClockInfo,
            nvmlDeviceGetPerformanceState,
            nvmlDeviceGetCurrentClocksEventReasons,
            nvmlDeviceGetCurrentClocksThrottleReasons,
            nvmlDeviceGetEccMode,
            nvmlDeviceGetTotalEccErrors,
            nvmlDeviceGetRemappedRows,
            nvmlDeviceGetRetiredPages,
            nvmlDeviceGetRetiredPages_v2,
            nvmlDeviceGetRetiredPagesPendingStatus,
            nvmlEventSetCreate,
            nvmlEventSetFree,
            nvmlDeviceGetSupportedEventTypes,
            nvmlDeviceRegisterEvents,
            nvmlEventSetWait_v2,
            nvmlDeviceGetVirtualizationMode,
            nvmlGpmSampleAlloc,
            nvmlGpmSampleFree,
            nvmlGpmSampleGet,
            nvmlGpmMigSampleGet,
            nvmlGpmQueryDeviceSupport,
            nvmlGpmMetricsGet,
        );
        // v1 is loaded only with nvml-wrapper-sys's `legacy-functions`
        // feature; its C type is v2's.
        same(&lib.nvmlEventSetWait_v2, nvmlEventSetWait);
    }
    let _ = check as fn(&NvmlLib);
    assert_eq!(MEMORY_V2_VERSION, 0x0200_0028);
}

#[test]
fn init_is_reference_counted() {
    let f = Fixture::new(TWO_GPUS);
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);
    assert_eq!(nvmlShutdown(), UNINITIALIZED);
    f.init();
    assert_eq!(nvmlInitWithFlags(NVML_INIT_FLAG_NO_GPUS), SUCCESS);
    assert_eq!(nvmlShutdown(), SUCCESS);
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 2);
    let d = dev(0);
    assert_eq!(nvmlShutdown(), SUCCESS);
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);
    assert_eq!(memory_v2(d).map(|_| ()), Err(UNINITIALIZED));
    assert_eq!(nvmlShutdown(), UNINITIALIZED);
}

#[test]
fn init_fails_without_a_good_scenario() {
    let f = Fixture::new("devices: [{uuid: GPU-1, colour: red}]");
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    f.write("devices: [");
    assert_eq!(nvmlInit_v2(), UNKNOWN);
    state::reset_for_test(Some(f.path.with_extension("missing")));
    assert_eq!(nvmlInit_v2(), UNKNOWN);
}

#[test]
fn init_error_is_reread_at_each_init() {
    let f = Fixture::new("init_error: driver_not_loaded\ndevices: []");
    assert_eq!(nvmlInit_v2(), nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED);
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);
    f.write("init_error: no_permission\ndevices: []");
    assert_eq!(nvmlInit_v2(), nvmlReturn_enum_NVML_ERROR_NO_PERMISSION);
    f.write("init_error: null\ninit_delay_ms: 30\ndevices: []");
    let start = Instant::now();
    f.init();
    assert!(start.elapsed() >= Duration::from_millis(30));
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 0, "devices: [] means zero GPUs");
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(0, &mut h) },
        INVALID_ARGUMENT
    );
}

#[test]
fn system_strings_and_versions() {
    let f = Fixture::new("devices: []");
    f.init();
    let mut buf = [0 as c_char; NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE as usize];
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(buf.as_mut_ptr(), buf.len() as c_uint) },
        SUCCESS
    );
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }, c"580.159.04");
    // "580.159.04" is 10 bytes: 10 is too small (no room for NUL), 11 fits.
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 10) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 11) },
        SUCCESS
    );
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(ptr::null_mut(), 80) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlSystemGetNVMLVersion(buf.as_mut_ptr(), buf.len() as c_uint) },
        SUCCESS
    );
    assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }, c"13.580.159.04");
    let mut cuda: c_int = 0;
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion(&mut cuda) },
        SUCCESS
    );
    assert_eq!(cuda, 13000);
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion_v2(&mut cuda) },
        SUCCESS
    );
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion_v2(ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    let s = |code| unsafe { CStr::from_ptr(nvmlErrorString(code)) };
    assert_eq!(s(INSUFFICIENT_SIZE), c"Insufficient Size");
    assert_eq!(s(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST), c"GPU is lost");
    assert_eq!(s(12345), c"Unknown Error");
}

#[test]
fn identity_name_uuid_pci_index() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    let (d0, d1) = (dev(0), dev(1));
    assert_eq!(name_of(d0), "NVIDIA H200");
    assert_eq!(name_of(d1), "NVIDIA H100");
    let mut small = [0 as c_char; 11];
    assert_eq!(
        unsafe { nvmlDeviceGetName(d0, small.as_mut_ptr(), small.len() as c_uint) },
        INSUFFICIENT_SIZE
    );
    let mut uuid = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE as usize];
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(d1, uuid.as_mut_ptr(), uuid.len() as c_uint) },
        SUCCESS
    );
    assert_eq!(
        unsafe { CStr::from_ptr(uuid.as_ptr()) },
        c"GPU-bbbbbbbb-0000-0000-0000-000000000000"
    );
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(d1, uuid.as_mut_ptr(), 40) },
        INSUFFICIENT_SIZE
    );
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut h) },
        SUCCESS
    );
    assert_eq!(h, d1);
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(c"GPU-nope".as_ptr(), &mut h) },
        NOT_FOUND
    );
    let mut index: c_uint = 9;
    assert_eq!(unsafe { nvmlDeviceGetIndex(d1, &mut index) }, SUCCESS);
    assert_eq!(index, 1);

    let mut pci: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { nvmlDeviceGetPciInfo_v3(d0, &mut pci) }, SUCCESS);
    assert_eq!(
        unsafe { CStr::from_ptr(pci.busId.as_ptr()) },
        c"00000000:1B:00.0"
    );
    assert_eq!(
        unsafe { CStr::from_ptr(pci.busIdLegacy.as_ptr()) },
        c"0000:1B:00.0"
    );
    assert_eq!((pci.domain, pci.bus, pci.device), (0, 0x1B, 0));
    assert_eq!(unsafe { nvmlDeviceGetPciInfo_v3(d1, &mut pci) }, SUCCESS);
    assert_eq!(
        unsafe { CStr::from_ptr(pci.busId.as_ptr()) },
        c"00000000:02:00.0"
    );
}

#[test]
fn bad_handles_and_null_pointers() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    for bad in [0usize, 3, 0x0001_0001, 0xdead_beef_0001] {
        assert_eq!(
            memory_v2(handle(bad)).map(|_| ()),
            Err(INVALID_ARGUMENT),
            "{bad:#x}"
        );
    }
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(dev(0), ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe {
            nvmlDeviceGetComputeRunningProcesses_v3(dev(0), ptr::null_mut(), ptr::null_mut())
        },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(0, ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetCount_v2(ptr::null_mut()) },
        INVALID_ARGUMENT
    );
}

#[test]
fn memory_free_is_computed() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    let m = memory_v2(dev(0)).expect("memory");
    assert_eq!((m.total, m.reserved, m.used, m.free), (1000, 100, 300, 600));
    assert_eq!(m.version, MEMORY_V2_VERSION);
    // reserved + used > total: free saturates at 0.
    let m = memory_v2(dev(1)).expect("memory");
    assert_eq!(m.free, 0);
    let mut v1 = nvmlMemory_t {
        total: 0,
        free: 0,
        used: 0,
    };
    assert_eq!(unsafe { nvmlDeviceGetMemoryInfo(dev(0), &mut v1) }, SUCCESS);
    assert_eq!((v1.total, v1.used, v1.free), (1000, 400, 600));
    let mut wrong = nvmlMemory_v2_t {
        version: 1,
        total: 0,
        reserved: 0,
        free: 0,
        used: 0,
    };
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(dev(0), &mut wrong) },
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    );
}

#[test]
fn process_queries_follow_the_count_contract() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    let d0 = dev(0);
    assert_eq!(
        procs(nvmlDeviceGetComputeRunningProcesses_v3, d0),
        [(10, 200, NO_ID, NO_ID), (12, 50, NO_ID, NO_ID)]
    );
    assert_eq!(
        procs(nvmlDeviceGetGraphicsRunningProcesses_v3, d0),
        [(11, NA, NO_ID, NO_ID), (12, 50, NO_ID, NO_ID)],
        "used: null is NVML_VALUE_NOT_AVAILABLE"
    );
    assert_eq!(
        procs(nvmlDeviceGetMPSComputeRunningProcesses_v3, d0),
        [(13, 40, NO_ID, NO_ID)]
    );
    // No processes: SUCCESS and 0 even with a NULL buffer.
    let mut count: c_uint = 7;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(dev(1), &mut count, ptr::null_mut()) },
        SUCCESS
    );
    assert_eq!(count, 0);
    // A buffer that is too small: INSUFFICIENT_SIZE and the needed count.
    let mut one = [nvmlProcessInfo_t {
        pid: 0,
        usedGpuMemory: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    }];
    let mut count: c_uint = 1;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(d0, &mut count, one.as_mut_ptr()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(count, 2);
    assert_eq!(one[0].pid, 0, "nothing written on INSUFFICIENT_SIZE");
}

#[test]
fn device_errors_and_delays_are_injected() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    f.write(&TWO_GPUS.replace(
        "    name: NVIDIA H100\n",
        "    name: NVIDIA H100\n    error: gpu_lost\n",
    ));
    let d1 = dev(1); // still answers
    assert_eq!(
        memory_v2(d1).map(|_| ()),
        Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST)
    );
    let mut count: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(d1, &mut count, ptr::null_mut()) },
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST
    );
    let mut buf = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetName(d1, buf.as_mut_ptr(), 96) },
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST
    );
    assert!(memory_v2(dev(0)).is_ok(), "the other GPU keeps answering");

    for (word, code) in [
        ("unknown", UNKNOWN),
        ("not_supported", NOT_SUPPORTED),
        ("no_permission", nvmlReturn_enum_NVML_ERROR_NO_PERMISSION),
        ("timeout", nvmlReturn_enum_NVML_ERROR_TIMEOUT),
    ] {
        f.write(&TWO_GPUS.replace(
            "    name: NVIDIA H100\n",
            &format!("    name: NVIDIA H100\n    error: {word}\n"),
        ));
        assert_eq!(memory_v2(d1).map(|_| ()), Err(code), "{word}");
    }

    f.write(&TWO_GPUS.replace(
        "    name: NVIDIA H100\n",
        "    name: NVIDIA H100\n    delay_ms: 50\n",
    ));
    let start = Instant::now();
    assert!(memory_v2(d1).is_ok());
    assert!(start.elapsed() >= Duration::from_millis(50));
    let start = Instant::now();
    let _ = dev(1);
    assert!(memory_v2(dev(0)).is_ok());
    assert!(
        start.elapsed() < Duration::from_millis(50),
        "only that GPU is slow"
    );
}

#[test]
fn scenario_is_reloaded_when_the_file_changes() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    let d1 = dev(1);
    assert!(procs(nvmlDeviceGetComputeRunningProcesses_v3, d1).is_empty());

    // A process appears and memory grows.
    f.write(&TWO_GPUS.replace(
        "memory: {total: 1000, reserved: 100, used: 950}",
        "memory: {total: 1000, reserved: 100, used: 800}\n    processes: [{pid: 77, used: 700}]",
    ));
    assert_eq!(
        procs(nvmlDeviceGetComputeRunningProcesses_v3, d1),
        [(77, 700, NO_ID, NO_ID)]
    );
    assert_eq!(memory_v2(d1).map(|m| m.free), Ok(100));

    // A broken edit keeps the previous scenario.
    f.write("devices: [{uuid: GPU-x, bogus: 1}]");
    assert_eq!(
        procs(nvmlDeviceGetComputeRunningProcesses_v3, d1),
        [(77, 700, NO_ID, NO_ID)]
    );

    // The process exits; the file shrinks to one GPU, so handle 1 is gone.
    f.write("devices: [{uuid: GPU-only}]");
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 1);
    assert_eq!(memory_v2(d1).map(|_| ()), Err(INVALID_ARGUMENT));

    // An in-place rewrite (no rename) is seen too.
    std::fs::write(&f.path, "devices: [{uuid: GPU-only}, {uuid: GPU-two}]").expect("write");
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 2);

    // A vanished file keeps the last good scenario too.
    std::fs::remove_file(&f.path).expect("remove");
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 2);
}

const MIG: &str = r#"
devices:
  - uuid: GPU-11111111-0000-0000-0000-000000000000
    mig_devices:
      - uuid: MIG-11111111-0000-0000-0000-000000000001
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {total: 100, reserved: 10, used: 30}
        processes: [{pid: 500, used: 20}, {pid: 502, used: 5, type: mps}]
      - uuid: MIG-11111111-0000-0000-0000-000000000002
        gpu_instance_id: 2
        compute_instance_id: 0
        memory: {total: 100, reserved: 10, used: 0}
        processes: [{pid: 501, used: null, type: both}]
  - uuid: GPU-22222222-0000-0000-0000-000000000000
    processes: [{pid: 600, used: 1}]
"#;

#[test]
fn mig_parent_lists_children_processes() {
    let f = Fixture::new(MIG);
    f.init();
    let (parent, plain) = (dev(0), dev(1));
    let (mut cur, mut pend) = (9, 9);
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(parent, &mut cur, &mut pend) },
        SUCCESS
    );
    assert_eq!((cur, pend), (1, 1));
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(plain, &mut cur, &mut pend) },
        SUCCESS
    );
    assert_eq!((cur, pend), (0, 0));
    let mut max: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetMaxMigDeviceCount(parent, &mut max) },
        SUCCESS
    );
    assert_eq!(max, 7);

    let (m0, m1) = (mig(parent, 0), mig(parent, 1));
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(parent, 2, &mut h) },
        NOT_FOUND
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(parent, 7, &mut h) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(plain, 0, &mut h) },
        NOT_SUPPORTED
    );

    let mut is_mig: c_uint = 9;
    assert_eq!(
        unsafe { nvmlDeviceIsMigDeviceHandle(m1, &mut is_mig) },
        SUCCESS
    );
    assert_eq!(is_mig, 1);
    assert_eq!(
        unsafe { nvmlDeviceIsMigDeviceHandle(parent, &mut is_mig) },
        SUCCESS
    );
    assert_eq!(is_mig, 0);
    let (mut gi, mut ci) = (0, 9);
    assert_eq!(unsafe { nvmlDeviceGetGpuInstanceId(m1, &mut gi) }, SUCCESS);
    assert_eq!(
        unsafe { nvmlDeviceGetComputeInstanceId(m1, &mut ci) },
        SUCCESS
    );
    assert_eq!((gi, ci), (2, 0));
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceId(parent, &mut gi) },
        NOT_SUPPORTED
    );
    assert_eq!(
        unsafe { nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m1, &mut h) },
        SUCCESS
    );
    assert_eq!(h, parent);
    assert_eq!(
        unsafe {
            nvmlDeviceGetHandleByUUID(c"MIG-11111111-0000-0000-0000-000000000002".as_ptr(), &mut h)
        },
        SUCCESS
    );
    assert_eq!(h, m1);
    assert_eq!(name_of(m0), "NVIDIA H200 MIG");
    assert_eq!(memory_v2(m0).map(|m| m.free), Ok(60));

    let compute = nvmlDeviceGetComputeRunningProcesses_v3;
    assert_eq!(procs(compute, parent), [(500, 20, 1, 0), (501, NA, 2, 0)]);
    assert_eq!(procs(compute, m0), [(500, 20, 1, 0)]);
    assert_eq!(procs(compute, m1), [(501, NA, 2, 0)]);
    assert_eq!(
        procs(nvmlDeviceGetGraphicsRunningProcesses_v3, parent),
        [(501, NA, 2, 0)]
    );
    assert_eq!(
        procs(nvmlDeviceGetMPSComputeRunningProcesses_v3, parent),
        [(502, 5, 1, 0)]
    );
    assert_eq!(procs(compute, plain), [(600, 1, NO_ID, NO_ID)]);

    // The parent's error reaches its MIG devices.
    f.write(&MIG.replacen(
        "  - uuid: GPU-11111111-0000-0000-0000-000000000000\n",
        "  - uuid: GPU-11111111-0000-0000-0000-000000000000\n    error: gpu_lost\n",
        1,
    ));
    assert_eq!(
        memory_v2(m0).map(|_| ()),
        Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST)
    );
}

#[test]
fn validation_rejects_mistakes() {
    let cases = [
        ("devices: [{uuid: GPU-1, colour: red}]", "unknown field"),
        ("devices: [{uuid: GPU-1}, {uuid: GPU-1}]", "used twice"),
        (
            "devices: [{uuid: GPU-1, pci_bus_id: '0:0:0'}]",
            "pci_bus_id",
        ),
        (
            "devices: [{uuid: GPU-1, pci_bus_id: '0:100:0.0'}]",
            "pci_bus_id",
        ),
        (
            "devices: [{uuid: GPU-1, processes: [{pid: 1, type: cuda}]}]",
            "cuda",
        ),
        ("devices: [{uuid: GPU-1, error: melted}]", "melted"),
        ("init_error: gpu_lost", "gpu_lost"),
        (
            "devices: [{uuid: GPU-1}, {uuid: GPU-2, utilization: {gpu: 101}}]",
            "devices[1].utilization.gpu: 101 is above 100",
        ),
        (
            "devices: [{uuid: GPU-1, utilization: {decoder: 200}}]",
            "devices[0].utilization.decoder: 200 is above 100",
        ),
        (
            "devices: [{uuid: GPU-1, process_utilization: [{pid: 1}, {pid: 2, memory: 101}]}]",
            "devices[0].process_utilization[1].memory: 101 is above 100",
        ),
        (
            "devices: [{uuid: GPU-1, process_utilization: [{sm: 1}]}]",
            "pid",
        ),
        (
            "devices: [{uuid: GPU-1, performance_state: 16}]",
            "devices[0].performance_state: 16 is above 15",
        ),
        (
            "devices: [{uuid: GPU-1, clocks_mhz: {shader: 1}}]",
            "unknown field",
        ),
        ("devices: [{uuid: GPU-1, ecc: {sbe: 1}}]", "unknown field"),
        (
            "devices: [{uuid: GPU-1, remapped_rows: {pending: 3}}]",
            "line 1 column 50: invalid boolean",
        ),
        ("devices: [{uuid: GPU-1, temperature_c: -5}]", "invalid u32"),
        (
            "devices: [{uuid: GPU-1, mig_devices: [{uuid: MIG-1, gpu_instance_id: 1, compute_instance_id: 0, memory: {total: 1}, temperature_c: 3}]}]",
            "unknown field",
        ),
        (
            "devices: [{uuid: GPU-1, processes: [{pid: 1}], mig_devices: [{uuid: MIG-1, gpu_instance_id: 1, compute_instance_id: 0, memory: {total: 1}}]}]",
            "mig",
        ),
    ];
    for (yaml, expected) in cases {
        match scenario::parse(yaml) {
            Ok(_) => panic!("accepted: {yaml}"),
            Err(e) => assert!(e.contains(expected), "{yaml}: {e}"),
        }
    }
    let s = scenario::parse("devices: [{uuid: GPU-1, pci_bus_id: '0001:a:1f.7'}]").expect("parse");
    let busid = unsafe { CStr::from_ptr(s.gpus[0].pci.busId.as_ptr()) };
    assert_eq!(busid, c"00000001:0A:1F.7");
}

#[test]
fn shipped_scenarios_parse() {
    let s = scenario::parse(include_str!("../scenarios/example.yaml")).expect("example.yaml");
    assert_eq!(s.gpus.len(), 2);
    assert_eq!(s.gpus[0].telemetry.clock_event_reasons, Some(0x4));
    let s = scenario::parse(include_str!("../scenarios/mig.yaml")).expect("mig.yaml");
    assert_eq!(s.gpus[0].migs.len(), 2);
    let s = scenario::parse(include_str!("../scenarios/unhealthy.yaml")).expect("unhealthy.yaml");
    assert_eq!(s.gpus[0].xid_events, Some(vec![48, 63]));
    assert!(s.gpus[1].health.remapped_rows.is_none());
}

#[test]
fn handle_errors_fail_only_the_handle_query_of_that_gpu() {
    let f = Fixture::new(&TWO_GPUS.replace(
        "    name: NVIDIA H100\n",
        "    name: NVIDIA H100\n    handle_error: gpu_lost\n",
    ));
    f.init();
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(1, &mut h) },
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST
    );
    assert!(memory_v2(dev(0)).is_ok());
    // Healed: the next handle query answers.
    f.write(TWO_GPUS);
    assert!(memory_v2(dev(1)).is_ok());
}

#[test]
fn runtime_errors_fail_every_call_until_healed() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    let d0 = dev(0);
    for (word, code) in [
        (
            "lib_rm_version_mismatch",
            nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        ),
        (
            "driver_not_loaded",
            nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
        ),
        ("uninitialized", UNINITIALIZED),
    ] {
        f.write(&format!("runtime_error: {word}\n{TWO_GPUS}"));
        assert_eq!(memory_v2(d0).map(|_| ()), Err(code), "{word}");
        let mut count: c_uint = 0;
        assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, code, "{word}");
    }
    // The upgrade half done: init fails with the mismatch too.
    f.write(&format!(
        "init_error: lib_rm_version_mismatch\nruntime_error: lib_rm_version_mismatch\n{TWO_GPUS}"
    ));
    assert_eq!(nvmlShutdown(), SUCCESS);
    assert_eq!(
        nvmlInit_v2(),
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH
    );
    f.write(TWO_GPUS);
    f.init();
    assert!(memory_v2(dev(0)).is_ok());
}

#[test]
fn the_device_count_is_fixed_until_the_next_init() {
    let f = Fixture::new(TWO_GPUS);
    f.init();
    let three = TWO_GPUS.to_string() + "  - uuid: GPU-cccccccc-0000-0000-0000-000000000000\n";
    f.write(&three);
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 2, "a GPU added at run time waits for re-init");
    let mut h = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(2, &mut h) },
        INVALID_ARGUMENT
    );
    assert_eq!(nvmlShutdown(), SUCCESS);
    f.init();
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 3);
    assert!(memory_v2(dev(2)).is_ok());
}

#[test]
fn a_destroyed_mig_instance_leaves_a_stale_handle() {
    let f = Fixture::new(MIG);
    f.init();
    let parent = dev(0);
    let (m0, m1) = (mig(parent, 0), mig(parent, 1));
    assert!(memory_v2(m1).is_ok());
    // Instance 1 destroyed and another created in its slot.
    f.write(&MIG.replace(
        "MIG-11111111-0000-0000-0000-000000000002",
        "MIG-11111111-0000-0000-0000-000000000009",
    ));
    assert!(
        memory_v2(m0).is_ok(),
        "the untouched instance still answers"
    );
    assert_eq!(memory_v2(m1).map(|_| ()), Err(INVALID_ARGUMENT));
    let fresh = mig(parent, 1);
    assert!(memory_v2(fresh).is_ok());
    // MIG turned off: every instance handle is stale.
    f.write(
        "devices:\n  - uuid: GPU-11111111-0000-0000-0000-000000000000\n  - uuid: GPU-22222222-0000-0000-0000-000000000000\n",
    );
    assert_eq!(memory_v2(m0).map(|_| ()), Err(INVALID_ARGUMENT));
}

// ------------------------------------------------- telemetry and health

/// GPU 0 answers everything, GPU 1 a few things, GPU 2 is in MIG mode with
/// every value set (so its MIG handle's NOT_SUPPORTED is about MIG).
const TELEMETRY: &str = r#"
devices:
  - uuid: GPU-aaaaaaaa-0000-0000-0000-000000000000
    utilization: {gpu: 99, memory: 22, encoder: 3, decoder: 4}
    process_utilization:
      - {pid: 436, sm: 97, memory: 21, encoder: 1, decoder: 2}
      - {pid: 437, sm: 2}
    temperature_c: 62
    power_mw: 692700
    power_limit_mw: 700000
    energy_mj: 123456789012
    clocks_mhz: {graphics: 1980, sm: 1470, memory: 3201, video: 1650}
    performance_state: 0
    clock_event_reasons: 0x4
    ecc: {enabled: true, corrected_volatile: 1, corrected_aggregate: 2, uncorrected_volatile: 3, uncorrected_aggregate: 4}
    remapped_rows: {correctable: 5, uncorrectable: 1, pending: true, failed: false}
    retired_pages: {single_bit_ecc: 3, double_bit_ecc: 0, pending: true}
    xid_events: [79, 48]
  - uuid: GPU-bbbbbbbb-0000-0000-0000-000000000000
    utilization: {gpu: 5, encoder: 0}
    clocks_mhz: {sm: 345}
    ecc: {enabled: false, pending_enabled: true, uncorrected_volatile: 9}
  - uuid: GPU-cccccccc-0000-0000-0000-000000000000
    utilization: {gpu: 1, memory: 1, encoder: 1, decoder: 1}
    process_utilization: []
    temperature_c: 30
    power_mw: 1
    power_limit_mw: 1
    energy_mj: 1
    clocks_mhz: {graphics: 1, sm: 1, memory: 1, video: 1}
    performance_state: 1
    clock_event_reasons: 1
    ecc: {}
    remapped_rows: {}
    retired_pages: {}
    xid_events: []
    mig_devices:
      - uuid: MIG-cccccccc-0000-0000-0000-000000000001
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {total: 100}
"#;

fn util(d: nvmlDevice_t) -> Result<(u32, u32), nvmlReturn_t> {
    let mut u = nvmlUtilization_t { gpu: 0, memory: 0 };
    match unsafe { nvmlDeviceGetUtilizationRates(d, &mut u) } {
        SUCCESS => Ok((u.gpu, u.memory)),
        code => Err(code),
    }
}

type CodecFn = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut c_uint) -> nvmlReturn_t;

fn codec(f: CodecFn, d: nvmlDevice_t) -> Result<(u32, u32), nvmlReturn_t> {
    let (mut u, mut period) = (0, 0);
    match unsafe { f(d, &mut u, &mut period) } {
        SUCCESS => Ok((u, period)),
        code => Err(code),
    }
}

/// A getter of one scalar through an out-pointer, as a Result.
fn get<T: Default>(f: impl FnOnce(*mut T) -> nvmlReturn_t) -> Result<T, nvmlReturn_t> {
    let mut v = T::default();
    match f(&mut v) {
        SUCCESS => Ok(v),
        code => Err(code),
    }
}

fn clock(d: nvmlDevice_t, kind: nvmlClockType_t) -> Result<u32, nvmlReturn_t> {
    get(|p| unsafe { nvmlDeviceGetClockInfo(d, kind, p) })
}

#[test]
fn utilization_rates_and_codecs() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let (d0, d1, d2) = (dev(0), dev(1), dev(2));
    assert_eq!(util(d0), Ok((99, 22)));
    assert_eq!(
        codec(nvmlDeviceGetEncoderUtilization, d0),
        Ok((3, CODEC_SAMPLING_PERIOD_US))
    );
    assert_eq!(codec(nvmlDeviceGetDecoderUtilization, d0), Ok((4, 167_000)));
    // Only some keys: the rest NOT_SUPPORTED; the rates need gpu and memory.
    assert_eq!(util(d1), Err(NOT_SUPPORTED));
    assert_eq!(codec(nvmlDeviceGetEncoderUtilization, d1), Ok((0, 167_000)));
    assert_eq!(
        codec(nvmlDeviceGetDecoderUtilization, d1),
        Err(NOT_SUPPORTED)
    );
    // A MIG device handle answers none of it.
    let m = mig(d2, 0);
    assert_eq!(util(d2), Ok((1, 1)));
    assert_eq!(util(m), Err(NOT_SUPPORTED));
    assert_eq!(
        codec(nvmlDeviceGetEncoderUtilization, m),
        Err(NOT_SUPPORTED)
    );
    // NULL out-pointers.
    assert_eq!(
        unsafe { nvmlDeviceGetUtilizationRates(d0, ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    let mut u = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetEncoderUtilization(d0, &mut u, ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetDecoderUtilization(d1, ptr::null_mut(), &mut u) },
        INVALID_ARGUMENT
    );
}

#[test]
fn thermal_power_clocks_and_pstate() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let (d0, d1) = (dev(0), dev(1));
    let temp = |d, sensor| get(|p| unsafe { nvmlDeviceGetTemperature(d, sensor, p) });
    assert_eq!(
        temp(d0, nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU),
        Ok(62)
    );
    assert_eq!(temp(d0, 1), Err(INVALID_ARGUMENT));
    assert_eq!(temp(d1, 0), Err(NOT_SUPPORTED));
    assert_eq!(temp(d1, 1), Err(INVALID_ARGUMENT), "arguments first");
    let power = |d| get(|p| unsafe { nvmlDeviceGetPowerUsage(d, p) });
    let limit = |d| get(|p| unsafe { nvmlDeviceGetEnforcedPowerLimit(d, p) });
    let energy = |d| get(|p| unsafe { nvmlDeviceGetTotalEnergyConsumption(d, p) });
    assert_eq!(power(d0), Ok(692_700));
    assert_eq!(limit(d0), Ok(700_000));
    assert_eq!(energy(d0), Ok(123_456_789_012));
    assert_eq!(power(d1), Err(NOT_SUPPORTED));
    assert_eq!(limit(d1), Err(NOT_SUPPORTED));
    assert_eq!(energy(d1), Err(NOT_SUPPORTED));

    assert_eq!(clock(d0, nvmlClockType_enum_NVML_CLOCK_GRAPHICS), Ok(1980));
    assert_eq!(clock(d0, nvmlClockType_enum_NVML_CLOCK_SM), Ok(1470));
    assert_eq!(clock(d0, nvmlClockType_enum_NVML_CLOCK_MEM), Ok(3201));
    assert_eq!(clock(d0, nvmlClockType_enum_NVML_CLOCK_VIDEO), Ok(1650));
    assert_eq!(
        clock(d0, nvmlClockType_enum_NVML_CLOCK_COUNT),
        Err(INVALID_ARGUMENT)
    );
    assert_eq!(clock(d1, nvmlClockType_enum_NVML_CLOCK_SM), Ok(345));
    assert_eq!(
        clock(d1, nvmlClockType_enum_NVML_CLOCK_MEM),
        Err(NOT_SUPPORTED)
    );

    let pstate = |d| get(|p| unsafe { nvmlDeviceGetPerformanceState(d, p) });
    assert_eq!(pstate(d0), Ok(nvmlPStates_enum_NVML_PSTATE_0));
    assert_eq!(pstate(d1), Err(NOT_SUPPORTED));
    let reasons = |d| get(|p| unsafe { nvmlDeviceGetCurrentClocksEventReasons(d, p) });
    let throttle = |d| get(|p| unsafe { nvmlDeviceGetCurrentClocksThrottleReasons(d, p) });
    assert_eq!(reasons(d0), Ok(0x4), "YAML hex");
    assert_eq!(throttle(d0), Ok(0x4));
    assert_eq!(reasons(d1), Err(NOT_SUPPORTED));
    assert_eq!(throttle(d1), Err(NOT_SUPPORTED));

    let m = mig(dev(2), 0);
    assert_eq!(temp(m, 0), Err(NOT_SUPPORTED));
    assert_eq!(power(m), Err(NOT_SUPPORTED));
    assert_eq!(energy(m), Err(NOT_SUPPORTED));
    assert_eq!(clock(m, 1), Err(NOT_SUPPORTED));
    assert_eq!(pstate(m), Err(NOT_SUPPORTED));
    assert_eq!(reasons(m), Err(NOT_SUPPORTED));
    assert_eq!(pstate(dev(2)), Ok(1));

    for null in [
        unsafe { nvmlDeviceGetTemperature(d0, 0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetPowerUsage(d0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetPowerUsage(d1, ptr::null_mut()) },
        unsafe { nvmlDeviceGetEnforcedPowerLimit(d0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetTotalEnergyConsumption(d0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetClockInfo(d0, 0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetPerformanceState(d0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetCurrentClocksEventReasons(d0, ptr::null_mut()) },
        unsafe { nvmlDeviceGetCurrentClocksThrottleReasons(d0, ptr::null_mut()) },
    ] {
        assert_eq!(null, INVALID_ARGUMENT);
    }
}

#[test]
fn new_calls_honour_device_and_runtime_errors() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let d0 = dev(0);
    f.write(&TELEMETRY.replacen(
        "    utilization: {gpu: 99",
        "    error: gpu_lost\n    delay_ms: 30\n    utilization: {gpu: 99",
        1,
    ));
    let start = Instant::now();
    assert_eq!(util(d0), Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST));
    assert!(start.elapsed() >= Duration::from_millis(30));
    assert_eq!(
        get(|p| unsafe { nvmlDeviceGetTemperature(d0, 0, p) }),
        Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST)
    );
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(d0, ptr::null_mut(), &mut n, 0) },
        nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST
    );
    assert_eq!(util(dev(1)), Err(NOT_SUPPORTED), "the others answer");
    f.write(&format!("runtime_error: driver_not_loaded\n{TELEMETRY}"));
    assert_eq!(util(d0), Err(nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED));
    let mut set = ptr::null_mut();
    assert_eq!(
        unsafe { nvmlEventSetCreate(&mut set) },
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED
    );
    f.write(TELEMETRY);
    assert_eq!(util(d0), Ok((99, 22)));
}

type Sample = (u32, u64, u32, u32, u32, u32);

/// As nvml-wrapper does it: count with a NULL buffer, then exactly that many.
fn process_util(d: nvmlDevice_t, last_seen: u64) -> Result<Vec<Sample>, nvmlReturn_t> {
    let mut count: c_uint = 0;
    let rc = unsafe { nvmlDeviceGetProcessUtilization(d, ptr::null_mut(), &mut count, last_seen) };
    if rc != INSUFFICIENT_SIZE {
        return Err(rc);
    }
    let zero = nvmlProcessUtilizationSample_t {
        pid: 0,
        timeStamp: 0,
        smUtil: 0,
        memUtil: 0,
        encUtil: 0,
        decUtil: 0,
    };
    let mut buf = vec![zero; count as usize];
    let mut n = count;
    let rc = unsafe { nvmlDeviceGetProcessUtilization(d, buf.as_mut_ptr(), &mut n, last_seen) };
    if rc != SUCCESS {
        return Err(rc);
    }
    assert_eq!(n, count);
    Ok(buf
        .iter()
        .map(|s| {
            (
                s.pid,
                s.timeStamp,
                s.smUtil,
                s.memUtil,
                s.encUtil,
                s.decUtil,
            )
        })
        .collect())
}

fn mtime_us(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).expect("stat");
    m.mtime() as u64 * 1_000_000 + m.mtime_nsec() as u64 / 1000
}

#[test]
fn process_utilization_samples_are_new_once_per_write() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let d0 = dev(0);
    let base = mtime_us(&f.path);
    let all = process_util(d0, 0).expect("samples");
    assert_eq!(
        all,
        [(436, base, 97, 21, 1, 2), (437, base + 1, 2, 0, 0, 0)],
        "timeStamp = the file's mtime in µs + index"
    );
    // Carrying the last timestamp seen, as NVML asks: only newer samples.
    assert_eq!(
        process_util(d0, base).expect("newer"),
        [(437, base + 1, 2, 0, 0, 0)]
    );
    assert_eq!(process_util(d0, base + 1), Err(NOT_FOUND));
    // A buffer that is too small: the needed count and INSUFFICIENT_SIZE.
    let mut one = [nvmlProcessUtilizationSample_t {
        pid: 0,
        timeStamp: 0,
        smUtil: 0,
        memUtil: 0,
        encUtil: 0,
        decUtil: 0,
    }];
    let mut n: c_uint = 1;
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(d0, one.as_mut_ptr(), &mut n, 0) },
        INSUFFICIENT_SIZE
    );
    assert_eq!((n, one[0].pid), (2, 0));
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(d0, one.as_mut_ptr(), ptr::null_mut(), 0) },
        INVALID_ARGUMENT
    );

    // A rewrite (even within the same mtime tick) gives fresh samples.
    f.write(&TELEMETRY.replace("{pid: 437, sm: 2}", "{pid: 437, sm: 50}"));
    let fresh = process_util(d0, base + 1).expect("fresh samples");
    assert_eq!(fresh.len(), 2);
    assert!(fresh[0].1 > base + 1 && fresh[1].1 == fresh[0].1 + 1);
    assert_eq!(fresh[1].2, 50);
    assert!(fresh[0].1 >= mtime_us(&f.path));

    // Empty list: no samples (NOT_FOUND); absent: NOT_SUPPORTED; MIG: NOT_SUPPORTED.
    let d2 = dev(2);
    assert_eq!(process_util(d2, 0), Err(NOT_FOUND));
    assert_eq!(process_util(dev(1), 0), Err(NOT_SUPPORTED));
    assert_eq!(process_util(mig(d2, 0), 0), Err(NOT_SUPPORTED));
}

#[test]
fn ecc_mode_and_counters() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let (d0, d1, d2) = (dev(0), dev(1), dev(2));
    let mode = |d| {
        let (mut cur, mut pend) = (9, 9);
        match unsafe { nvmlDeviceGetEccMode(d, &mut cur, &mut pend) } {
            SUCCESS => Ok((cur, pend)),
            code => Err(code),
        }
    };
    assert_eq!(mode(d0), Ok((1, 1)));
    assert_eq!(mode(d1), Ok((0, 1)), "pending_enabled");
    assert_eq!(mode(d2), Ok((1, 1)), "ecc: {{}} means enabled");
    let errors =
        |d, kind, counter| get(|p| unsafe { nvmlDeviceGetTotalEccErrors(d, kind, counter, p) });
    const C: nvmlMemoryErrorType_t = nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED;
    const U: nvmlMemoryErrorType_t = nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED;
    const V: nvmlEccCounterType_t = nvmlEccCounterType_enum_NVML_VOLATILE_ECC;
    const A: nvmlEccCounterType_t = nvmlEccCounterType_enum_NVML_AGGREGATE_ECC;
    assert_eq!(errors(d0, C, V), Ok(1));
    assert_eq!(errors(d0, C, A), Ok(2));
    assert_eq!(errors(d0, U, V), Ok(3));
    assert_eq!(errors(d0, U, A), Ok(4));
    assert_eq!(errors(d2, U, A), Ok(0), "counters default to 0");
    assert_eq!(errors(d1, U, V), Err(NOT_SUPPORTED), "ECC off: no counters");
    assert_eq!(errors(d0, 2, V), Err(INVALID_ARGUMENT));
    assert_eq!(errors(d0, C, 2), Err(INVALID_ARGUMENT));
    let m = mig(d2, 0);
    assert_eq!(mode(m), Err(NOT_SUPPORTED));
    assert_eq!(errors(m, C, V), Err(NOT_SUPPORTED));
    f.write("devices: [{uuid: GPU-1}]");
    assert_eq!(mode(dev(0)), Err(NOT_SUPPORTED));
    assert_eq!(errors(dev(0), C, V), Err(NOT_SUPPORTED));
    assert_eq!(
        unsafe { nvmlDeviceGetEccMode(dev(0), ptr::null_mut(), ptr::null_mut()) },
        INVALID_ARGUMENT
    );
}

#[test]
fn remapped_rows_and_retired_pages() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let (d0, d1, d2) = (dev(0), dev(1), dev(2));
    let rows = |d| {
        let (mut c, mut u, mut p, mut x) = (9, 9, 9, 9);
        match unsafe { nvmlDeviceGetRemappedRows(d, &mut c, &mut u, &mut p, &mut x) } {
            SUCCESS => Ok((c, u, p, x)),
            code => Err(code),
        }
    };
    assert_eq!(rows(d0), Ok((5, 1, 1, 0)));
    assert_eq!(rows(d2), Ok((0, 0, 0, 0)));
    assert_eq!(rows(d1), Err(NOT_SUPPORTED));
    assert_eq!(rows(mig(d2, 0)), Err(NOT_SUPPORTED));
    let mut c = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetRemappedRows(d0, &mut c, &mut c, ptr::null_mut(), ptr::null_mut()) },
        INVALID_ARGUMENT
    );

    const SBE: nvmlPageRetirementCause_t =
        nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS;
    const DBE: nvmlPageRetirementCause_t =
        nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR;
    // Count query as nvml-wrapper makes it: count 0 and a one-entry buffer.
    let mut scratch = 0u64;
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, SBE, &mut n, &mut scratch) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(n, 3);
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, SBE, &mut n, ptr::null_mut()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(n, 3);
    let (mut addrs, mut times) = ([0u64; 4], [0u64; 4]);
    let mut n: c_uint = 4;
    assert_eq!(
        unsafe {
            nvmlDeviceGetRetiredPages_v2(d0, SBE, &mut n, addrs.as_mut_ptr(), times.as_mut_ptr())
        },
        SUCCESS
    );
    assert_eq!(n, 3);
    let (addrs, times) = (&addrs[..3], &times[..3]);
    assert!(addrs.iter().all(|&a| a != 0) && addrs[0] != addrs[1] && addrs[1] != addrs[2]);
    assert!(times.iter().all(|&t| t != 0));
    let mut v1 = [0u64; 3];
    let mut n: c_uint = 3;
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, SBE, &mut n, v1.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!(v1, addrs);
    let mut n: c_uint = 2;
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, SBE, &mut n, v1.as_mut_ptr()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(n, 3);
    // No pages: SUCCESS and 0, whatever the buffer.
    let mut n: c_uint = 5;
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, DBE, &mut n, ptr::null_mut()) },
        SUCCESS
    );
    assert_eq!(n, 0);
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, 2, &mut n, &mut scratch) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d0, SBE, ptr::null_mut(), &mut scratch) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetRetiredPages(d1, SBE, &mut n, &mut scratch) },
        NOT_SUPPORTED
    );
    assert_eq!(
        unsafe {
            nvmlDeviceGetRetiredPages_v2(mig(d2, 0), SBE, &mut n, &mut scratch, &mut scratch)
        },
        NOT_SUPPORTED
    );
    let pending = |d| get(|p| unsafe { nvmlDeviceGetRetiredPagesPendingStatus(d, p) });
    assert_eq!(pending(d0), Ok(nvmlEnableState_enum_NVML_FEATURE_ENABLED));
    assert_eq!(pending(d2), Ok(nvmlEnableState_enum_NVML_FEATURE_DISABLED));
    assert_eq!(pending(d1), Err(NOT_SUPPORTED));
}

fn event_set() -> nvmlEventSet_t {
    let mut set = ptr::null_mut();
    assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, SUCCESS);
    assert!(!set.is_null());
    set
}

/// (xid, device) of the next event, or the code.
fn next_event(set: nvmlEventSet_t) -> Result<(u64, nvmlDevice_t), nvmlReturn_t> {
    let mut data = nvmlEventData_t {
        device: ptr::null_mut(),
        eventType: 0,
        eventData: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };
    match unsafe { nvmlEventSetWait_v2(set, &mut data, 0) } {
        SUCCESS => {
            assert_eq!(data.eventType, XID);
            assert_eq!((data.gpuInstanceId, data.computeInstanceId), (NO_ID, NO_ID));
            Ok((data.eventData, data.device))
        }
        code => Err(code),
    }
}

const TIMEOUT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_TIMEOUT;

#[test]
fn xid_events_are_delivered_once_per_set() {
    let f = Fixture::new(TELEMETRY);
    f.init();
    let (d0, d1, d2) = (dev(0), dev(1), dev(2));
    let supported = |d| get(|p| unsafe { nvmlDeviceGetSupportedEventTypes(d, p) });
    assert_eq!(supported(d0), Ok(0x8));
    assert_eq!(supported(d2), Ok(0x8), "xid_events: [] is supported");
    assert_eq!(supported(d1), Err(NOT_SUPPORTED));
    assert_eq!(supported(mig(d2, 0)), Err(NOT_SUPPORTED));

    let set = event_set();
    let register = |d, types, set| unsafe { nvmlDeviceRegisterEvents(d, types, set) };
    assert_eq!(register(d1, XID, set), NOT_SUPPORTED);
    assert_eq!(register(mig(d2, 0), XID, set), NOT_SUPPORTED);
    assert_eq!(
        register(d0, XID | 0x1, set),
        NOT_SUPPORTED,
        "only Xid events"
    );
    assert_eq!(register(d0, 0, set), INVALID_ARGUMENT);
    assert_eq!(register(d0, XID, ptr::null_mut()), INVALID_ARGUMENT);
    assert_eq!(
        register(d0, XID, ptr::without_provenance_mut(0x1234)),
        INVALID_ARGUMENT
    );
    // Nothing registered yet: nothing to wait for.
    assert_eq!(next_event(set), Err(TIMEOUT));
    assert_eq!(register(d0, XID, set), SUCCESS);
    assert_eq!(register(d2, XID, set), SUCCESS);
    assert_eq!(register(d0, XID, set), SUCCESS, "again: no duplicates");

    assert_eq!(next_event(set), Ok((79, d0)));
    assert_eq!(next_event(set), Ok((48, d0)));
    assert_eq!(next_event(set), Err(TIMEOUT));
    // Another set sees them all again.
    let other = event_set();
    assert_eq!(register(d0, XID, other), SUCCESS);
    assert_eq!(next_event(other), Ok((79, d0)));

    // Appending delivers only the new ones; GPU 2 gets its first.
    f.write(
        &TELEMETRY
            .replace("xid_events: [79, 48]", "xid_events: [79, 48, 94]")
            .replace("xid_events: []", "xid_events: [31]"),
    );
    assert_eq!(next_event(set), Ok((94, d0)));
    assert_eq!(next_event(set), Ok((31, d2)));
    assert_eq!(next_event(set), Err(TIMEOUT));
    assert_eq!(next_event(other), Ok((48, d0)));

    // A registered GPU that is lost: its error once nothing is pending.
    f.write(&TELEMETRY.replacen(
        "    xid_events: [79, 48]",
        "    xid_events: [79, 48, 94, 79]\n    error: gpu_lost",
        1,
    ));
    assert_eq!(next_event(set), Ok((79, d0)), "the Xid comes first");
    assert_eq!(next_event(set), Err(nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST));
    f.write(TELEMETRY);

    // An empty wait sleeps its timeout, capped.
    let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
    let start = Instant::now();
    assert_eq!(unsafe { nvmlEventSetWait_v2(set, &mut data, 30) }, TIMEOUT);
    assert!(start.elapsed() >= Duration::from_millis(30));
    let start = Instant::now();
    assert_eq!(unsafe { nvmlEventSetWait(set, &mut data, 60_000) }, TIMEOUT);
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(
        unsafe { nvmlEventSetWait_v2(set, ptr::null_mut(), 0) },
        INVALID_ARGUMENT
    );

    assert_eq!(unsafe { nvmlEventSetFree(set) }, SUCCESS);
    assert_eq!(unsafe { nvmlEventSetFree(set) }, INVALID_ARGUMENT);
    assert_eq!(next_event(set), Err(INVALID_ARGUMENT));
    // The last shutdown drops every set.
    assert_eq!(nvmlShutdown(), SUCCESS);
    f.init();
    assert_eq!(next_event(other), Err(INVALID_ARGUMENT));
}

#[test]
fn calls_are_counted_and_written_to_a_file() {
    let f = Fixture::new(TELEMETRY);
    let out = f.path.with_extension("calls");
    calls::reset_for_test(Some(out.clone()));
    f.init();
    let d0 = dev(0);
    for _ in 0..3 {
        let _ = get(|p| unsafe { nvmlDeviceGetTemperature(d0, 0, p) });
    }
    let _ = util(d0);
    // The first call wrote the file at once.
    let first = std::fs::read_to_string(&out).expect("written at the first call");
    assert_eq!(first, "nvmlInit_v2 1\n");
    assert_eq!(nvmlShutdown(), SUCCESS);
    let text = std::fs::read_to_string(&out).expect("written at shutdown");
    assert_eq!(
        text,
        "nvmlDeviceGetHandleByIndex_v2 1\n\
         nvmlDeviceGetTemperature 3\n\
         nvmlDeviceGetUtilizationRates 1\n\
         nvmlInit_v2 1\n\
         nvmlShutdown 1\n"
    );
    // Failing calls count too (here: before init).
    let _ = util(d0);
    assert_eq!(
        calls::snapshot().get("nvmlDeviceGetUtilizationRates"),
        Some(&2)
    );
    // Calls after WRITE_EVERY rewrite the file.
    std::thread::sleep(calls::WRITE_EVERY);
    let _ = util(d0);
    let text = std::fs::read_to_string(&out).expect("rewritten");
    assert!(text.contains("nvmlDeviceGetUtilizationRates 3\n"), "{text}");
    calls::reset_for_test(None);
    let _ = std::fs::remove_file(&out);
}

/// Each export counts under its own name (called before init, so every
/// argument may be NULL: nothing is dereferenced).
#[test]
fn every_export_counts_under_its_name() {
    let _f = Fixture::new("devices: []");
    calls::reset_for_test(None);
    let d = ptr::null_mut();
    let (u, ull, set) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    unsafe {
        let _ = nvmlErrorString(0);
        let _ = nvmlShutdown();
        let _ = nvmlSystemGetDriverVersion(ptr::null_mut(), 0);
        let _ = nvmlSystemGetNVMLVersion(ptr::null_mut(), 0);
        let _ = nvmlSystemGetCudaDriverVersion(ptr::null_mut());
        let _ = nvmlSystemGetCudaDriverVersion_v2(ptr::null_mut());
        let _ = nvmlDeviceGetCount_v2(u);
        let _ = nvmlDeviceGetHandleByIndex_v2(0, ptr::null_mut());
        let _ = nvmlDeviceGetHandleByUUID(ptr::null(), ptr::null_mut());
        let _ = nvmlDeviceGetIndex(d, u);
        let _ = nvmlDeviceGetName(d, ptr::null_mut(), 0);
        let _ = nvmlDeviceGetUUID(d, ptr::null_mut(), 0);
        let _ = nvmlDeviceGetPciInfo_v3(d, ptr::null_mut());
        let _ = nvmlDeviceGetMemoryInfo(d, ptr::null_mut());
        let _ = nvmlDeviceGetMemoryInfo_v2(d, ptr::null_mut());
        let _ = nvmlDeviceGetComputeRunningProcesses_v3(d, u, ptr::null_mut());
        let _ = nvmlDeviceGetGraphicsRunningProcesses_v3(d, u, ptr::null_mut());
        let _ = nvmlDeviceGetMPSComputeRunningProcesses_v3(d, u, ptr::null_mut());
        let _ = nvmlDeviceGetMigMode(d, u, u);
        let _ = nvmlDeviceGetMaxMigDeviceCount(d, u);
        let _ = nvmlDeviceGetMigDeviceHandleByIndex(d, 0, ptr::null_mut());
        let _ = nvmlDeviceIsMigDeviceHandle(d, u);
        let _ = nvmlDeviceGetGpuInstanceId(d, u);
        let _ = nvmlDeviceGetComputeInstanceId(d, u);
        let _ = nvmlDeviceGetDeviceHandleFromMigDeviceHandle(d, ptr::null_mut());
        let _ = nvmlDeviceGetUtilizationRates(d, ptr::null_mut());
        let _ = nvmlDeviceGetEncoderUtilization(d, u, u);
        let _ = nvmlDeviceGetDecoderUtilization(d, u, u);
        let _ = nvmlDeviceGetProcessUtilization(d, ptr::null_mut(), u, 0);
        let _ = nvmlDeviceGetTemperature(d, 0, u);
        let _ = nvmlDeviceGetPowerUsage(d, u);
        let _ = nvmlDeviceGetEnforcedPowerLimit(d, u);
        let _ = nvmlDeviceGetTotalEnergyConsumption(d, ull);
        let _ = nvmlDeviceGetClockInfo(d, 0, u);
        let _ = nvmlDeviceGetPerformanceState(d, u);
        let _ = nvmlDeviceGetCurrentClocksEventReasons(d, ull);
        let _ = nvmlDeviceGetCurrentClocksThrottleReasons(d, ull);
        let _ = nvmlDeviceGetEccMode(d, u, u);
        let _ = nvmlDeviceGetTotalEccErrors(d, 0, 0, ull);
        let _ = nvmlDeviceGetRemappedRows(d, u, u, u, u);
        let _ = nvmlDeviceGetRetiredPages(d, 0, u, ull);
        let _ = nvmlDeviceGetRetiredPages_v2(d, 0, u, ull, ull);
        let _ = nvmlDeviceGetRetiredPagesPendingStatus(d, u);
        let _ = nvmlEventSetCreate(ptr::null_mut());
        let _ = nvmlEventSetFree(set);
        let _ = nvmlDeviceGetSupportedEventTypes(d, ull);
        let _ = nvmlDeviceRegisterEvents(d, XID, set);
        let _ = nvmlEventSetWait_v2(set, ptr::null_mut(), 0);
        let _ = nvmlEventSetWait(set, ptr::null_mut(), 0);
    }
    let _ = nvmlInit_v2();
    let _ = nvmlInitWithFlags(0);
    let counted = calls::snapshot();
    let names = [
        "nvmlInit_v2",
        "nvmlInitWithFlags",
        "nvmlShutdown",
        "nvmlErrorString",
        "nvmlSystemGetDriverVersion",
        "nvmlSystemGetNVMLVersion",
        "nvmlSystemGetCudaDriverVersion",
        "nvmlSystemGetCudaDriverVersion_v2",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetIndex",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetEncoderUtilization",
        "nvmlDeviceGetDecoderUtilization",
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetPerformanceState",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetEccMode",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPages_v2",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlEventSetWait",
    ];
    for name in names {
        assert_eq!(counted.get(name), Some(&1), "{name}");
    }
    assert_eq!(counted.len(), names.len(), "{counted:?}");
}

// ------------------- Grace-era: unified memory, virtualization mode, GPM

const GRACE: &str = "devices:
  - uuid: GPU-6b100000-0000-0000-0000-000000000000
    name: NVIDIA GB10
    unified_memory: true
    virtualization_mode: vgpu
    gpm: {sm_util: 85.5, pcie_tx_per_sec: 1024}
    mig_devices:
      - uuid: MIG-6b100000-0000-0000-0000-000000000001
        gpu_instance_id: 3
        compute_instance_id: 0
        memory: {total: 1000, used: 1}
        gpm: {dram_bw_util: 25}
  - uuid: GPU-6b100000-0000-0000-0000-000000000001
";

#[test]
fn unified_memory_answers_not_supported_and_virtualization_the_mode() {
    let f = Fixture::new(GRACE);
    f.init();
    let mut m1 = nvmlMemory_t {
        total: 0,
        free: 0,
        used: 0,
    };
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo(dev(0), &mut m1) },
        NOT_SUPPORTED
    );
    assert_eq!(memory_v2(dev(0)).err(), Some(NOT_SUPPORTED));
    assert!(memory_v2(dev(1)).is_ok());
    let mut mode = 99;
    assert_eq!(
        unsafe { nvmlDeviceGetVirtualizationMode(dev(0), &mut mode) },
        SUCCESS
    );
    assert_eq!(
        mode,
        nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_VGPU
    );
    assert_eq!(
        unsafe { nvmlDeviceGetVirtualizationMode(dev(1), &mut mode) },
        SUCCESS
    );
    assert_eq!(
        mode,
        nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE
    );
    assert_eq!(
        unsafe { nvmlDeviceGetVirtualizationMode(dev(1), ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(nvmlShutdown(), SUCCESS);
}

fn alloc() -> nvmlGpmSample_t {
    let mut s: nvmlGpmSample_t = ptr::null_mut();
    assert_eq!(unsafe { nvmlGpmSampleAlloc(&mut s) }, SUCCESS);
    assert!(!s.is_null());
    s
}

fn metrics(
    a: nvmlGpmSample_t,
    b: nvmlGpmSample_t,
    ids: &[u32],
) -> Result<Vec<(nvmlReturn_t, f64)>, nvmlReturn_t> {
    // SAFETY: all-zero is a valid nvmlGpmMetricsGet_t (integers, NULL pointers).
    let mut req: nvmlGpmMetricsGet_t = unsafe { std::mem::zeroed() };
    req.version = NVML_GPM_METRICS_GET_VERSION;
    req.numMetrics = ids.len() as u32;
    req.sample1 = a;
    req.sample2 = b;
    for (m, id) in req.metrics.iter_mut().zip(ids) {
        m.metricId = *id;
    }
    match unsafe { nvmlGpmMetricsGet(&mut req) } {
        SUCCESS => Ok(req.metrics[..ids.len()]
            .iter()
            .map(|m| (m.nvmlReturn, m.value))
            .collect()),
        e => Err(e),
    }
}

/// The figures to 6 decimals: every other sample carries a wobble of a
/// relative 2^-40 (the module doc of gpm.rs).
fn rounded(
    r: Result<Vec<(nvmlReturn_t, f64)>, nvmlReturn_t>,
) -> Result<Vec<(nvmlReturn_t, f64)>, nvmlReturn_t> {
    r.map(|v| {
        v.into_iter()
            .map(|(c, x)| (c, (x * 1e6).round() / 1e6))
            .collect()
    })
}

#[test]
fn gpm_samples_and_metrics_follow_the_scenario() {
    let f = Fixture::new(GRACE);
    f.init();
    let mut support = nvmlGpmSupport_t {
        version: NVML_GPM_SUPPORT_VERSION,
        isSupportedDevice: 9,
    };
    assert_eq!(
        unsafe { nvmlGpmQueryDeviceSupport(dev(0), &mut support) },
        SUCCESS
    );
    assert_eq!(support.isSupportedDevice, 1);
    assert_eq!(
        unsafe { nvmlGpmQueryDeviceSupport(dev(1), &mut support) },
        SUCCESS
    );
    assert_eq!(support.isSupportedDevice, 0);
    support.version = 7;
    assert_eq!(
        unsafe { nvmlGpmQueryDeviceSupport(dev(0), &mut support) },
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    );

    let (a, b) = (alloc(), alloc());
    // Unfilled samples: INVALID_ARGUMENT.
    assert_eq!(metrics(a, b, &[2]), Err(INVALID_ARGUMENT));
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), a) }, SUCCESS);
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), b) }, SUCCESS);
    // SM util (2) and PCIe TX (20) from the scenario, FP32 (12) not in it.
    assert_eq!(
        rounded(metrics(a, b, &[2, 20, 12])),
        Ok(vec![
            (SUCCESS, 85.5),
            (SUCCESS, 1024.0),
            (NOT_SUPPORTED, 0.0)
        ])
    );
    // The second sample must be the later one.
    assert_eq!(metrics(b, a, &[2]), Err(INVALID_ARGUMENT));
    // A rewrite shows from the next sample on.
    f.write(&GRACE.replace("sm_util: 85.5", "sm_util: 10"));
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), a) }, SUCCESS);
    assert_eq!(rounded(metrics(b, a, &[2])), Ok(vec![(SUCCESS, 10.0)]));
    // GPU 1 has no GPM.
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(1), a) }, NOT_SUPPORTED);

    // MIG: by GPU instance id on the parent; unknown id INVALID_ARGUMENT;
    // a MIG sample and a GPU sample do not pair.
    let c = alloc();
    assert_eq!(unsafe { nvmlGpmMigSampleGet(dev(0), 3, b) }, SUCCESS);
    assert_eq!(unsafe { nvmlGpmMigSampleGet(dev(0), 3, c) }, SUCCESS);
    assert_eq!(rounded(metrics(b, c, &[10])), Ok(vec![(SUCCESS, 25.0)]));
    assert_eq!(
        unsafe { nvmlGpmMigSampleGet(dev(0), 4, c) },
        INVALID_ARGUMENT
    );
    assert_eq!(unsafe { nvmlGpmMigSampleGet(dev(1), 3, c) }, NOT_SUPPORTED);
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), a) }, SUCCESS);
    assert_eq!(metrics(c, a, &[2]), Err(INVALID_ARGUMENT));

    for s in [a, b, c] {
        assert_eq!(unsafe { nvmlGpmSampleFree(s) }, SUCCESS);
    }
    // Freed twice: INVALID_ARGUMENT, not a double free.
    assert_eq!(unsafe { nvmlGpmSampleFree(a) }, INVALID_ARGUMENT);
    assert_eq!(nvmlShutdown(), SUCCESS);
}

/// Two successive answers of a busy GPU differ (as on a real GPU); with
/// `gpm_stale` the samples do not advance and the same figures come back.
#[test]
fn gpm_answers_move_unless_stale() {
    let f = Fixture::new(GRACE);
    f.init();
    let (a, b) = (alloc(), alloc());
    let answer = |x, y| metrics(x, y, &[2]).map(|v| v[0].1.to_bits());
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), a) }, SUCCESS);
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), b) }, SUCCESS);
    let first = answer(a, b);
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), a) }, SUCCESS);
    let second = answer(b, a);
    assert!(first.is_ok() && first != second, "{first:?} {second:?}");
    f.write(&GRACE.replacen("gpm: {", "gpm_stale: true\n    gpm: {", 1));
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), b) }, SUCCESS);
    let stale = answer(a, b);
    assert_eq!(stale, second, "the previous figures again, no error");
    assert_eq!(unsafe { nvmlGpmSampleGet(dev(0), a) }, SUCCESS);
    assert_eq!(answer(b, a), second);
    // The same sample twice is still refused.
    assert_eq!(metrics(a, a, &[2]), Err(INVALID_ARGUMENT));
    for s in [a, b] {
        assert_eq!(unsafe { nvmlGpmSampleFree(s) }, SUCCESS);
    }
    assert_eq!(nvmlShutdown(), SUCCESS);
}

/// `used_timeline`: used memory over the process's clock, linear between
/// knots, held before the first and after the last.
#[test]
fn used_timeline_interpolates() {
    use crate::scenario::Gpu;
    let t = [(100.0, 1000), (110.0, 2000), (110.0, 500), (120.0, 500)];
    let at = |x| Gpu::used_at(&t, x);
    assert_eq!(at(0.0), Some(1000));
    assert_eq!(at(105.0), Some(1500));
    assert_eq!(at(110.0), Some(500), "a repeated time is a jump");
    assert_eq!(at(500.0), Some(500));
    assert_eq!(Gpu::used_at(&[], 1.0), None);
    let bad = "devices:\n  - uuid: GPU-6b100000-0000-0000-0000-000000000009\n    used_timeline: [[2, 1], [1, 1]]\n";
    let err = crate::scenario::parse(bad).err().unwrap_or_default();
    assert!(
        err.contains("used_timeline: times must be finite and in order"),
        "{err}"
    );
}

#[test]
fn gpm_values_are_checked() {
    let bad = GRACE.replace("sm_util: 85.5", "sm_util: 101");
    let err = crate::scenario::parse(&bad).err().unwrap();
    assert!(err.contains("devices[0].gpm.sm_util: 101"), "{err}");
}
