//! Leaving out labels with an empty value changes no PromQL answer. The
//! scenario of the `prometheus` test (its world, reused from there) is
//! scraped by two real Prometheus servers at once, with the same rules:
//!
//! - `lean` scrapes the exporters as they serve now: no label with an
//!   empty value;
//! - `padded` scrapes them through a proxy that puts back, with an empty
//!   value, every label the exporter wrote before it left empty ones out
//!   ([`with_empty_labels`]: byte for byte the old encoder's output), and
//!   gives each target the `instance` of the exporter behind it.
//!
//! Then every query of every dashboard panel (variables at "All" and at a
//! selection), every rule expression (now, and `STALE_AHEAD_S` ahead), and
//! the whole set of exporter series (`{__name__=~"gpu_.+|gpumem_.+"}`) must
//! answer the same series, label set for label set, from both servers, and
//! every panel must have data on both (so the comparison is not between two
//! empty answers).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::harness::empty_label_lines;
use crate::harness::prom::{
    Prometheus, QueryResult, config_with_rules, grafana_regex, grafana_substitute,
    prometheus_binary,
};
use crate::harness::*;
use crate::prometheus::{RATE_INTERVAL, STALE_AHEAD_S, World, dashboard_queries, rules};

/// The labels each family carried before empty ones were left out, in the
/// order the encoder writes them, for the families where one could be
/// empty. A family (or sample name) not listed here never had an empty
/// label.
const PROCESS: &[&str] = &[
    "gpu",
    "uuid",
    "pid",
    "process",
    "namespace",
    "pod",
    "container",
    "gpu_instance_id",
    "compute_instance_id",
];

fn labels_before(sample: &str) -> Option<&'static [&'static str]> {
    Some(match sample {
        "gpu_info" => &["gpu", "uuid", "name", "pci_bus_id"],
        "gpu_process_info" => &[
            "gpu",
            "uuid",
            "pid",
            "process",
            "user",
            "container_id",
            "pod_uid",
        ],
        "gpu_mig_info" => &[
            "gpu",
            "uuid",
            "mig_uuid",
            "name",
            "gpu_instance_id",
            "compute_instance_id",
        ],
        "gpu_driver_info" => &["driver_version", "nvml_version", "cuda_driver_version"],
        s if s.starts_with("gpu_process_memory_") || s.starts_with("gpu_process_torch_") => PROCESS,
        _ => return None,
    })
}

/// `name{k="v",...}` of a sample line split into the name, the labels
/// (values as written, escapes kept) and what follows the label set.
fn split_sample(line: &str) -> (&str, Vec<(&str, &str)>, &str) {
    let Some(open) = line.find('{') else {
        let end = line.find(' ').unwrap_or(line.len());
        return (&line[..end], Vec::new(), &line[end..]);
    };
    let (name, bytes) = (&line[..open], line.as_bytes());
    let mut labels = Vec::new();
    let mut i = open + 1;
    while i < bytes.len() && bytes[i] != b'}' {
        let eq = i + line[i..].find('=').expect("label without =");
        let start = eq + 2; // after `="`
        let mut j = start;
        while bytes[j] != b'"' {
            j += if bytes[j] == b'\\' { 2 } else { 1 };
        }
        labels.push((&line[i..eq], &line[start..j]));
        i = j + 1;
        if bytes.get(i) == Some(&b',') {
            i += 1;
        }
    }
    (name, labels, &line[i + 1..])
}

/// The exposition (text or OpenMetrics) with every label of
/// [`labels_before`] that a series lacks put back with an empty value, in
/// the encoder's order; labels outside that list (`cmdline`) follow.
pub fn with_empty_labels(body: &str) -> String {
    let mut out = String::with_capacity(body.len() * 2);
    for line in body.lines() {
        let padded = (!line.starts_with('#'))
            .then(|| split_sample(line))
            .and_then(|(name, labels, rest)| {
                let before = labels_before(name)?;
                let value = |k: &str| labels.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
                let mut all: Vec<String> = before
                    .iter()
                    .map(|k| format!("{k}=\"{}\"", value(k).unwrap_or("")))
                    .collect();
                all.extend(
                    labels
                        .iter()
                        .filter(|(k, _)| !before.contains(k))
                        .map(|(k, v)| format!("{k}=\"{v}\"")),
                );
                Some(format!("{name}{{{}}}{rest}", all.join(",")))
            });
        out.push_str(padded.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// A loopback proxy in front of `upstream`'s `/metrics`: each request is
/// forwarded with its `Accept` header (so Prometheus gets the format it
/// asked for), and the answer's body goes back through
/// [`with_empty_labels`]. One connection at a time, closed after the answer.
fn padding_proxy(upstream: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = serve_padded(&mut conn, upstream);
        }
    });
    addr
}

