//! `edgemoe serve` end to end: the real binary on a loopback port (port 0, the address read from
//! its standard error), spoken to over plain sockets. Summaries over HTTP are the CLI's, token
//! for token; streamed completions are `generate`'s on every decoder-only architecture; bad
//! requests get JSON errors naming the problem; a full queue answers 503 with `Retry-After`; a
//! client that goes away cancels its request at the next token; a deadline answers 504; SIGTERM
//! finishes (or, past the grace period, cancels) what runs and exits 0.
//!
//! The slow server of the queue and shutdown tests paces expert reads to a hard disk
//! (`--storage emulate` with the jetson-tx2-hdd profile, two buffer slots, no prefetch): about
//! 60 ms per token on the tiny Mixtral, so a 200-token request runs for seconds.

mod common;

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use common::http::{read_events, Server};
use serde_json::{json, Value};

const KEY_HEADER: (&str, &str) = ("Authorization", "Bearer test-key");

/// Three dialogues whose summaries differ.
fn dialogues() -> Vec<String> {
    vec![
        std::fs::read_to_string(common::root().join("models/sample-dialogue.txt")).unwrap(),
        "Anna: Did you feed the cat this morning?\nTom: Yes, and I refilled her water too.\nAnna: Great, thanks. I'll be home late, around 10.\nTom: OK, I'll keep dinner warm for you.".into(),
        "Greg: The printer on the second floor is broken again.\nLiz: I'll call the technician. Can you use the one in the library until then?\nGreg: Sure. Please tell me when it's fixed.".into(),
    ]
}

fn cli(args: &[&str]) -> String {
    common::cli::stdout(&common::cli::run(args, None))
}

fn ids_of(line: &str) -> Vec<i64> {
    line.split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

#[test]
fn summaries_over_http_equal_the_cli_token_for_token() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::demo_checkpoint(), dir.path());
    let b = bundle.to_str().unwrap();
    let documents = dialogues();
    let input = dir.path().join("documents.jsonl");
    let lines: Vec<String> = documents
        .iter()
        .map(|d| json!({ "dialogue": d }).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let input = input.to_str().unwrap();

    let server = Server::start(&["--model", b], &[]);
    let mut all_ids = Vec::new();
    let mut total_tokens = 0;
    for (flags, options) in [
        (
            vec!["--max-new-tokens", "30"],
            json!({"max_new_tokens": 30}),
        ),
        (
            vec!["--beams", "2", "--max-new-tokens", "24"],
            json!({"beams": 2, "max_new_tokens": 24}),
        ),
    ] {
        let mut args = vec!["summarize", "--model", b, "--input", input, "-q"];
        args.extend(&flags);
        let texts: Vec<String> = cli(&args).lines().map(str::to_string).collect();
        args.push("--ids");
        let ids: Vec<Vec<i64>> = cli(&args).lines().map(ids_of).collect();
        assert_eq!(ids.len(), documents.len());

        let mut body = options.clone();
        body["documents"] = json!(documents);
        let response = server.post("/v1/summarize", &body.to_string());
        assert_eq!(response.status, 200, "{}", response.body);
        let json = response.json();
        let summaries = json["summaries"].as_array().unwrap();
        assert_eq!(summaries.len(), documents.len(), "one summary per document");
        for (i, summary) in summaries.iter().enumerate() {
            let got: Vec<i64> = serde_json::from_value(summary["ids"].clone()).unwrap();
            assert_eq!(got, ids[i], "document {i} with {options}: token ids");
            assert_eq!(summary["text"], texts[i].as_str(), "document {i}: text");
            assert_eq!(summary["tokens"], got.len());
            assert!(summary["ms"].as_f64().unwrap() > 0.0);
            total_tokens += got.len();
            all_ids.push(got);
        }
    }
    let mut distinct = all_ids.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= documents.len(),
        "the documents should give different summaries: {all_ids:?}"
    );

    // The metrics count what was served, and carry the expert cache's figures.
    assert_eq!(
        server.metric("edgemoe_requests_total{endpoint=\"/v1/summarize\",status=\"200\"}"),
        Some(2.0)
    );
    assert_eq!(
        server.metric("edgemoe_tokens_generated_total"),
        Some(total_tokens as f64)
    );
    let metrics = server.get("/metrics");
    assert!(metrics
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    for name in [
        "edgemoe_expert_hit_ratio ",
        "edgemoe_layer_hit_ratio{stack=\"encoder\"",
        "edgemoe_layer_hit_ratio{stack=\"decoder\"",
        "edgemoe_decode_ms_per_token_bucket{le=\"+Inf\"} ",
        "edgemoe_prefetch_issued_total ",
        "edgemoe_prefetch_useful_total ",
        "edgemoe_prefetch_wasted_bytes_total ",
        "edgemoe_stall_seconds_total ",
        "edgemoe_resident_bytes ",
        "edgemoe_buffer_bytes ",
        "edgemoe_peak_rss_bytes ",
        "edgemoe_queue_depth 0",
    ] {
        assert!(
            metrics.body.contains(name),
            "no `{name}` in\n{}",
            metrics.body
        );
    }
    assert!(server.metric("edgemoe_bytes_read_total").unwrap() > 0.0);
    assert!(server.metric("edgemoe_expert_accesses_total").unwrap() > 0.0);

    // The dashboard is one page with nothing to fetch from elsewhere; its data is /stats.
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(page.body.contains("<canvas id=\"c-hit\""));
    assert!(!page.body.contains("src=\"http") && !page.body.contains("href=\"http"));
    let stats = server.get("/stats").json();
    assert_eq!(stats["model"]["name"], "bundle");
    assert_eq!(
        stats["engine"]["expert_accesses"].as_f64(),
        server.metric("edgemoe_expert_accesses_total")
    );
    assert_eq!(stats["recent"].as_array().unwrap().len(), 2);
}

