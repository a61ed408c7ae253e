//! Per-step figures end to end: real Python processes run the bridge with
//! the stub torch, take optimizer steps (the stub's `torch.optim`, whose
//! `step()` calls the global post-hooks as torch does) and allocate on the
//! stub device; the exporter reads the step ring from /proc and exports
//! steps, allocated at the last step, and the growth per step.

use super::*;

const MIB: u64 = 1 << 20;
/// allocated in the stub's state file, before any step allocates.
const BASE: u64 = 5_000_000_007;

/// A bridge process on the stub's device 0 that takes `steps` optimizer
/// steps, allocating `keep` bytes per step that it keeps and `churn` bytes
/// that it frees again within the step (a sawtooth), then waits.
fn stepping(state: &StubState, steps: u32, keep: u64, churn: u64) -> Py {
    Py::bridge(
        state,
        &format!(
            "opt = torch.optim.SGD([], lr=0.1)\n\
             for _ in range({steps}):\n\
             \x20   torch.cuda.stub_allocate(0, {keep} + {churn})\n\
             \x20   torch.cuda.stub_free(0, {churn})\n\
             \x20   opt.step()\n\
             gpumem_bridge.publish_now()\n"
        ),
    )
}

/// The value of the one series of `name` for `pid` on GPU 0 (its other
/// labels are those of gpu_process_memory_used_bytes).
fn of_pid(m: &Metrics, name: &str, pid: &str) -> Option<f64> {
    match m.find(name, &[("gpu", "0"), ("pid", pid)]).as_slice() {
        [(_, v)] => Some(*v),
        _ => None,
    }
}

fn step_figures(m: &Metrics, pid: &str) -> (Option<u64>, Option<u64>, Option<f64>) {
    let int = |name| of_pid(m, name, pid).map(|v| v as u64);
    (
        int("gpu_process_torch_steps_total"),
        int("gpu_process_torch_step_allocated_bytes"),
        of_pid(m, "gpu_process_torch_step_allocated_growth_bytes", pid),
    )
}

#[test]
fn growth_per_step_is_exact_for_a_leak_zero_for_a_steady_loop_and_absent_under_16_steps() {
    let state = StubState::new(&[(U0, Figures(BASE).stats())]);
    let leak = stepping(&state, 70, 3 * MIB, 0);
    let steady = stepping(&state, 70, 0, 3 * MIB);
    let few = stepping(&state, 15, 3 * MIB, 0);
    let procs = [leak.pid, steady.pid, few.pid].map(|p| (p, 1 << 30));
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &procs)]));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "step figures of the three processes", || {
        let m = ex.metrics();
        (step_figures(&m, &leak.pid_str()).0 == Some(70)
            && step_figures(&m, &steady.pid_str()).0 == Some(70)
            && step_figures(&m, &few.pid_str()).0 == Some(15))
        .then_some(m)
    });
    assert_eq!(
        step_figures(&m, &leak.pid_str()),
        (Some(70), Some(BASE + 70 * 3 * MIB), Some((3 * MIB) as f64)),
        "a loop keeping 3 MiB a step grows exactly 3 MiB per step:\n{}",
        m.text
    );
    assert_eq!(
        step_figures(&m, &steady.pid_str()),
        (Some(70), Some(BASE), Some(0.0)),
        "a loop freeing what it allocates within the step does not grow"
    );
    assert_eq!(
        step_figures(&m, &few.pid_str()),
        (Some(15), Some(BASE + 15 * 3 * MIB), None),
        "no growth figure under 16 steps"
    );
    // Same labels as gpu_process_memory_used_bytes.
    let used = m.find("gpu_process_memory_used_bytes", &[("pid", &leak.pid_str())]);
    let growth = m.find(
        "gpu_process_torch_step_allocated_growth_bytes",
        &[("pid", &leak.pid_str())],
    );
    assert_eq!(growth.len(), 1);
    assert_eq!(growth[0].0, used[0].0);
    assert_promtool_check_metrics_clean(&m.text);

    // The JSON snapshot says the same, with the window and the pace.
    let r = ex.get("/api/v1/snapshot");
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("snapshot JSON");
    let procs = v["gpus"][0]["processes"].as_array().expect("processes");
    let of = |pid: u32| {
        procs
            .iter()
            .find(|p| p["pid"] == json!(pid))
            .map(|p| p["torch"]["steps"].clone())
            .unwrap_or_default()
    };
    let s = of(leak.pid);
    assert_eq!(s["total"], json!(70));
    assert_eq!(s["window_steps"], json!(64));
    assert_eq!(s["growth_bytes_per_step"], json!(3.0 * MIB as f64));
    assert_eq!(s["allocated_bytes"], json!(BASE + 70 * 3 * MIB));
    assert_eq!(of(few.pid)["growth_bytes_per_step"], json!(null));
    assert_eq!(of(few.pid)["window_steps"], json!(15));
}

