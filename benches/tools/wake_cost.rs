//! Where a 10 Hz memory sample's CPU goes, on a GPU host: the sampler
//! thread's work split into steps, each timed by the thread's own CPU
//! clock over many wakeups at the exporter's default 100 ms spacing.
//!
//!     cargo build --release --example wake_cost
//!     target/release/examples/wake_cost [wakeups per phase] [path/to/libnvidia-ml.so.1]
//!
//! Phases, each `wakeups` steps long (default 100, so 10 s each at the
//! exporter's 100 ms spacing):
//! - the ways to wait alone: `std::thread::sleep`, `recv_timeout` (how the
//!   sampler thread waits), `clock_nanosleep` to an absolute deadline, a
//!   periodic `timerfd`, and a `timerfd` polled with an `eventfd`; the
//!   first two again with a 5 ms timer slack;
//! - after a `recv_timeout` wait: one `memory_info` per GPU through the
//!   production `NvmlSource`, the sampler's memory-only sample, and that
//!   sample published as the sampler thread does (history, forecasts, the
//!   `Arc` swap);
//! - the driver alone: `nvmlDeviceGetMemoryInfo_v2` (with its wall time)
//!   and v1, v2 at 1, 10, 50 and 250 ms spacing (how the cost of a call
//!   grows with the time since the last), the compute process list, and
//!   the wait and memory read with the thread pinned to CPU 0;
//! - the same steps back to back without waiting (the hot cost).
//!
//! Prints one line per phase: CPU µs per step (the thread's CPU clock,
//! which counts this thread's user and kernel time).
//!
//!     target/release/examples/wake_cost interleave [steps per kind] [lib]
//!
//! runs instead seven kinds of step in turn (`recv_timeout` or
//! `park_timeout`, with or without a 1 ms timer slack, alone or with a
//! memory-only sample published always or only when it changed), so a
//! change in the host's load falls on every kind alike; mean, median and
//! p90 per kind.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a measurement: a panic is the failure report

use std::sync::Arc;
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

use gpumem_exporter::testing::attribute::ProcCache;
use gpumem_exporter::testing::attribute::procfs::ProcRoot;
use gpumem_exporter::testing::config::{SamplerConfig, Timing};
use gpumem_exporter::testing::gpu::{GpuSource, NvmlSource};
use gpumem_exporter::testing::publish::{Shared, Telemetry};
use gpumem_exporter::testing::sample::Sampler;

const SPACING: Duration = Duration::from_millis(100);

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer for clock_gettime.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// How a phase waits between steps.
#[derive(Clone, Copy, PartialEq)]
enum Wait {
    /// Back to back: the hot cost of a step.
    None,
    /// `std::thread::sleep` (relative `nanosleep`).
    Sleep,
    /// `mpsc::Receiver::recv_timeout`, as the sampler thread waits today.
    RecvTimeout,
    /// `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)` to the next
    /// deadline.
    AbsoluteSleep,
    /// `std::thread::park_timeout` to the next deadline (how the sampler
    /// thread waits now: its control channel's sender unparks it).
    Park,
    /// A periodic `timerfd` (the kernel re-arms it), read blocking.
    TimerFd,
    /// A periodic `timerfd` and an `eventfd` for control, `poll`ed.
    TimerFdPoll,
}

fn timerfd(spacing: Duration) -> libc::c_int {
    // SAFETY: plain syscalls on values we own; results checked.
    unsafe {
        let fd = libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC);
        assert!(fd >= 0, "timerfd_create");
        let ts = libc::timespec {
            tv_sec: spacing.as_secs() as libc::time_t,
            tv_nsec: spacing.subsec_nanos() as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: ts,
            it_value: ts,
        };
        assert_eq!(libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut()), 0);
        fd
    }
}

fn now_monotonic() -> libc::timespec {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts
}