/// The token ids and text of a streamed completion, checking the stream's shape.
fn streamed(server: &Server, path: &str, body: &Value) -> (Vec<i64>, String, Value) {
    let response = server.post(path, &body.to_string());
    assert_eq!(response.status, 200, "{}", response.body);
    assert!(response
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = response.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut ids = Vec::new();
    let mut text = String::new();
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        ids.extend(
            choice["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap()),
        );
        let piece = if chunk["object"] == "chat.completion.chunk" {
            &choice["delta"]["content"]
        } else {
            &choice["text"]
        };
        text.push_str(piece.as_str().unwrap());
    }
    let last = chunks.last().unwrap().clone();
    (ids, text, last)
}

#[test]
fn streamed_completions_equal_generate_on_every_decoder_architecture() {
    let dir = tempfile::tempdir().unwrap();
    for name in common::DECODER_FIXTURES {
        let bundle = common::convert_to(&common::fixture(name), &dir.path().join(name));
        let b = bundle.to_str().unwrap();
        let server = Server::start(&["--model", b], &[]);
        let prompt = "Edge devices run";
        for (flags, options) in [
            (vec!["--max-new-tokens", "12"], json!({"max_tokens": 12})),
            (
                vec![
                    "--max-new-tokens",
                    "12",
                    "--temperature",
                    "0.8",
                    "--top-p",
                    "0.9",
                    "--seed",
                    "7",
                ],
                json!({"max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7}),
            ),
        ] {
            let mut args = vec!["generate", "--model", b, "--prompt", prompt, "-q"];
            args.extend(&flags);
            let text = cli(&args);
            let text = text.strip_suffix('\n').unwrap();
            args.push("--ids");
            let ids = ids_of(&cli(&args));

            let mut body = options.clone();
            body["prompt"] = json!(prompt);
            body["stream"] = json!(true);
            let (got_ids, got_text, last) = streamed(&server, "/v1/completions", &body);
            assert_eq!(got_ids, ids, "{name} {options}: streamed token ids");
            assert_eq!(got_text, text, "{name} {options}: streamed text");
            let reason = last["choices"][0]["finish_reason"].as_str().unwrap();
            assert!(reason == "stop" || reason == "length", "{last}");
            assert_eq!(last["usage"]["completion_tokens"], ids.len());

            // Without streaming: the same completion in one answer.
            body["stream"] = json!(false);
            let whole = server.post("/v1/completions", &body.to_string());
            assert_eq!(whole.status, 200, "{}", whole.body);
            let whole = whole.json();
            assert_eq!(whole["choices"][0]["text"], text);
            assert_eq!(whole["object"], "text_completion");
        }

        // A chat is one prompt (`role: content` lines, then `assistant:`).
        let chat_prompt = "user: Hello there\nassistant:";
        let ids = ids_of(&cli(&[
            "generate",
            "--model",
            b,
            "--prompt",
            chat_prompt,
            "--max-new-tokens",
            "8",
            "--ids",
            "-q",
        ]));
        let body = json!({"model": "any", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, "stream": true});
        let (got, _, last) = streamed(&server, "/v1/chat/completions", &body);
        assert_eq!(got, ids, "{name}: chat tokens");
        assert_eq!(last["object"], "chat.completion.chunk");

        // A summarization on a decoder-only model says what to use instead.
        server
            .post("/v1/summarize", r#"{"documents": ["a"]}"#)
            .assert_error(
                400,
                "wrong_model",
                &["/v1/summarize", "decoder-only", "/v1/completions"],
            );
        // A prompt longer than the server takes (the fixtures' 256 positions) is refused.
        let long: Vec<i64> = vec![5; 300];
        server
            .post("/v1/completions", &json!({ "prompt": long }).to_string())
            .assert_error(
                400,
                "invalid_request",
                &["300 tokens", "--limit-input-tokens"],
            );
        // A prompt of ids outside the vocabulary is refused by name, not a crash.
        server
            .post("/v1/completions", r#"{"prompt": [1, 99999999]}"#)
            .assert_error(400, "invalid_request", &["99999999", "vocabulary"]);
    }
}

/// A server started with `--kv-cache int8` decodes with that cache: its completions equal
/// `generate --kv-cache int8`, on prompts where some differ from the f32 cache's, and `/stats`
/// names the format.
#[test]
fn a_servers_kv_cache_is_the_one_its_completions_use() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-olmoe"), &dir.path().join("b"));
    let b = bundle.to_str().unwrap();
    let server = Server::start(&["--model", b, "--kv-cache", "int8"], &[]);
    let mut differs = 0;
    for prompt in [
        "Edge devices run",
        "The cache holds",
        "Boards read flash",
        "One two three",
    ] {
        let generate = |format: &str| {
            ids_of(&cli(&[
                "generate",
                "--model",
                b,
                "--prompt",
                prompt,
                "--max-new-tokens",
                "24",
                "--kv-cache",
                format,
                "--ids",
                "-q",
            ]))
        };
        let (int8, f32) = (generate("int8"), generate("f32"));
        differs += usize::from(int8 != f32);
        let body = json!({"prompt": prompt, "max_tokens": 24, "stream": true});
        let (got, _, _) = streamed(&server, "/v1/completions", &body);
        assert_eq!(got, int8, "{prompt}: the server's tokens");
    }
    assert!(differs > 0, "no prompt tells the INT8 cache from f32");
    assert_eq!(server.get("/stats").json()["engine"]["kv_cache"], "int8");
}

#[test]
fn bad_requests_get_json_errors_naming_what_was_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-tied-e4"), dir.path());
    let b = bundle.to_str().unwrap();
    // The key from the environment.
    let server = Server::start(
        &[
            "--model",
            b,
            "--limit-body",
            "4096",
            "--limit-new-tokens",
            "64",
            "--limit-documents",
            "3",
        ],
        &[("EDGEMOE_API_KEY", "test-key")],
    );
    let ok = r#"{"documents": ["Anna: hi\nTom: hello"], "max_new_tokens": 4}"#;
    let post = |body: &str| server.request("POST", "/v1/summarize", &[KEY_HEADER], body);

    assert_eq!(server.get("/health").status, 200, "health needs no token");
    let missing = server.post("/v1/summarize", ok);
    missing.assert_error(401, "unauthorized", &["missing bearer token"]);
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    server
        .request(
            "POST",
            "/v1/summarize",
            &[("Authorization", "Bearer wrong")],
            ok,
        )
        .assert_error(401, "unauthorized", &["incorrect bearer token"]);
    server
        .get("/metrics")
        .assert_error(401, "unauthorized", &["bearer"]);

    let answered = post(ok);
    assert_eq!(answered.status, 200, "{}", answered.body);
    post(r#"{"documents": ["a"#).assert_error(400, "invalid_json", &["EOF"]);
    post(r#"{"documents": ["a"], "temperature": 0.5}"#).assert_error(
        400,
        "unknown_field",
        &["`temperature`"],
    );
    post(r#"{"docs": ["a"]}"#).assert_error(400, "unknown_field", &["`docs`"]);
    post(r#"{"max_new_tokens": 4}"#).assert_error(
        400,
        "invalid_json",
        &["missing field `documents`"],
    );
    post(r#"{"documents": "a"}"#).assert_error(400, "invalid_json", &["invalid type"]);
    post(r#"{"documents": []}"#).assert_error(400, "invalid_request", &["`documents` is empty"]);
    post(r#"{"documents": ["a", " "]}"#).assert_error(400, "invalid_request", &["`documents[1]`"]);
    post(r#"{"documents": ["a", "b", "c", "d"]}"#).assert_error(
        400,
        "limit_exceeded",
        &["4 documents", "--limit-documents"],
    );
    post(r#"{"documents": ["a"], "max_new_tokens": 1000}"#).assert_error(
        400,
        "limit_exceeded",
        &["1000", "--limit-new-tokens"],
    );
    post(r#"{"documents": ["a"], "beams": 64}"#).assert_error(
        400,
        "limit_exceeded",
        &["--limit-beams"],
    );
    let huge = json!({"documents": ["x".repeat(8000)]}).to_string();
    post(&huge).assert_error(413, "body_too_large", &["4096"]);
    server
        .request(
            "POST",
            "/v1/completions",
            &[KEY_HEADER],
            r#"{"prompt": "hi"}"#,
        )
        .assert_error(400, "wrong_model", &["encoder-decoder", "/v1/summarize"]);
    server
        .request(
            "POST",
            "/v1/chat/completions",
            &[KEY_HEADER],
            r#"{"messages": []}"#,
        )
        .assert_error(400, "wrong_model", &["/v1/summarize"]);
    server
        .request("GET", "/v1/nothing", &[KEY_HEADER], "")
        .assert_error(404, "not_found", &["/v1/summarize"]);
    // Every refusal was counted; none reached the engine.
    assert_eq!(
        server.metric("edgemoe_requests_total{endpoint=\"/v1/summarize\",status=\"200\"}"),
        None,
        "metrics need the key"
    );
    let metrics = server.request("GET", "/metrics", &[KEY_HEADER], "").body;
    assert!(
        metrics.contains("edgemoe_requests_total{endpoint=\"/v1/summarize\",status=\"200\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("edgemoe_requests_total{endpoint=\"/v1/summarize\",status=\"413\"} 1"),
        "{metrics}"
    );
}

/// The tiny Mixtral behind emulated hard-disk reads (see the module header).
fn slow_server(dir: &Path, extra: &[&str]) -> Server {
    let bundle = dir.join("bundle");
    if !bundle.exists() {
        common::convert_to(&common::fixture("tiny-mixtral"), dir);
    }
    let mut args = vec!["--model", bundle.to_str().unwrap()];
    args.extend(SLOW_STORAGE);
    args.extend(["--no-prefetch", "--buffer-experts", "2", "--budget", "1GiB"]);
    args.extend(extra);
    Server::start(&args, &[])
}

/// Expert reads paced to a hard disk: requests long enough to cancel, time out or queue behind.
const SLOW_STORAGE: [&str; 6] = [
    "--profile",
    "jetson-tx2-hdd",
    "--device",
    "cpu",
    "--storage",
    "emulate",
];

const LONG_STREAM: &str = r#"{"prompt": "Edge devices run", "max_tokens": 200, "stream": true}"#;
const LONG: &str = r#"{"prompt": "Edge devices run", "max_tokens": 200}"#;

#[test]
fn a_full_queue_answers_503_and_a_client_that_leaves_is_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = slow_server(dir.path(), &["--queue", "1", "--api-key", "test-key"]);
    server.auth = vec![(KEY_HEADER.0.into(), KEY_HEADER.1.into())];
    let auth = [KEY_HEADER];
    let running = "edgemoe_requests_running";
    let depth = "edgemoe_queue_depth";
    let disconnects = "edgemoe_requests_cancelled_total{reason=\"disconnect\"}";

    // One request runs, one waits: the queue (of 1) is full.
    let mut first = server.send("POST", "/v1/completions", &auth, LONG_STREAM);
    let head = read_events(&mut first, 3);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut second = server.send("POST", "/v1/completions", &auth, LONG_STREAM);
    server.wait_metric(depth, 1.0, 30);
    let refused = server.request("POST", "/v1/completions", &auth, LONG);
    refused.assert_error(503, "queue_full", &["queue is full", "--queue"]);
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "Retry-After: {retry}");
    assert_eq!(server.metric(running), Some(1.0));

    // The running request's client leaves: the engine stops at its next token (a token takes
    // about 60 ms; the whole request would take seconds more) and takes the waiting one.
    let tokens_seen = head.matches("data: ").count();
    let left = Instant::now();
    drop(first);
    server.wait_metric(disconnects, 1.0, 30);
    let stopped_after = left.elapsed();
    assert!(
        stopped_after < Duration::from_secs(4),
        "cancelled {stopped_after:?} after the client left ({tokens_seen} tokens of 200 sent)"
    );
    server.wait_metric(depth, 0.0, 10);
    let next = read_events(&mut second, 2);
    assert!(next.starts_with("HTTP/1.1 200"), "{next}");

    // A client waiting for a whole (non-streamed) answer leaves too.
    drop(second);
    server.wait_metric(disconnects, 2.0, 10);
    server.wait_metric(running, 0.0, 10);
    let third = server.send("POST", "/v1/completions", &auth, LONG);
    server.wait_metric(running, 1.0, 10);
    std::thread::sleep(Duration::from_millis(300));
    let left = Instant::now();
    drop(third);
    server.wait_metric(disconnects, 3.0, 30);
    assert!(
        left.elapsed() < Duration::from_secs(4),
        "{:?}",
        left.elapsed()
    );
    server.wait_metric(running, 0.0, 10);

    // The engine is free again and answers in full.
    let short = server.request(
        "POST",
        "/v1/completions",
        &auth,
        r#"{"prompt": "Edge", "max_tokens": 3}"#,
    );
    assert_eq!(short.status, 200, "{}", short.body);
    assert_eq!(
        server.metric("edgemoe_requests_total{endpoint=\"/v1/completions\",status=\"503\"}"),
        Some(1.0)
    );
}

#[test]
fn a_deadline_answers_504_and_sigterm_finishes_running_work_then_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = slow_server(
        dir.path(),
        &["--request-timeout", "2", "--shutdown-grace", "30"],
    );
    let started = Instant::now();
    server.post("/v1/completions", LONG).assert_error(
        504,
        "deadline_exceeded",
        &["--request-timeout"],
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        server.metric("edgemoe_requests_cancelled_total{reason=\"deadline\"}"),
        Some(1.0)
    );

    // SIGTERM while a request streams: it is finished, then the server exits 0.
    let mut streaming = server.send(
        "POST",
        "/v1/completions",
        &[],
        r#"{"prompt": "Edge devices run", "max_tokens": 16, "stream": true}"#,
    );
    let head = read_events(&mut streaming, 2);
    server.signal(libc::SIGTERM);
    // No new request is taken: the listener is closed (or, racing it, the answer is a 503).
    std::thread::sleep(Duration::from_millis(300));
    if let Ok(mut late) = std::net::TcpStream::connect(&server.addr) {
        use std::io::Write;
        late.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = late.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut answer = String::new();
        let _ = late.read_to_string(&mut answer);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 503"),
            "a request after SIGTERM was answered: {answer}"
        );
    }
    let mut rest = Vec::new();
    streaming.read_to_end(&mut rest).unwrap();
    let whole = format!("{head}{}", String::from_utf8_lossy(&rest));
    let response = common::http::Response::parse(whole.as_bytes());
    let events = response.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(
        events.len(),
        16 + 2,
        "16 tokens, the last chunk and [DONE]: {events:?}"
    );
    let status = server.wait_exit(30);
    assert_eq!(status.code(), Some(0), "stderr: {}", server.stderr());
    assert!(server.stderr().contains("stopping"), "{}", server.stderr());
}

#[test]
fn sigterm_past_the_grace_period_cancels_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = slow_server(dir.path(), &["--shutdown-grace", "0.5"]);
    let mut streaming = server.send("POST", "/v1/completions", &[], LONG_STREAM);
    let head = read_events(&mut streaming, 2);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    let mut rest = Vec::new();
    streaming.read_to_end(&mut rest).unwrap();
    let whole = format!("{head}{}", String::from_utf8_lossy(&rest));
    let events = common::http::Response::parse(whole.as_bytes()).events();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(
        last["error"]["type"],
        "shutting_down",
        "the stream should end with an error event; its last events: {:?}",
        &events[events.len().saturating_sub(3)..]
    );
    assert!(
        events.len() < 150,
        "cancelled long before its 200 tokens: {}",
        events.len()
    );
    let status = server.wait_exit(20);
    assert_eq!(status.code(), Some(0), "stderr: {}", server.stderr());
    assert!(
        signalled.elapsed() < Duration::from_secs(8),
        "{:?}",
        signalled.elapsed()
    );
}

/// The demo model behind emulated hard-disk reads: a document takes about a second.
fn slow_demo_server(dir: &Path, extra: &[&str]) -> Server {
    let bundle = common::convert_to(&common::demo_checkpoint(), dir);
    let mut args = vec!["--model", bundle.to_str().unwrap()];
    args.extend(SLOW_STORAGE);
    args.extend(extra);
    Server::spawn(&args, &[])
}

#[test]
fn a_summary_whose_client_leaves_is_cancelled_running_or_queued() {
    let dir = tempfile::tempdir().unwrap();
    let server = slow_demo_server(
        dir.path(),
        &["--no-prefetch", "--buffer-experts", "2", "--queue", "1"],
    );
    server.wait_healthy(Duration::from_secs(120));
    // Twelve documents: many seconds of work, with no token sent back until the end.
    let documents: Vec<String> = (0..4).flat_map(|_| dialogues()).collect();
    let body = json!({"documents": documents, "max_new_tokens": 60}).to_string();
    let running = server.send("POST", "/v1/summarize", &[], &body);
    server.wait_metric("edgemoe_requests_running", 1.0, 30);
    let queued = server.send("POST", "/v1/summarize", &[], &body);
    server.wait_metric("edgemoe_queue_depth", 1.0, 30);
    std::thread::sleep(Duration::from_millis(300));

    // Both clients leave: the running summary stops at its next token, the queued one never
    // starts.
    let left = Instant::now();
    drop(queued);
    drop(running);
    server.wait_metric(
        "edgemoe_requests_cancelled_total{reason=\"disconnect\"}",
        2.0,
        60,
    );
    server.wait_metric("edgemoe_requests_running", 0.0, 10);
    assert!(
        left.elapsed() < Duration::from_secs(4),
        "both cancelled only {:?} after their clients left",
        left.elapsed()
    );
    assert_eq!(server.metric("edgemoe_queue_depth"), Some(0.0));
    assert_eq!(
        server.metric("edgemoe_requests_total{endpoint=\"/v1/summarize\",status=\"200\"}"),
        None,
        "no summary was finished"
    );
}

#[test]
fn health_answers_503_while_the_model_loads_and_a_failed_load_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    // `io-free` reads every expert at load: paced to a hard disk, that takes a second or two.
    let server = slow_demo_server(dir.path(), &["--mode", "io-free"]);
    let health = server.get("/health");
    assert_eq!(health.status, 503, "{}", health.body);
    assert_eq!(health.json()["status"], "loading");
    let early = server.post("/v1/summarize", r#"{"documents": ["Anna: hi"]}"#);
    early.assert_error(503, "loading", &["still loading", "/health"]);
    assert!(early.header("retry-after").is_some());
    server.wait_healthy(Duration::from_secs(120));
    assert_eq!(server.get("/health").json()["status"], "ok");
    assert_eq!(
        server
            .post(
                "/v1/summarize",
                r#"{"documents": ["Anna: hi\nTom: hello"], "max_new_tokens": 4}"#
            )
            .status,
        200
    );

    // A model that cannot load (the budget is too small) ends the server with its error.
    let bundle = dir.path().join("bundle");
    let out = common::cli::run_within(
        &[
            "serve",
            "--model",
            bundle.to_str().unwrap(),
            "--port",
            "0",
            "--budget",
            "1MiB",
        ],
        60,
    );
    common::cli::assert_fails(&out, &["memory budget", "too small"]);
}

#[test]
fn flags_are_checked_and_a_busy_port_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = common::convert_to(&common::fixture("tiny-tied-e4"), dir.path());
    let b = bundle.to_str().unwrap();
    for (flag, value, needle) in [
        ("--queue", "0", "at least 1"),
        ("--request-timeout", "0", "number of seconds"),
        ("--shutdown-grace", "never", "number of seconds"),
        ("--limit-body", "lots", "--limit-body"),
        ("--port", "70000", "--port"),
    ] {
        let out = common::cli::run(&["serve", "--model", b, flag, value], None);
        common::cli::assert_usage(&out, &[needle]);
    }
    let out = common::cli::run(&["serve", "--model", b, "--api-key", " spaced "], None);
    common::cli::assert_usage(&out, &["whitespace"]);
    // An empty key asked for is not a server without one (bounded: such a server would run).
    let out = common::cli::run_within(&["serve", "--model", b, "--port", "0", "--api-key", ""], 60);
    common::cli::assert_usage(&out, &["--api-key is empty"]);
    let out = common::cli::run_within_env(
        &["serve", "--model", b, "--port", "0"],
        &[("EDGEMOE_API_KEY", "")],
        60,
    );
    common::cli::assert_usage(&out, &["EDGEMOE_API_KEY is set but empty"]);

    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let out = common::cli::run_within(&["serve", "--model", b, "--port", &port], 60);
    common::cli::assert_fails(&out, &[&format!("127.0.0.1:{port}"), "in use"]);
    let out = common::cli::run_within(&["serve", "--model", "/nonexistent/bundle"], 60);
    common::cli::assert_fails(&out, &["/nonexistent/bundle"]);
}