#[test]
fn a_bridge_without_steps_and_a_document_from_a_later_bridge_interoperate() {
    // An older bridge: a v1 document without `steps` or `threshold`.
    let old = Figures(6_000_000_013);
    let doc = json!({"v": 1, "seq": 3, "devices": [old.entry(&gpu(U0))]});
    let (before, _d1) = Py::raw(doc.to_string().as_bytes(), true);
    // A later bridge: fields this exporter does not know, at every level.
    let later = Figures(7_000_000_017);
    let mut e = later.entry(&gpu(U0));
    e["steps"] = json!({"total": 20, "ring": (1..=20).map(|i| json!([i, 1000.0 + i as f64, 1000 + 10 * i])).collect::<Vec<_>>(), "future": {"x": 1}});
    e["threshold"] = json!({"bytes": 1000, "crossings": 2, "above": false, "hysteresis": 0.95});
    e["something_new"] = json!([1, 2, 3]);
    let doc = json!({"v": 1, "seq": 9, "devices": [e], "later": true});
    let (after, _d2) = Py::raw(doc.to_string().as_bytes(), true);
    let scenario = Scenario::new(&scenario_yaml(&[(
        U0,
        &[(before.pid, 1 << 30), (after.pid, 1 << 30)],
    )]));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "both processes' torch figures", || {
        let m = ex.metrics();
        (exported(&m, "0", &before.pid_str()) == Some(old.values())
            && exported(&m, "0", &after.pid_str()) == Some(later.values()))
        .then_some(m)
    });
    assert_eq!(
        step_figures(&m, &before.pid_str()),
        (None, None, None),
        "no step series without steps"
    );
    assert_eq!(
        step_figures(&m, &after.pid_str()),
        (Some(20), Some(1200), Some(10.0)),
        "{}",
        m.text
    );
    let pid = after.pid_str();
    assert_eq!(
        of_pid(&m, "gpu_process_torch_threshold_crossings_total", &pid),
        Some(2.0)
    );
    assert_eq!(
        of_pid(&m, "gpu_process_torch_threshold_bytes", &pid),
        Some(1000.0)
    );
    assert_eq!(dropped(&m, "malformed"), 0, "{}", m.text);
}

#[test]
fn a_broken_step_ring_drops_the_document() {
    let f = Figures(8_000_000_009);
    let mut e = f.entry(&gpu(U0));
    // Steps going backwards.
    e["steps"] = json!({"total": 3, "ring": [[3, 1.0, 10], [2, 2.0, 20], [4, 3.0, 30]]});
    let doc = json!({"v": 1, "devices": [e]});
    let (p, _d) = Py::raw(doc.to_string().as_bytes(), true);
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[(p.pid, 1 << 30)])]));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "the document dropped", || {
        let m = ex.metrics();
        (dropped(&m, "malformed") >= 1).then_some(m)
    });
    assert_eq!(torch_series_of(&m, &p.pid_str()), 0, "{}", m.text);
}

#[test]
fn the_threshold_warns_once_per_crossing_and_is_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("stderr");
    // total_memory 150754820096 in the stub: 0.1 of it is 15075482009(.6);
    // reserved starts at BASE + 1 GiB (about 6.07 GB) and three steps of
    // 4 GiB cross it once (at the third); freeing and emptying the cache
    // (below 95 %) re-arms, and a second rise crosses again.
    let state = StubState::new(&[(U0, Figures(BASE).stats())]);
    let p = Py::bridge_to(
        &state,
        "import warnings\n\
         warnings.simplefilter('default')\n\
         calls = []\n\
         gpumem_bridge.on_threshold(lambda info: calls.append(info))\n\
         opt = torch.optim.SGD([], lr=0.1)\n\
         for gib in (4, 4, 4):\n\
         \x20   torch.cuda.stub_allocate(0, gib << 30)\n\
         \x20   opt.step()\n\
         torch.cuda.stub_free(0, 12 << 30)\n\
         torch.cuda.empty_cache()\n\
         opt.step()\n\
         torch.cuda.stub_allocate(0, 12 << 30)\n\
         opt.step()\n\
         gpumem_bridge.publish_now()\n\
         print('callbacks', len(calls), file=sys.stderr, flush=True)\n",
        &[("GPUMEM_BRIDGE_WARN_AT", "0.1")],
        &log,
    );
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[(p.pid, 1 << 30)])]));
    let ex = start(&scenario, "");
    let pid = p.pid_str();
    let m = wait_for(WAIT, "two crossings counted", || {
        let m = ex.metrics();
        (of_pid(&m, "gpu_process_torch_threshold_crossings_total", &pid) == Some(2.0)).then_some(m)
    });
    assert_eq!(
        of_pid(&m, "gpu_process_torch_threshold_bytes", &pid),
        Some(15_075_482_009.0),
        "{}",
        m.text
    );
    let err = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        err.matches("GpuMemoryThresholdWarning").count(),
        2,
        "one warning per crossing:\n{err}"
    );
    assert!(err.contains("callbacks 2"), "{err}");
}