fn serve_padded(conn: &mut TcpStream, upstream: SocketAddr) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte)? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    let accept = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("accept"))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    let r = http_get(upstream, "/metrics", &[("Accept", &accept)]);
    let body = with_empty_labels(&r.body);
    let ctype = r.header("content-type").unwrap_or("text/plain").to_string();
    write!(
        conn,
        "HTTP/1.1 {} OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        r.status,
        body.len()
    )?;
    conn.flush()
}

/// The label sets of an answer, sorted: what "the same series" compares.
fn series(q: &QueryResult) -> Vec<String> {
    let mut out: Vec<String> = q
        .labels()
        .into_iter()
        .map(|l| serde_json::Value::Object(l).to_string())
        .collect();
    out.sort();
    out
}

/// The first difference between the two answers, if any.
fn difference(lean: &QueryResult, padded: &QueryResult) -> Option<String> {
    let (a, b) = (series(lean), series(padded));
    if a == b {
        return None;
    }
    let only = |x: &[String], y: &[String]| -> Vec<String> {
        x.iter().filter(|s| !y.contains(s)).cloned().collect()
    };
    Some(format!(
        "{} series lean, {} padded; only lean: {:?}; only padded: {:?}",
        a.len(),
        b.len(),
        only(&a, &b),
        only(&b, &a)
    ))
}

/// (what, expression, evaluation time) of every comparison: each panel
/// query at "All" and at a selection, each rule now and ahead, every
/// exporter series.
fn comparisons(main: &str) -> Vec<(String, String, Option<f64>)> {
    let all = [
        ("instance", ".*".to_string()),
        ("gpu", ".*".to_string()),
        ("namespace", ".*".to_string()),
        ("pod", ".*".to_string()),
        ("slurm_job", ".*".to_string()),
        ("__rate_interval", RATE_INTERVAL.to_string()),
    ];
    let selected = [
        ("instance", grafana_regex(&[main])),
        ("gpu", grafana_regex(&["0", "1"])),
        ("namespace", grafana_regex(&["team-a"])),
        ("pod", grafana_regex(&["trainer-0", "notebook"])),
        ("slurm_job", grafana_regex(&["4242"])),
        ("__rate_interval", RATE_INTERVAL.to_string()),
    ];
    let mut out = Vec::new();
    for (title, ref_id, expr) in dashboard_queries() {
        for (pass, vars) in [("all", &all), ("sel", &selected)] {
            let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
            out.push((
                format!("panel {title} [{ref_id}] ({pass})"),
                grafana_substitute(&expr, &vars),
                None,
            ));
        }
    }
    let now = unix_now();
    for rule in rules() {
        let name = rule.alert.or(rule.record).unwrap_or_default();
        out.push((format!("rule {name}"), rule.expr.clone(), Some(now)));
        out.push((
            format!("rule {name} ({STALE_AHEAD_S} s ahead)"),
            rule.expr,
            Some(now + STALE_AHEAD_S),
        ));
    }
    out.push((
        "every exporter series".into(),
        "{__name__=~\"gpu_.+|gpumem_.+\"}".into(),
        None,
    ));
    out
}

fn prometheus_config(targets: &[(String, String)]) -> String {
    let addrs: Vec<[String; 1]> = targets.iter().map(|(addr, _)| [addr.clone()]).collect();
    let groups: Vec<(&[String], Option<&str>)> = addrs
        .iter()
        .zip(targets)
        .map(|(a, (_, instance))| (&a[..], Some(instance.as_str())))
        .collect();
    config_with_rules(&groups)
}

fn query(prom: &Prometheus, expr: &str, at: Option<f64>) -> QueryResult {
    let q = match at {
        Some(t) => prom.query_at(expr, t),
        None => prom.query(expr),
    };
    assert!(q.ok(), "Prometheus rejects\n    {expr}\n{:?}", q.error);
    q
}

