//! S3 request signing as it reaches the server: every request's signed
//! payload digest is the SHA-256 of the body actually sent, for files sent
//! in one request (signed with the digest the manifest records, whether
//! the body is one buffer or several) and for multipart uploads' parts
//! alike, whether computed as the file is sent or when it was hashed
//! before (to look for it among stored files). Read from the bytes the host sent
//! through a recording proxy to moto, which does not check them itself.

use serde_json::json;
use sha2::{Digest, Sha256};
use trainhost::{RunConfig, Trainer};

use crate::servers::{self, Proxy};
use crate::util::*;

/// Sent in one request of one buffer (up to one part's size, 8 MiB).
const ONE_REQUEST: usize = 5_000_000;
/// Sent in one request read into three buffers (up to 32 MiB).
const BUFFERS: usize = 20_000_000;
/// Larger than one request: a multipart upload.
const MULTIPART: usize = 40_000_000;

/// One HTTP/1.1 request: its request line, headers (names in lower case)
/// and body.
struct Request<'a> {
    line: String,
    headers: Vec<(String, String)>,
    body: &'a [u8],
}

impl Request<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The whole requests in the bytes a client sent on one connection (a
/// request cut off at the end is left out).
fn requests(mut stream: &[u8]) -> Vec<Request<'_>> {
    let mut out = Vec::new();
    while let Some(end) = stream.windows(4).position(|w| w == b"\r\n\r\n") {
        let head = std::str::from_utf8(&stream[..end]).expect("HTTP headers are text");
        let mut lines = head.split("\r\n");
        let line = lines.next().unwrap().to_owned();
        let headers: Vec<(String, String)> = lines
            .map(|l| {
                let (k, v) = l.split_once(':').expect("a header line");
                (k.trim().to_ascii_lowercase(), v.trim().to_owned())
            })
            .collect();
        assert!(
            !headers.iter().any(|(k, _)| k == "transfer-encoding"),
            "{line}: bodies are sent with a length"
        );
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .map_or(0, |(_, v)| v.parse().unwrap());
        let start = end + 4;
        if stream.len() < start + len {
            break;
        }
        let body = &stream[start..start + len];
        out.push(Request {
            line,
            headers,
            body,
        });
        stream = &stream[start + len..];
    }
    out
}

#[test]
fn every_signed_payload_digest_is_the_sha256_of_the_bytes_sent() {
    let Some(moto) = servers::moto() else { return };
    servers::s3(moto.port, moto.port, "signed");
    let proxy = Proxy::recording(moto.port);
    let backend = servers::s3_existing(proxy.port, "signed");
    let steps = json!([
        {"write": "ck/small", "text": "a few bytes"},
        {"write": "ck/one-request.bin", "bytes": ONE_REQUEST, "seed": 1},
        {"write": "ck/buffers.bin", "bytes": BUFFERS, "seed": 3},
        {"write": "ck/multipart.bin", "bytes": MULTIPART, "seed": 2},
        {"report": {"epoch": 0}, "checkpoint": "ck"},
        // The next checkpoint changes the large file, keeping its size: it
        // is hashed before its upload to look for it among the first
        // checkpoint's files, its parts' digests with it.
        {"write": "ck/multipart.bin", "bytes": MULTIPART, "seed": 4},
        {"report": {"epoch": 1}, "checkpoint": "ck"},
    ]);
    let result = Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps }))
        .run_config(RunConfig {
            name: Some("s".into()),
            storage_path: backend.url.clone(),
            storage_options: backend.options.clone(),
            ..Default::default()
        })
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);

    let recorded = proxy.recorded();
    let all: Vec<Request> = recorded.iter().flat_map(|c| requests(c)).collect();
    let mut signed = 0;
    for r in &all {
        let declared = r
            .header("x-amz-content-sha256")
            .unwrap_or_else(|| panic!("{}: not signed", r.line));
        assert_eq!(
            declared,
            hex::encode(Sha256::digest(r.body)),
            "{}: the signed digest is not the body's ({} bytes)",
            r.line,
            r.body.len()
        );
        signed += 1;
    }
    let puts = |f: &dyn Fn(&Request) -> bool| {
        all.iter()
            .filter(|r| r.line.starts_with("PUT ") && f(r))
            .count()
    };
    assert_eq!(
        puts(&|r| r.body.len() == ONE_REQUEST && !r.line.contains("partNumber=")),
        1,
        "the {ONE_REQUEST}-byte file goes up in one request"
    );
    assert_eq!(
        puts(&|r| r.body.len() == BUFFERS && !r.line.contains("partNumber=")),
        1,
        "the {BUFFERS}-byte file goes up in one request"
    );
    assert_eq!(
        puts(&|r| r.line.contains("partNumber=")),
        2 * MULTIPART.div_ceil(8 << 20),
        "the {MULTIPART}-byte file goes up in 8 MiB parts, twice"
    );
    assert!(signed > 5, "only {signed} requests seen");

    let listed =
        trainhost::committed_checkpoints_with(&format!("{}/s", backend.url), &backend.options)
            .unwrap();
    assert_eq!(listed.len(), 2);
    listed.iter().for_each(|c| c.verify().unwrap());
}
