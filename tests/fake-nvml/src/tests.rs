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
        );
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
    let s = scenario::parse(include_str!("../scenarios/mig.yaml")).expect("mig.yaml");
    assert_eq!(s.gpus[0].migs.len(), 2);
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