#[test]
fn every_query_answers_the_same_series_with_and_without_empty_labels() {
    prometheus_binary();
    // The world of the `prometheus` test: a hung exporter, the main one
    // on a fake node with pods, MIG, a torch process, a lost GPU.
    let world = World::start();
    let (stale, main) = (&world.stale, &world.main);

    // The padding is real: the exporter writes no empty label, the proxy
    // puts them back wherever the old encoder wrote one.
    let lean = main.get("/metrics").body;
    assert_eq!(empty_label_lines(&lean), Vec::<&str>::new());
    let padded = empty_label_lines(&with_empty_labels(&lean)).len();
    assert!(
        padded >= 5,
        "only {padded} series with empty labels put back"
    );

    let down_socket = TcpListener::bind("127.0.0.1:0").unwrap();
    let (main_addr, stale_addr, down) = (
        main.addr.to_string(),
        stale.addr.to_string(),
        down_socket.local_addr().unwrap().to_string(),
    );
    let direct = [
        (main_addr.clone(), main_addr.clone()),
        (stale_addr.clone(), stale_addr.clone()),
        (down.clone(), down.clone()),
    ];
    let proxied = [
        (padding_proxy(main.addr).to_string(), main_addr.clone()),
        (padding_proxy(stale.addr).to_string(), stale_addr.clone()),
        (down.clone(), down.clone()),
    ];
    let lean_prom = Prometheus::start(&prometheus_config(&direct));
    let padded_prom = Prometheus::start(&prometheus_config(&proxied));
    let ready_at = Instant::now();
    // The scenario moves as in the `prometheus` test (free memory creeping
    // down, a spike): the time-to-full panel has data.
    world.start_rewriting();

    loop {
        let mut problems = Vec::new();
        let mut compared = 0;
        for (what, expr, at) in comparisons(&main_addr) {
            let (a, b) = (query(&lean_prom, &expr, at), query(&padded_prom, &expr, at));
            compared += a.result.len();
            if let Some(d) = difference(&a, &b) {
                problems.push(format!("{what}: {d}\n    {expr}"));
            } else if what.starts_with("panel") && a.result.is_empty() {
                problems.push(format!("{what}: no data yet\n    {expr}"));
            }
        }
        if problems.is_empty() {
            let _ = writeln!(
                std::io::stderr(),
                "{} queries, {compared} series: the same with and without empty labels",
                comparisons(&main_addr).len()
            );
            break;
        }
        assert!(
            ready_at.elapsed() < Duration::from_secs(40),
            "{} differences after 40 s:\n{}\nlean prometheus log:\n{}\npadded prometheus log:\n{}",
            problems.len(),
            problems.join("\n"),
            lean_prom.log(),
            padded_prom.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(down_socket);
}

#[test]
fn padding_puts_back_exactly_the_labels_the_encoder_wrote_before() {
    let lean = "# TYPE gpu_process_info gauge\n\
        gpu_process_info{gpu=\"0\",uuid=\"U\",pid=\"7\",process=\"py\",user=\"a\",cmdline=\"x \\\"y\\\" {z}\"} 1\n\
        gpu_process_memory_used_bytes{gpu=\"0\",uuid=\"U\",pid=\"other\"} 3\n\
        gpu_driver_info 1\n\
        gpu_up{gpu=\"0\",uuid=\"U\"} 1\n\
        # EOF\n";
    let want = "# TYPE gpu_process_info gauge\n\
        gpu_process_info{gpu=\"0\",uuid=\"U\",pid=\"7\",process=\"py\",user=\"a\",container_id=\"\",pod_uid=\"\",cmdline=\"x \\\"y\\\" {z}\"} 1\n\
        gpu_process_memory_used_bytes{gpu=\"0\",uuid=\"U\",pid=\"other\",process=\"\",namespace=\"\",pod=\"\",container=\"\",gpu_instance_id=\"\",compute_instance_id=\"\"} 3\n\
        gpu_driver_info{driver_version=\"\",nvml_version=\"\",cuda_driver_version=\"\"} 1\n\
        gpu_up{gpu=\"0\",uuid=\"U\"} 1\n\
        # EOF\n";
    assert_eq!(with_empty_labels(lean), want);
}

#[test]
fn a_different_series_is_a_difference() {
    let answer = |pods: &[&str]| QueryResult {
        status: "success".into(),
        error: None,
        result: pods
            .iter()
            .map(|p| serde_json::json!({"metric": {"pod": p}, "value": [0, "1"]}))
            .collect(),
    };
    assert_eq!(difference(&answer(&["a", "b"]), &answer(&["b", "a"])), None);
    let d = difference(&answer(&["a"]), &answer(&["a", "b"])).expect("a difference");
    assert!(
        d.contains("only padded: [\"{\\\"pod\\\":\\\"b\\\"}\"]"),
        "{d}"
    );
    assert!(difference(&answer(&["a"]), &answer(&["c"])).is_some());
}
