//! The systemd units in `deploy/` as a board runs them, without a board or a running systemd:
//! `systemd-analyze verify` accepts each unit with no warning (where systemd's tools are
//! installed: `.ci/run` installs them), and each unit's own `ExecStart=` line, read from the
//! file with systemd's `$$` unescaped and its `Environment=` values set, starts the real binary:
//! the service answers over HTTP with the API key from its environment file and exits 0 on
//! SIGTERM within the unit's stop timeout; the one-shot job writes one summary per document and
//! its statistics into its working directory.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::http::Server;

/// Where `deploy/install.sh` puts the binary; the tests run the one cargo built instead.
const INSTALLED_BINARY: &str = "/opt/edgemoe/edgemoe";

/// One unit file, the keys the tests need.
struct Unit {
    path: PathBuf,
    /// Every `KEY=VALUE` of the `Environment=` lines, in order.
    environment: BTreeMap<String, String>,
    environment_files: Vec<String>,
    /// The `ExecStart=` command line split into words as systemd splits it, `$$` unescaped.
    exec_start: Vec<String>,
    /// The remaining `[Service]` settings by key (the last value of each).
    settings: BTreeMap<String, String>,
}

fn unit(name: &str) -> Unit {
    let path = common::root().join("deploy").join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut unit = Unit {
        path,
        environment: BTreeMap::new(),
        environment_files: Vec::new(),
        exec_start: Vec::new(),
        settings: BTreeMap::new(),
    };
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
    {
        let (key, value) = line.split_once('=').unwrap();
        match key {
            "Environment" => {
                for assignment in value.split_whitespace() {
                    let (k, v) = assignment
                        .split_once('=')
                        .unwrap_or_else(|| panic!("{name}: Environment word {assignment:?}"));
                    unit.environment.insert(k.to_string(), v.to_string());
                }
            }
            "EnvironmentFile" => unit.environment_files.push(value.to_string()),
            "ExecStart" => unit.exec_start = exec_words(name, value),
            _ => {
                unit.settings.insert(key.to_string(), value.to_string());
            }
        }
    }
    assert!(!unit.exec_start.is_empty(), "{name} has no ExecStart=");
    unit
}

/// Splits an `ExecStart=` value into words as systemd does for these units (words separated by
/// spaces, a single-quoted word kept whole) and unescapes `$$`. A lone `$` would be expanded by
/// systemd itself from the unit's environment, which these units leave to the shell: refused.
fn exec_words(name: &str, value: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut rest = value.trim();
    while !rest.is_empty() {
        let (word, after) = if let Some(quoted) = rest.strip_prefix('\'') {
            let end = quoted
                .find('\'')
                .unwrap_or_else(|| panic!("{name}: unclosed quote"));
            (&quoted[..end], &quoted[end + 1..])
        } else {
            rest.split_at(rest.find(' ').unwrap_or(rest.len()))
        };
        assert!(
            !word.replace("$$", "").contains('$'),
            "{name}: ExecStart word {word:?} has a `$` that systemd would expand itself"
        );
        words.push(word.replace("$$", "$"));
        rest = after.trim_start();
    }
    words
}

impl Unit {
    /// A command running the unit's `ExecStart=` with the built binary in place of the
    /// installed one and each `(path, stand_in)` of `paths` replaced, in the environment
    /// systemd would give it (the unit's `Environment=`, then `overrides` as a drop-in or an
    /// environment file would set them).
    fn command(&self, paths: &[(&str, &str)], overrides: &[(&str, &str)]) -> Command {
        let binary = env!("CARGO_BIN_EXE_edgemoe");
        let words: Vec<String> = self
            .exec_start
            .iter()
            .map(|word| {
                paths.iter().fold(
                    word.replace(INSTALLED_BINARY, binary),
                    |w, (path, stand_in)| w.replace(path, stand_in),
                )
            })
            .collect();
        assert!(
            words.iter().any(|w| w.contains(binary)),
            "{}: ExecStart does not run {INSTALLED_BINARY}",
            self.path.display()
        );
        let mut command = Command::new(&words[0]);
        command.args(&words[1..]).env_clear();
        // What systemd's manager environment provides, and libtorch's libraries.
        for inherited in ["PATH", "LD_LIBRARY_PATH", "LIBTORCH"] {
            if let Some(value) = std::env::var_os(inherited) {
                command.env(inherited, value);
            }
        }
        for (k, v) in &self.environment {
            command.env(k, v);
        }
        for (k, v) in overrides {
            assert!(
                self.environment.contains_key(*k) || *k == "EDGEMOE_API_KEY",
                "{}: the unit does not declare {k}",
                self.path.display()
            );
            command.env(k, v);
        }
        command
    }

    fn seconds(&self, key: &str) -> u64 {
        let value = &self.settings[key];
        if let Some(minutes) = value.strip_suffix("min") {
            minutes.parse::<u64>().unwrap() * 60
        } else {
            value.trim_end_matches('s').parse().unwrap()
        }
    }
}

/// `systemd-analyze`, where systemd's tools are installed.
fn systemd_analyze() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("systemd-analyze"))
        .find(|candidate| candidate.is_file())
}

