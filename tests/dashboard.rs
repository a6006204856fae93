//! The dashboard of `edgemoe serve` in a real headless browser (Debian's `chromium`, which
//! `.ci/run` installs): after a request the page shows the model, says it is ready, lists the
//! request and has drawn every chart from `/stats`. Skips, saying so, where no chromium is
//! installed (a developer's machine); CI always has one.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::http::Server;

/// The browser: `EDGEMOE_CHROMIUM`, else `chromium` or `chromium-browser` on the PATH.
fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("EDGEMOE_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

/// Runs headless chromium on `url` with `extra` flags, in a fresh profile; its standard output.
fn headless(browser: &PathBuf, url: &str, extra: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let output = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,900",
            // The page polls every second: let its timers run a few times.
            "--virtual-time-budget=6000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The `data-points` attribute of canvas `id` in a dumped DOM.
fn points(dom: &str, id: &str) -> usize {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let tag_end = at + dom[at..].find('>').unwrap();
    let tag = &dom[at..tag_end];
    let value = tag
        .split("data-points=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("#{id} has no data-points: {tag}"));
    value.parse().unwrap()
}

#[test]
fn the_dashboard_draws_the_cache_after_a_request() {
    let Some(browser) = chromium() else {
        eprintln!(
            "skipped: no chromium on the PATH (apt-get install chromium, or set EDGEMOE_CHROMIUM); .ci/run installs it"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-untied-e8"), dir.path());
    let mut server = Server::start(
        &["--model", bundle.to_str().unwrap(), "--api-key", "dash-key"],
        &[],
    );
    server.auth = vec![("Authorization".into(), "Bearer dash-key".into())];
    // Two requests in different seconds: two points of history, so the charts over time have
    // a point between them.
    for _ in 0..2 {
        let answered = server.request(
            "POST",
            "/v1/summarize",
            &[("Authorization", "Bearer dash-key")],
            r#"{"documents": ["Anna: lunch at noon?\nTom: sure, see you there."], "max_new_tokens": 8}"#,
        );
        assert_eq!(answered.status, 200, "{}", answered.body);
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    let history = server
        .request("GET", "/stats", &[("Authorization", "Bearer dash-key")], "")
        .json()["history"]
        .as_array()
        .unwrap()
        .len();
    assert!(history >= 2, "{history} points of history");

    // The key travels in the URL's fragment, which the page reads and the browser never sends.
    let url = format!("http://{}/#key=dash-key", server.addr);
    let dom = headless(&browser, &url, &["--dump-dom"]);
    assert!(
        dom.contains("bundle · switch_transformers (encoder-decoder)"),
        "{dom}"
    );
    assert!(dom.contains("id=\"status\" class=\"ok\">ready<"), "{dom}");
    assert!(dom.contains("<span id=\"error\"></span>"), "{dom}");
    for chart in ["c-hit", "c-ms", "c-read", "c-slots"] {
        assert!(points(&dom, chart) > 0, "chart #{chart} is empty:\n{dom}");
    }
    assert!(points(&dom, "c-hit") >= 2, "hit ratio over time:\n{dom}");
    assert_eq!(
        dom.matches("<td>summarize</td><td>200</td>").count(),
        2,
        "the last requests:\n{dom}"
    );

    // Without the key the page says what is wrong instead of drawing.
    let dom = headless(
        &browser,
        &format!("http://{}/", server.addr),
        &["--dump-dom"],
    );
    assert!(
        dom.contains("cannot read /stats: missing bearer token"),
        "{dom}"
    );

    let shot = dir.path().join("dashboard.png");
    headless(
        &browser,
        &url,
        &[&format!("--screenshot={}", shot.display())],
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
}
