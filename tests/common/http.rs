//! Running `edgemoe serve` on a loopback port and talking HTTP/1.1 to it over plain sockets
//! (no client library: the tests need to hold a connection open, drop it mid-answer and read
//! server-sent events as they come).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `edgemoe serve`.
pub struct Server {
    child: Child,
    /// `127.0.0.1:PORT`, as the server printed it.
    pub addr: String,
    /// Everything the server printed on standard error so far.
    pub stderr: Arc<Mutex<String>>,
    /// Headers [`Server::metric`] sends (the bearer token of a server with an API key).
    pub auth: Vec<(String, String)>,
}

impl Server {
    /// Starts `edgemoe serve --port 0 args…` (with `env` set) and waits for it to print its
    /// address and for `/health` to answer 200.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let server = Server::spawn(args, env);
        server.wait_healthy(Duration::from_secs(120));
        server
    }

    /// Starts `edgemoe serve --port 0 args…` and returns once it has printed its address (the
    /// model may still be loading).
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_edgemoe"));
        command
            .arg("serve")
            .args(["--port", "0"])
            .args(args)
            .env_remove("EDGEMOE_API_KEY");
        for (k, v) in env {
            command.env(k, v);
        }
        Server::spawn_command(command)
    }

    /// Starts `command`, which must run `edgemoe serve` in its own process (directly, or through
    /// a shell that `exec`s it), and returns once the server has printed its address.
    pub fn spawn_command(mut command: std::process::Command) -> Server {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command.spawn().unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        {
            let stderr = stderr.clone();
            let pipe = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        let _ = addr_tx.send(addr);
                    }
                    let mut all = stderr.lock().unwrap();
                    all.push_str(&line);
                    all.push('\n');
                }
            });
        }
        let addr = match addr_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "edgemoe serve printed no address; stderr: {}",
                    stderr.lock().unwrap()
                );
            }
        };
        Server {
            child,
            addr,
            stderr,
            auth: Vec::new(),
        }
    }

    pub fn wait_healthy(&self, within: Duration) {
        let start = Instant::now();
        loop {
            if let Ok(response) = self.try_request("GET", "/health", &[], "") {
                if response.status == 200 {
                    return;
                }
            }
            assert!(
                start.elapsed() < within,
                "server not healthy after {within:?}; stderr: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Opens a connection and sends one request on it (the answer is left to read).
    pub fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).unwrap();
        // A server that answers before reading the whole body (413) may close early.
        let _ = stream.write_all(body.as_bytes());
        stream
    }

    fn try_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> std::io::Result<Response> {
        let mut stream = TcpStream::connect(&self.addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n{}\r\n",
            self.addr,
            body.len(),
            headers
                .iter()
                .map(|(k, v)| format!("{k}: {v}\r\n"))
                .collect::<String>()
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(body.as_bytes())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        Ok(Response::parse(&raw))
    }

    /// One request and its whole answer.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Response {
        let mut stream = self.send(method, path, headers, body);
        let mut raw = Vec::new();
        if let Err(e) = stream.read_to_end(&mut raw) {
            // A reset after the answer (the server closed with the body unread) still leaves
            // the answer read.
            assert!(!raw.is_empty(), "{method} {path}: {e}");
        }
        Response::parse(&raw)
    }

    pub fn post(&self, path: &str, body: &str) -> Response {
        self.request("POST", path, &[], body)
    }

    pub fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], "")
    }

    /// The value of a Prometheus sample (`name{labels}` exactly as written), if present.
    pub fn metric(&self, sample: &str) -> Option<f64> {
        let auth: Vec<(&str, &str)> = self
            .auth
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let text = self.request("GET", "/metrics", &auth, "").body;
        text.lines().find_map(|line| {
            line.strip_prefix(sample)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    /// Waits until `sample` reaches `value` (within `secs`), failing with the metrics.
    pub fn wait_metric(&self, sample: &str, value: f64, secs: u64) -> Duration {
        let start = Instant::now();
        loop {
            if self.metric(sample) == Some(value) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "{sample} never reached {value} in {secs} s; metrics:\n{}",
                self.get("/metrics").body
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the server.
    pub fn signal(&self, signal: i32) {
        // SAFETY: plain kill(2) on the id of a child this test started and has not reaped.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as libc::pid_t, signal) },
            0
        );
    }

    /// Waits for the server to exit (killing it and failing after `secs`).
    pub fn wait_exit(&mut self, secs: u64) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > Duration::from_secs(secs) {
                let _ = self.child.kill();
                panic!(
                    "server still running {secs} s after being asked to stop; stderr: {}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn parse(raw: &[u8]) -> Response {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(raw)));
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let body = &raw[split + 4..];
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {head:?}"));
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        };
        Response {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }

    /// The `data:` payloads of a server-sent event stream.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(str::to_string)
            .collect()
    }

    /// Asserts an error answer: `status`, JSON `{"error": {"type": kind, "message"}}` whose
    /// message contains every needle.
    pub fn assert_error(&self, status: u16, kind: &str, needles: &[&str]) {
        assert_eq!(self.status, status, "{}", self.body);
        let json = self.json();
        assert_eq!(json["error"]["type"], kind, "{}", self.body);
        let message = json["error"]["message"].as_str().unwrap();
        for needle in needles {
            assert!(message.contains(needle), "expected `{needle}` in {message}");
        }
    }
}

/// The body of a chunked transfer encoding.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(end) = body.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&body[..end]);
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        let rest = &body[end + 2..];
        if size == 0 || rest.len() < size {
            break;
        }
        out.extend_from_slice(&rest[..size]);
        body = rest[size..].strip_prefix(b"\r\n").unwrap_or(&rest[size..]);
    }
    out
}

/// Reads a streamed answer from `stream` until `events` `data:` events have arrived (the
/// head included), returning what was read.
pub fn read_events(stream: &mut TcpStream, events: usize) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&raw);
        if text.matches("data: ").count() >= events {
            return text.into_owned();
        }
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            return text.into_owned();
        }
        raw.extend_from_slice(&buf[..n]);
    }
}
