//! The page in a real headless Chromium (`--features external-tools`):
//! the bar's three parts of the used memory and the "Held by the dead"
//! table.

use std::time::Duration;

use serde_json::Value;

use super::MIB;
use crate::harness::Exporter;
use crate::harness::browser::Browser;

/// What the first GPU's card shows, read from its DOM.
const READ_DOM: &str = r#"(() => {
  const s = document.querySelector('section.gpu');
  if (!s) return null;
  const width = (cls) => {
    const r = s.querySelector('svg.bar rect.' + cls);
    return r ? Number(r.getAttribute('width')) : null;
  };
  const seg = s.querySelector('.legend.segments');
  return {
    rows: [...s.querySelectorAll('tbody tr[data-pid]')].map((r) => [r.dataset.pid, r.className]),
    dead: [...s.querySelectorAll('.dead tbody tr')].map((r) =>
      [r.dataset.stalePid, r.dataset.reason, ...[...r.querySelectorAll('td')].map((td) => td.textContent)]),
    title: s.querySelector('.dead h3') ? s.querySelector('.dead h3').textContent : null,
    segments: seg ? seg.textContent : null,
    used: width('used'),
    stale: width('stale'),
    unattributed: width('unattributed'),
  };
})()"#;

/// The page's line under the bar: attributed, unattributed, stale.
pub(super) fn segments(attributed: u64, unattributed: u64, stale: u64) -> String {
    format!(
        "attributed {} unattributed {} stale {}",
        mib(attributed),
        mib(unattributed),
        mib(stale)
    )
}

/// Bytes as the page writes them, rounded: "8,192 MiB".
fn mib(bytes: u64) -> String {
    let n = ((bytes + MIB / 2) / MIB).to_string();
    let mut out = String::new();
    for (i, c) in n.chars().enumerate() {
        if i > 0 && (n.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    format!("{out} MiB")
}

/// The page lists `pids` in the process table; `dead` (pid, reason,
/// bytes, last owner) and nothing else in "Held by the dead", their rows
/// in the process table marked stale; `segments` under the bar, and the
/// bar's stale part drawn exactly when something is stale.
pub(super) fn page_shows(
    ex: &Exporter,
    pids: &[u32],
    dead: &[(u32, &str, u64, &str)],
    segments: Option<&str>,
) {
    let mut b = Browser::start(1280, 900);
    b.navigate(&format!("http://{}/", ex.addr));
    let want_dead: Vec<String> = dead.iter().map(|d| d.0.to_string()).collect();
    let dom = b.wait_until(
        Duration::from_secs(20),
        "the processes and the dead",
        READ_DOM,
        |d| {
            let rows: Vec<&str> = d["rows"]
                .as_array()
                .map(|r| r.iter().filter_map(|r| r[0].as_str()).collect())
                .unwrap_or_default();
            let dead: Vec<&str> = d["dead"]
                .as_array()
                .map(|r| r.iter().filter_map(|r| r[0].as_str()).collect())
                .unwrap_or_default();
            pids.iter().all(|p| rows.contains(&p.to_string().as_str())) && dead == want_dead
        },
    );
    assert!(b.errors.is_empty(), "console errors: {:?}", b.errors);
    assert_eq!(dom["segments"].as_str(), segments, "{dom:#}");
    let rows = dom["rows"].as_array().unwrap();
    for r in rows {
        let pid = r[0].as_str().and_then(|p| p.parse::<u32>().ok());
        let stale = dead.iter().any(|d| pid == Some(d.0));
        assert_eq!(r[1] == "stale", stale, "row {r} marked stale or not");
    }
    if dead.is_empty() {
        assert_eq!(dom["title"], Value::Null, "no table without the dead");
        assert_eq!(dom["stale"], 0.0, "{dom:#}");
        return;
    }
    assert_eq!(dom["title"], "Held by the dead");
    assert!(dom["stale"].as_f64().unwrap() > 0.0, "{dom:#}");
    assert!(dom["used"].as_f64().unwrap() > 0.0, "{dom:#}");
    for (row, (pid, reason, bytes, owner)) in dom["dead"].as_array().unwrap().iter().zip(dead) {
        let cells: Vec<&str> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert_eq!(cells[..2], [pid.to_string().as_str(), *reason], "{row}");
        assert_eq!(cells[2], pid.to_string());
        assert_eq!(cells[3], reason.replace('_', " "));
        assert!(cells[4].ends_with(" ago"), "since: {row}");
        assert_eq!(cells[5], mib(*bytes));
        assert_eq!(cells[6], *owner);
    }
}