fn add(ts: libc::timespec, d: Duration) -> libc::timespec {
    let ns = ts.tv_nsec as u64 + u64::from(d.subsec_nanos());
    libc::timespec {
        tv_sec: ts.tv_sec + d.as_secs() as libc::time_t + (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// How an interleaved step waits (100 ms from its start) and what it does
/// after.
#[derive(Clone, Copy)]
enum Step {
    Recv,
    Park,
    ParkSlack,
    RecvPublish,
    ParkPublish,
    ParkPublishIfChanged,
    ParkSlackPublishIfChanged,
}

/// Wait 100 ms by `recv_timeout` or `park_timeout` (with or without a
/// 1 ms timer slack), then do the step's work.
fn interleaved_step(
    step: Step,
    rx: &std::sync::mpsc::Receiver<()>,
    sampler: &mut Sampler<NvmlSource, ProcCache>,
    shared: &Shared,
) {
    let slack = matches!(step, Step::ParkSlack | Step::ParkSlackPublishIfChanged);
    // SAFETY: prctl with an integer argument (0: the default slack).
    unsafe {
        libc::prctl(
            libc::PR_SET_TIMERSLACK,
            if slack { 1_000_000u64 } else { 0 },
        )
    };
    match step {
        Step::Recv | Step::RecvPublish => match rx.recv_timeout(SPACING) {
            Err(RecvTimeoutError::Timeout) => {}
            other => panic!("channel: {other:?}"),
        },
        _ => {
            let until = std::time::Instant::now() + SPACING;
            while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
                if left.is_zero() {
                    break;
                }
                std::thread::park_timeout(left);
            }
        }
    }
    match step {
        Step::Recv | Step::Park | Step::ParkSlack => {}
        Step::RecvPublish | Step::ParkPublish => shared.publish(sampler.tick_memory()),
        Step::ParkPublishIfChanged | Step::ParkSlackPublishIfChanged => {
            if let Some(s) = sampler.tick_memory_if_changed() {
                shared.publish(s);
            }
        }
    }
}

/// The ways of waiting and sampling side by side: step i is kind
/// i mod 7, each timed by the thread's CPU clock (wait and work), so a
/// change in the host's load falls on every kind alike. `n` steps a kind.
fn interleaved(n: u32, sampler: &mut Sampler<NvmlSource, ProcCache>, shared: &Shared) {
    let kinds = [
        ("recv_timeout", Step::Recv),
        ("park_timeout", Step::Park),
        ("park_timeout, 1 ms slack", Step::ParkSlack),
        ("recv+tick_memory+publish", Step::RecvPublish),
        ("park+tick_memory+publish", Step::ParkPublish),
        ("park+if_changed+publish", Step::ParkPublishIfChanged),
        (
            "park+if_changed+publish, 1 ms slack",
            Step::ParkSlackPublishIfChanged,
        ),
    ];
    let (_tx, rx) = channel::<()>();
    let mut spent = vec![Vec::with_capacity(n as usize); kinds.len()];
    for i in 0..n as usize * kinds.len() {
        let k = i % kinds.len();
        let before = thread_cpu();
        interleaved_step(kinds[k].1, &rx, sampler, shared);
        spent[k].push((thread_cpu() - before).as_secs_f64() * 1e6);
    }
    println!("wake_cost interleaved: {n} steps a kind, 100 ms apart, CPU µs a step");
    println!("{:<40} {:>8} {:>8} {:>8}", "kind", "mean", "median", "p90");
    for ((name, _), mut v) in kinds.iter().zip(spent) {
        v.sort_by(f64::total_cmp);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "{name:<40} {mean:>8.1} {:>8.1} {:>8.1}",
            v[v.len() / 2],
            v[v.len() * 9 / 10]
        );
    }
}

/// CPU µs per step over `n` steps, waiting `wait` (`spacing` apart)
/// before each.
fn phase(name: &str, n: u32, wait: Wait, step: impl FnMut()) {
    phase_at(name, n, wait, SPACING, step);
}

/// [`phase`] with another spacing.
fn phase_at(name: &str, n: u32, wait: Wait, spacing: Duration, mut step: impl FnMut()) {
    let (_tx, rx) = channel::<()>();
    let tfd = matches!(wait, Wait::TimerFd | Wait::TimerFdPoll).then(|| timerfd(spacing));
    // SAFETY: eventfd with valid flags; checked.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(efd >= 0);
    let mut deadline = add(now_monotonic(), spacing);
    let before = thread_cpu();
    let wall = std::time::Instant::now();
    for i in 0..n {
        match wait {
            Wait::None => {}
            Wait::Sleep => std::thread::sleep(spacing),
            Wait::RecvTimeout => match rx.recv_timeout(spacing) {
                Err(RecvTimeoutError::Timeout) => {}
                other => panic!("channel: {other:?}"),
            },
            Wait::Park => {
                let until = wall + spacing * (i + 1);
                while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
                    if left.is_zero() {
                        break;
                    }
                    std::thread::park_timeout(left);
                }
            }
            Wait::AbsoluteSleep => {
                // SAFETY: valid pointers; EINTR is not expected here.
                unsafe {
                    libc::clock_nanosleep(
                        libc::CLOCK_MONOTONIC,
                        libc::TIMER_ABSTIME,
                        &deadline,
                        std::ptr::null_mut(),
                    )
                };
                deadline = add(deadline, spacing);
            }
            Wait::TimerFd => {
                let mut expirations = 0u64;
                // SAFETY: reading 8 bytes into a u64 from our timerfd.
                let r = unsafe {
                    libc::read(tfd.unwrap_or(-1), (&mut expirations as *mut u64).cast(), 8)
                };
                assert_eq!(r, 8, "timerfd read");
            }
            Wait::TimerFdPoll => {
                let mut fds = [
                    libc::pollfd {
                        fd: tfd.unwrap_or(-1),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: efd,
                        events: libc::POLLIN,
                        revents: 0,
                    },
                ];
                // SAFETY: two valid pollfds.
                let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                assert_eq!(r, 1, "poll");
                let mut expirations = 0u64;
                // SAFETY: as above.
                let r = unsafe {
                    libc::read(tfd.unwrap_or(-1), (&mut expirations as *mut u64).cast(), 8)
                };
                assert_eq!(r, 8, "timerfd read");
            }
        }
        step();
    }
    let spent = thread_cpu() - before;
    let wall = wall.elapsed();
    if let Some(fd) = tfd {
        // SAFETY: our fd.
        unsafe { libc::close(fd) };
    }
    // SAFETY: our fd.
    unsafe { libc::close(efd) };
    println!(
        "{name:<36} {:>9.1} us CPU per wakeup ({n} steps in {:.1} s)",
        spent.as_secs_f64() * 1e6 / f64::from(n),
        wall.as_secs_f64()
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut first = args.next();
    let interleave = first.as_deref() == Some("interleave");
    if interleave {
        first = args.next();
    }
    let n: u32 = first.map_or(100, |s| s.parse().expect("wakeups"));
    let lib = args.next();
    let timing = Timing {
        sample_interval: Duration::from_secs(1),
        memory_sample_interval: SPACING,
        peak_window: Duration::from_secs(30),
        mig_rescan_interval: Duration::from_secs(10),
        limits_interval: Duration::from_secs(10),
    };
    let config = SamplerConfig {
        timing,
        selection: Default::default(),
        collectors: Default::default(),
        procfs: "/proc".into(),
        cgroupfs: "/sys/fs/cgroup".into(),
    };
    let mut raw = NvmlSource::open(lib.as_deref()).expect("open NVML");
    let gpus = raw.device_count();
    let gpu = NvmlSource::open(lib.as_deref()).expect("open NVML");
    let mut sampler = Sampler::new(gpu, ProcCache::new(ProcRoot::default()), config);
    let shared = Arc::new(Shared::new(
        timing.sample_interval,
        Arc::new(Telemetry::default()),
    ));
    // A full tick first, as the exporter does, and a few seconds of
    // history so the forecast has points to fit.
    shared.publish(sampler.tick());
    for i in 0..gpus {
        raw.identify(i).expect("identify");
    }
    if interleave {
        return interleaved(n, &mut sampler, &shared);
    }
    println!("wake_cost: {gpus} GPU(s), {n} wakeups per phase");
    for (name, wait) in [
        ("sleep", Wait::Sleep),
        ("recv_timeout", Wait::RecvTimeout),
        ("park_timeout", Wait::Park),
        ("clock_nanosleep abs", Wait::AbsoluteSleep),
        ("timerfd read", Wait::TimerFd),
        ("timerfd+eventfd poll", Wait::TimerFdPoll),
    ] {
        phase(name, n, wait, || {});
    }
    // SAFETY: prctl with an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 5_000_000u64) };
    phase("recv_timeout, 5 ms slack", n, Wait::RecvTimeout, || {});
    phase("timerfd read, 5 ms slack", n, Wait::TimerFd, || {});
    phase("park_timeout, 5 ms slack", n, Wait::Park, || {});
    // SAFETY: prctl with an integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000_000u64) };
    phase("recv_timeout, 1 ms slack", n, Wait::RecvTimeout, || {});
    phase("park_timeout, 1 ms slack", n, Wait::Park, || {});
    phase(
        "park+tick_memory_if_changed+publish, 1 ms slack",
        n,
        Wait::Park,
        || {
            if let Some(s) = sampler.tick_memory_if_changed() {
                shared.publish(s);
            }
        },
    );
    // SAFETY: back to the default slack (0 means the thread's default).
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 0u64) };
    phase("recv+memory_info", n, Wait::RecvTimeout, || {
        for i in 0..gpus {
            std::hint::black_box(raw.memory(i).expect("memory"));
        }
    });
    phase("recv+tick_memory", n, Wait::RecvTimeout, || {
        std::hint::black_box(sampler.tick_memory());
    });
    phase("recv+tick_memory+publish", n, Wait::RecvTimeout, || {
        shared.publish(sampler.tick_memory());
    });
    phase("timerfd+tick_memory+publish", n, Wait::TimerFd, || {
        shared.publish(sampler.tick_memory());
    });
    phase("park+tick_memory+publish", n, Wait::Park, || {
        shared.publish(sampler.tick_memory());
    });
    phase("park+tick_memory_if_changed+publish", n, Wait::Park, || {
        if let Some(s) = sampler.tick_memory_if_changed() {
            shared.publish(s);
        }
    });
    // The driver's side: one memory read by itself, through nvml-wrapper.
    let nvml = match lib.as_deref() {
        Some(l) => nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new(l))
            .init(),
        None => nvml_wrapper::Nvml::init(),
    }
    .expect("open NVML");
    let dev = nvml.device_by_index(0).expect("GPU 0");
    let v1 = nvml.lib().nvmlDeviceGetMemoryInfo.as_ref().ok().copied();
    // SAFETY: the handle stays valid while `nvml` lives.
    let handle = unsafe { dev.handle() };
    let mut wall = Duration::ZERO;
    phase(
        "recv+memory_info v2 (wall below)",
        n,
        Wait::RecvTimeout,
        || {
            let t = std::time::Instant::now();
            std::hint::black_box(dev.memory_info().expect("memory v2"));
            wall += t.elapsed();
        },
    );
    println!(
        "{:<36} {:>9.1} us wall per call",
        "  memory_info v2",
        wall.as_secs_f64() * 1e6 / f64::from(n)
    );
    if let Some(v1) = v1 {
        /// `nvmlMemory_t` (v1): total, free, used.
        #[repr(C)]
        #[derive(Debug, Default)]
        struct MemoryV1 {
            total: u64,
            free: u64,
            used: u64,
        }
        type V1 = unsafe extern "C" fn(*mut libc::c_void, *mut MemoryV1) -> libc::c_int;
        // SAFETY: the same C signature, with the struct spelled out here.
        let v1: V1 = unsafe { std::mem::transmute(v1) };
        let handle = handle.cast::<libc::c_void>();
        phase("recv+memory_info v1", n, Wait::RecvTimeout, || {
            let mut m = MemoryV1::default();
            // SAFETY: a valid handle and out-pointer.
            let rc = unsafe { v1(handle, &mut m) };
            assert_eq!(rc, 0, "nvmlDeviceGetMemoryInfo");
            std::hint::black_box(m);
        });
    }
    for ms in [1u64, 10, 50, 250] {
        phase_at(
            &format!("recv+memory_info v2, {ms} ms apart"),
            n,
            Wait::RecvTimeout,
            Duration::from_millis(ms),
            || {
                std::hint::black_box(dev.memory_info().expect("memory v2"));
            },
        );
    }
    phase(
        "recv+running_compute_processes",
        n,
        Wait::RecvTimeout,
        || {
            std::hint::black_box(dev.running_compute_processes().expect("processes"));
        },
    );
    // SAFETY: a cpu_set_t of our own, pinned to CPU 0.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    phase("pinned: recv_timeout", n, Wait::RecvTimeout, || {});
    phase("pinned: recv+memory_info v2", n, Wait::RecvTimeout, || {
        std::hint::black_box(dev.memory_info().expect("memory v2"));
    });
    let hot = n * 20;
    phase("hot memory_info", hot, Wait::None, || {
        for i in 0..gpus {
            std::hint::black_box(raw.memory(i).expect("memory"));
        }
    });
    phase("hot tick_memory", hot, Wait::None, || {
        std::hint::black_box(sampler.tick_memory());
    });
    phase("hot tick_memory+publish", hot, Wait::None, || {
        shared.publish(sampler.tick_memory());
    });
}
