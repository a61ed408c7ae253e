//! A real headless Chromium (Debian `chromium`), driven over the DevTools
//! protocol: navigate, evaluate JavaScript in the page, collect every
//! console error, uncaught exception and browser log error (CSP
//! violations and failed loads are logged there), take screenshots.
//! tungstenite speaks the websocket; the protocol is a few JSON messages.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

use super::wait_for;

/// The browser binary: `chromium` (Debian), installed by scripts/ci/test.
pub fn chromium() -> &'static str {
    for name in ["chromium", "chromium-browser"] {
        if Command::new(name)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return name;
        }
    }
    panic!("chromium not found: apt-get install -y chromium (scripts/ci/test installs it)")
}

/// One page of a headless Chromium; the browser is killed on drop.
pub struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    next_id: u64,
    /// Console errors, exceptions and log errors seen so far, as text.
    pub errors: Vec<String>,
}

impl Browser {
    /// Start Chromium at `width` × `height` on about:blank and attach to
    /// its page, with the Runtime, Log and Page domains on.
    pub fn start(width: u32, height: u32) -> Browser {
        let profile = tempfile::tempdir().expect("profile dir");
        let mut cmd = Command::new(chromium());
        // Its zygote, renderer and utility processes: one group, killed
        // with it.
        super::own_group(&mut cmd);
        let child = cmd
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                &format!("--window-size={width},{height}"),
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn chromium");
        // Chromium writes its port to DevToolsActivePort once it listens.
        let port_file = profile.path().join("DevToolsActivePort");
        let port: u16 = wait_for(Duration::from_secs(30), "chromium's DevTools port", || {
            std::fs::read_to_string(&port_file)
                .ok()?
                .lines()
                .next()?
                .trim()
                .parse()
                .ok()
        });
        let devtools = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let page_ws = wait_for(Duration::from_secs(10), "chromium's page target", || {
            let targets: Value =
                serde_json::from_str(&devtools_get(devtools, "/json/list")?).ok()?;
            targets.as_array()?.iter().find(|t| t["type"] == "page")?["webSocketDebuggerUrl"]
                .as_str()
                .map(String::from)
        });
        let (ws, _) = tungstenite::connect(page_ws.as_str()).expect("connect to the page");
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        }
        let mut b = Browser {
            child,
            _profile: profile,
            ws,
            next_id: 0,
            errors: Vec::new(),
        };
        for domain in ["Runtime.enable", "Log.enable", "Page.enable"] {
            b.call(domain, json!({}));
        }
        b
    }

    /// Send a command and wait for its answer (events seen meanwhile are
    /// recorded).
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::text(msg)).expect("send to chromium");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(
                Instant::now() < deadline,
                "{method}: no answer from chromium"
            );
            if let Some(v) = self.read() {
                if v["id"] == id {
                    assert!(v.get("error").is_none(), "{method}: {}", v["error"]);
                    return v["result"].clone();
                }
                self.event(&v);
            }
        }
    }

    /// Read events for `d`.
    pub fn pump(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if let Some(v) = self.read() {
                self.event(&v);
            }
        }
    }

    fn read(&mut self) -> Option<Value> {
        match self.ws.read() {
            Ok(Message::Text(t)) => serde_json::from_str(t.as_str()).ok(),
            Ok(_) => None,
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                None
            }
            Err(e) => panic!("chromium's websocket: {e}"),
        }
    }

    fn event(&mut self, v: &Value) {
        let p = &v["params"];
        match v["method"].as_str() {
            Some("Runtime.consoleAPICalled")
                if matches!(p["type"].as_str(), Some("error" | "assert" | "warning")) =>
            {
                let args: Vec<String> = p["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| {
                        a["value"]
                            .as_str()
                            .map_or_else(|| a.to_string(), String::from)
                    })
                    .collect();
                self.errors
                    .push(format!("console.{}: {}", p["type"], args.join(" ")));
            }
            Some("Runtime.exceptionThrown") => {
                let d = &p["exceptionDetails"];
                self.errors.push(format!(
                    "uncaught: {} {}",
                    d["text"], d["exception"]["description"]
                ));
            }
            Some("Log.entryAdded")
                if matches!(p["entry"]["level"].as_str(), Some("error" | "warning")) =>
            {
                let e = &p["entry"];
                self.errors.push(format!(
                    "log {} ({}): {} {}",
                    e["level"], e["source"], e["text"], e["url"]
                ));
            }
            _ => {}
        }
    }

    /// Open `url` and wait for its load event.
    pub fn navigate(&mut self, url: &str) {
        let r = self.call("Page.navigate", json!({"url": url}));
        assert!(r.get("errorText").is_none(), "navigate {url}: {r}");
    }

    /// The value of JavaScript `expr` in the page (a promise is awaited).
    pub fn eval(&mut self, expr: &str) -> Value {
        self.try_eval(expr)
            .unwrap_or_else(|e| panic!("{expr}: {e}"))
    }

    /// The value of `expr`, or the exception it threw.
    pub fn try_eval(&mut self, expr: &str) -> Result<Value, Value> {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        match r.get("exceptionDetails") {
            Some(e) => Err(e.clone()),
            None => Ok(r["result"]["value"].clone()),
        }
    }

    /// Poll `expr` until `ok` accepts its value; panic after `timeout`.
    pub fn wait_until(
        &mut self,
        timeout: Duration,
        what: &str,
        expr: &str,
        ok: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            // Before the page has loaded, `expr` may throw.
            let v = self.try_eval(expr).unwrap_or_else(|e| e);
            if ok(&v) {
                return v;
            }
            assert!(
                start.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {what}; last: {v}"
            );
            self.pump(Duration::from_millis(50));
        }
    }

    /// A PNG of the whole window, written to `path`.
    pub fn screenshot(&mut self, path: &Path) {
        use base64::Engine;
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().expect("screenshot data"))
            .expect("base64 screenshot");
        std::fs::write(path, png).expect("write screenshot");
    }
}

/// GET from Chromium's DevTools HTTP endpoint, which keeps the connection
/// open: read the body by its Content-Length.
fn devtools_get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n")?;
        let len: usize = head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })?;
        if body.len() >= len {
            return Some(body[..len].to_string());
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        super::kill_group(&mut self.child);
    }
}