#[test]
fn systemd_accepts_both_units_without_a_warning() {
    let Some(analyze) = systemd_analyze() else {
        eprintln!("skipped: no systemd-analyze on the PATH (.ci/run installs systemd)");
        return;
    };
    for name in ["edgemoe.service", "edgemoe-serve.service"] {
        let path = common::root().join("deploy").join(name);
        let out = Command::new(&analyze)
            .args(["verify", "--man=no"])
            .arg(&path)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // Unknown keys and bad values are warnings with exit status 0: any output is a failure.
        assert!(
            out.status.success() && said.trim().is_empty(),
            "systemd-analyze verify {name}: {said}"
        );
    }
}

fn bundle(dir: &Path) -> PathBuf {
    common::convert_to(&common::fixture("tiny-tied-e4"), dir)
}

#[test]
fn the_serve_units_command_line_serves_with_its_key_and_stops_cleanly_on_sigterm() {
    let unit = unit("edgemoe-serve.service");
    assert!(
        unit.environment_files
            .iter()
            .any(|f| f.trim_start_matches('-').ends_with("serve.env")),
        "the API key's environment file is not read"
    );
    assert_eq!(unit.settings["Restart"], "on-failure");
    assert_eq!(unit.settings["MemorySwapMax"], "0");
    assert_eq!(unit.settings["KillSignal"], "SIGTERM");
    // systemd must not kill the server before its own grace period has run out.
    let script = unit.exec_start.last().unwrap();
    let grace: u64 = script
        .split("--shutdown-grace ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.trim_matches('\'').parse().ok())
        .expect("the unit sets --shutdown-grace");
    let stop_timeout = unit.seconds("TimeoutStopSec");
    assert!(
        stop_timeout > grace,
        "TimeoutStopSec {stop_timeout} ≤ grace {grace}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bundle = bundle(dir.path());
    let command = unit.command(
        &[],
        &[
            ("EDGEMOE_MODEL", bundle.to_str().unwrap()),
            ("EDGEMOE_PORT", "0"),
            ("EDGEMOE_PROFILE", "rpi5-sd"),
            ("EDGEMOE_API_KEY", "unit-test-key"),
        ],
    );
    let mut server = Server::spawn_command(command);
    server.auth = vec![(
        "Authorization".to_string(),
        "Bearer unit-test-key".to_string(),
    )];
    server.wait_healthy(Duration::from_secs(120));
    assert!(
        server.addr.starts_with("127.0.0.1:"),
        "the unit's server listens on {} (loopback by default)",
        server.addr
    );

    let body = r#"{"documents": ["Anna: hi\nTom: hello, see you at noon"], "max_new_tokens": 6}"#;
    server
        .post("/v1/summarize", body)
        .assert_error(401, "unauthorized", &["bearer"]);
    let answer = server.request(
        "POST",
        "/v1/summarize",
        &[("Authorization", "Bearer unit-test-key")],
        body,
    );
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["summaries"].as_array().unwrap().len(), 1);
    // The profile named in the environment reached the engine.
    let stats = server.request(
        "GET",
        "/stats",
        &[("Authorization", "Bearer unit-test-key")],
        "",
    );
    assert!(stats.body.contains("rpi5-sd"), "{}", stats.body);

    // `sh -c 'exec …'`: the signal systemd sends reaches the server itself.
    server.signal(libc::SIGTERM);
    let status = server.wait_exit(stop_timeout);
    assert_eq!(status.code(), Some(0), "{}", server.stderr());
}

#[test]
fn the_job_units_command_line_writes_a_summary_per_document_and_its_stats() {
    let unit = unit("edgemoe.service");
    let spool = "/var/spool/edgemoe/input";
    assert!(unit.exec_start.last().unwrap().contains(spool));
    assert_eq!(unit.settings["WorkingDirectory"], "/var/lib/edgemoe");
    assert_eq!(unit.settings["StateDirectory"], "edgemoe");

    let dir = tempfile::tempdir().unwrap();
    let bundle = bundle(dir.path());
    let input = dir.path().join("input.jsonl");
    std::fs::write(
        &input,
        "{\"dialogue\": \"Anna: hi\\nTom: hello, see you at noon\"}\n\
         {\"dialogue\": \"Bob: the train is late again\\nEve: I will wait at the station\"}\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    // The spool file and the state directory are the unit's; the test's stand in for them.
    let mut command = unit.command(
        &[(spool, input.to_str().unwrap())],
        &[("EDGEMOE_MODEL", bundle.to_str().unwrap())],
    );
    let out = command.current_dir(&state).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let written = std::fs::read_to_string(state.join("summaries.txt")).unwrap();
    let expected = common::cli::stdout(&common::cli::run(
        &[
            "summarize",
            "--model",
            bundle.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "-q",
        ],
        None,
    ));
    assert_eq!(written.lines().count(), 2, "{written}");
    assert_eq!(written, expected);
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("stats.json")).unwrap()).unwrap();
    assert!(stats.is_object(), "{stats}");
}
