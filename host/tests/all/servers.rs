//! Real storage servers for the tests, each test starting its own on a
//! loopback port: moto (S3, and GCS through object_store's GCS client) and
//! azurite (Azure Blob). And a loopback TCP proxy that can cut every
//! connection, to take a server away in the middle of an upload.
//!
//! The servers are found through `TRAINHOST_MOTO_SERVER` (path of
//! `moto_server`) and `TRAINHOST_AZURITE_BLOB` (path of `azurite-blob`), or
//! on `PATH`. A test whose server is missing is skipped with a message
//! naming the variable, unless `TRAINHOST_REQUIRE_STORAGE_SERVERS=1` (CI),
//! where it fails.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use trainhost::StorageOptions;

const REQUIRE: &str = "TRAINHOST_REQUIRE_STORAGE_SERVERS";
const AZURITE_ACCOUNT: &str = "devstoreaccount1";
/// Azurite's published development key.
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A server process, killed when dropped.
pub struct Server {
    child: Child,
    pub port: u16,
    _workdir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find(var: &str, name: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(var) {
        return Some(PathBuf::from(path));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

fn missing(var: &str, what: &str) -> Option<Server> {
    let message = format!("{what} not found: set {var} to its path (or put it on PATH)");
    if std::env::var(REQUIRE).is_ok_and(|v| v == "1") {
        panic!("{message}; {REQUIRE}=1 makes a missing server a failure");
    }
    eprintln!("skipped: {message}");
    None
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_ready(child: &mut Child, port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("{what} exited ({status}) before listening: {err}");
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on port {port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// moto's server on a free loopback port.
pub fn moto() -> Option<Server> {
    start_moto(&[])
}

/// moto's server on a free loopback port, over HTTPS with a certificate
/// it makes up (clients must accept an invalid certificate).
pub fn moto_tls() -> Option<Server> {
    start_moto(&["--ssl"])
}

fn start_moto(extra: &[&str]) -> Option<Server> {
    let Some(bin) = find("TRAINHOST_MOTO_SERVER", "moto_server") else {
        return missing(
            "TRAINHOST_MOTO_SERVER",
            "moto_server (pip install \"moto[server]\")",
        );
    };
    let port = free_port();
    let workdir = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .args(extra)
        .current_dir(workdir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_ready(&mut child, port, "moto_server");
    Some(Server {
        child,
        port,
        _workdir: workdir,
    })
}

/// azurite's blob service on a free loopback port, keeping its data on
/// disk, with telemetry off (it would otherwise call out of the machine).
pub fn azurite() -> Option<Server> {
    let Some(bin) = find("TRAINHOST_AZURITE_BLOB", "azurite-blob") else {
        return missing(
            "TRAINHOST_AZURITE_BLOB",
            "azurite-blob (npm install azurite)",
        );
    };
    let port = free_port();
    let workdir = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin)
        .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
        .arg("--location")
        .arg(workdir.path())
        .args(["--skipApiVersionCheck", "--disableTelemetry", "--silent"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_ready(&mut child, port, "azurite-blob");
    Some(Server {
        child,
        port,
        _workdir: workdir,
    })
}

/// Send one HTTP/1.1 request and return the status code.
fn http(port: u16, request: &str) -> u16 {
    http_response(port, request).0
}

/// Send one HTTP/1.1 request and return the status code and the whole
/// response.
fn http_response(port: u16, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    let _ = s.read_to_string(&mut response);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad HTTP response: {response}"));
    (status, response)
}

/// How many multipart uploads were started and neither completed nor
/// aborted in `bucket` on the moto server `port` (their parts stay in the
/// store).
pub fn incomplete_uploads(port: u16, bucket: &str) -> usize {
    let (status, response) = http_response(
        port,
        &format!("GET /{bucket}?uploads HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
    );
    assert_eq!(
        status, 200,
        "listing the multipart uploads of {bucket}: {response}"
    );
    response.matches("<Upload>").count()
}

/// A storage location and the options that reach it.
pub struct Backend {
    pub url: String,
    pub options: StorageOptions,
}

/// A new bucket on the moto server `server_port`, reached at
/// `endpoint_port`; the location's prefix is `runs`.
pub fn s3(server_port: u16, endpoint_port: u16, bucket: &str) -> Backend {
    let status = http(
        server_port,
        &format!(
            "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    );
    assert_eq!(status, 200, "creating bucket {bucket}");
    s3_existing(endpoint_port, bucket)
}

/// An existing bucket reached at `endpoint_port`. moto accepts any keys;
/// dummy ones keep the client from looking for real credentials.
pub fn s3_existing(endpoint_port: u16, bucket: &str) -> Backend {
    s3_at(
        bucket,
        &format!("http://127.0.0.1:{endpoint_port}"),
        ("aws_allow_http", "true"),
    )
}

/// A bucket at `endpoint`, with the option its transport needs.
fn s3_at(bucket: &str, endpoint: &str, transport: (&str, &str)) -> Backend {
    Backend {
        url: format!("s3://{bucket}/runs"),
        options: options(&[
            ("aws_endpoint", endpoint),
            transport,
            ("aws_region", "us-east-1"),
            ("aws_access_key_id", "test"),
            ("aws_secret_access_key", "test"),
        ]),
    }
}

/// A new bucket on the moto server `server` started by [`moto_tls`],
/// reached over HTTPS with default payload signing.
pub fn s3_tls(server: &Server, bucket: &str) -> Backend {
    // The bucket is made with Python's standard library, which speaks
    // TLS without verifying the made-up certificate.
    let port = server.port;
    let made = Command::new("python3")
        .args([
            "-c",
            &format!(
                "import http.client, ssl\n\
                 c = http.client.HTTPSConnection('127.0.0.1', {port}, context=ssl._create_unverified_context())\n\
                 c.request('PUT', '/{bucket}')\n\
                 assert c.getresponse().status == 200"
            ),
        ])
        .status()
        .expect("python3 runs");
    assert!(made.success(), "creating bucket {bucket} over HTTPS");
    s3_at(
        bucket,
        &format!("https://127.0.0.1:{port}"),
        ("allow_invalid_certificates", "true"),
    )
}

/// A new bucket on the moto server, reached with object_store's GCS
/// client (moto serves the GCS XML and JSON paths the client uses; this
/// covers trainhost's GCS configuration and request flow, not Google's
/// own service).
pub fn gcs(server: &Server, bucket: &str) -> Backend {
    s3(server.port, server.port, bucket);
    Backend {
        url: format!("gs://{bucket}/runs"),
        options: options(&[
            (
                "google_base_url",
                &format!("http://127.0.0.1:{}", server.port),
            ),
            ("google_bearer_token", "test"),
            ("allow_http", "true"),
        ]),
    }
}

/// A new container on the azurite server `server_port`, reached at
/// `endpoint_port`.
pub fn azure(server_port: u16, endpoint_port: u16, container: &str) -> Backend {
    let date = httpdate();
    let version = "2021-08-06";
    let to_sign = format!(
        "PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{container}\nrestype:container"
    );
    let signature = base64_encode(&hmac_sha256(
        &base64_decode(AZURITE_KEY),
        to_sign.as_bytes(),
    ));
    let status = http(
        server_port,
        &format!(
            "PUT /{AZURITE_ACCOUNT}/{container}?restype=container HTTP/1.1\r\nHost: 127.0.0.1\r\nx-ms-date: {date}\r\nx-ms-version: {version}\r\nAuthorization: SharedKey {AZURITE_ACCOUNT}:{signature}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    );
    assert_eq!(status, 201, "creating container {container}");
    azure_existing(endpoint_port, container)
}

/// An existing container reached at `endpoint_port`.
pub fn azure_existing(endpoint_port: u16, container: &str) -> Backend {
    Backend {
        url: format!("az://{container}/runs"),
        options: options(&[
            ("azure_storage_account_name", AZURITE_ACCOUNT),
            ("azure_storage_account_key", AZURITE_KEY),
            (
                "azure_storage_endpoint",
                &format!("http://127.0.0.1:{endpoint_port}/{AZURITE_ACCOUNT}"),
            ),
            ("allow_http", "true"),
        ]),
    }
}

fn options(pairs: &[(&str, &str)]) -> StorageOptions {
    StorageOptions {
        options: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        // Fail fast when a test takes the server away.
        max_retries: 4,
        retry_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(20),
        ..StorageOptions::default()
    }
}

/// RFC 1123 date for the `x-ms-date` header.
fn httpdate() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][days.rem_euclid(7) as usize];
    let month_name = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ][month as usize - 1];
    format!(
        "{weekday}, {day:02} {month_name} {year} {:02}:{:02}:{:02} GMT",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .to_vec()
}

const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|c| *c != b'=') {
        acc = acc << 6 | B64.iter().position(|b| *b == c).unwrap() as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// A TCP proxy on loopback in front of a server. After `budget` bytes from
/// clients, or on [`Proxy::cut`], it drops every connection and refuses
/// new ones, as a server that went away; [`Proxy::restore`] brings it back.
pub struct Proxy {
    pub port: u16,
    state: Arc<ProxyState>,
}

struct ProxyState {
    down: AtomicBool,
    budget: AtomicI64,
    /// How long a cut lasts; `None` until restored.
    outage: Option<Duration>,
    /// How many times it was cut.
    cuts: std::sync::atomic::AtomicU64,
    /// Bytes clients sent through the proxy.
    sent: std::sync::atomic::AtomicU64,
    live: Mutex<Vec<TcpStream>>,
    /// What clients sent, a buffer per connection, when recording.
    recorded: Option<Mutex<Vec<Recording>>>,
}

/// The bytes a client sent on one connection.
type Recording = Arc<Mutex<Vec<u8>>>;

impl ProxyState {
    fn cut(self: &Arc<Self>) {
        if self.down.swap(true, Ordering::SeqCst) {
            return;
        }
        self.cuts.fetch_add(1, Ordering::SeqCst);
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(outage) = self.outage {
            let state = Arc::clone(self);
            std::thread::spawn(move || {
                std::thread::sleep(outage);
                state.budget.store(i64::MAX, Ordering::SeqCst);
                state.down.store(false, Ordering::SeqCst);
            });
        }
    }
}

impl Proxy {
    /// Forward to `upstream`; cut after `budget` bytes from clients and stay
    /// down until [`Proxy::restore`].
    pub fn start(upstream: u16, budget: i64) -> Self {
        Self::start_with_outage(upstream, budget, None)
    }

    /// Forward to `upstream`; cut after `budget` bytes from clients, and
    /// with `outage` come back by itself that long after.
    ///
    /// Down, it resets every connection and closes its listening socket, so
    /// that new connections are refused, as by a server that is gone.
    pub fn start_with_outage(upstream: u16, budget: i64, outage: Option<Duration>) -> Self {
        Self::launch(upstream, budget, outage, false)
    }

    /// Forward to `upstream`, never cut, keeping every byte clients send
    /// for [`Proxy::recorded`].
    pub fn recording(upstream: u16) -> Self {
        Self::launch(upstream, i64::MAX, None, true)
    }

    /// What clients sent so far, one buffer per connection in the order
    /// they connected.
    pub fn recorded(&self) -> Vec<Vec<u8>> {
        let recorded = self.state.recorded.as_ref().expect("a recording proxy");
        let connections = recorded.lock().unwrap();
        connections
            .iter()
            .map(|c| c.lock().unwrap().clone())
            .collect()
    }

    fn launch(upstream: u16, budget: i64, outage: Option<Duration>, record: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(ProxyState {
            down: AtomicBool::new(false),
            budget: AtomicI64::new(budget),
            sent: Default::default(),
            live: Mutex::new(Vec::new()),
            recorded: record.then(Mutex::default),
            outage,
            cuts: Default::default(),
        });
        let st = Arc::clone(&state);
        std::thread::spawn(move || {
            let mut listener = Some(listener);
            loop {
                if st.down.load(Ordering::SeqCst) {
                    listener = None;
                    while st.down.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                let l = listener.get_or_insert_with(|| {
                    let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
                    l.set_nonblocking(true).unwrap();
                    l
                });
                let client = match l.accept() {
                    Ok((client, _)) => client,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                {
                    let mut live = st.live.lock().unwrap();
                    if st.down.load(Ordering::SeqCst) {
                        // Cut while this one was being accepted.
                        let _ = client.shutdown(Shutdown::Both);
                        let _ = server.shutdown(Shutdown::Both);
                        continue;
                    }
                    live.push(client.try_clone().unwrap());
                    live.push(server.try_clone().unwrap());
                }
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let up = Arc::clone(&st);
                let record = st.recorded.as_ref().map(|r| {
                    let buffer = Arc::default();
                    r.lock().unwrap().push(Arc::clone(&buffer));
                    buffer
                });
                std::thread::spawn(move || pipe(client, server, Some(up), record));
                std::thread::spawn(move || pipe(s2, c2, None, None));
            }
        });
        Self { port, state }
    }

    /// Bring it back, with no budget limit.
    pub fn restore(&self) {
        self.state.budget.store(i64::MAX, Ordering::SeqCst);
        self.state.down.store(false, Ordering::SeqCst);
    }

    /// Bytes clients have sent through the proxy so far.
    pub fn sent(&self) -> u64 {
        self.state.sent.load(Ordering::SeqCst)
    }

    /// How many times it was cut.
    pub fn cuts(&self) -> u64 {
        self.state.cuts.load(Ordering::SeqCst)
    }

    /// Whether the budget ran out (or it was cut).
    pub fn is_down(&self) -> bool {
        self.state.down.load(Ordering::SeqCst)
    }
}

fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    budget: Option<Arc<ProxyState>>,
    record: Option<Recording>,
) {
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(state) = &budget {
            // Gone, the server must not answer what it got of a request:
            // a half-close would let it see a truncated body and reply
            // `400 Bad Request` to a client that is still connected, which
            // a server that went away never does.
            let gone = state.down.load(Ordering::SeqCst) || {
                state.sent.fetch_add(n as u64, Ordering::SeqCst);
                let spent = state.budget.fetch_sub(n as i64, Ordering::SeqCst) < n as i64;
                if spent {
                    state.cut();
                }
                spent
            };
            if gone {
                let _ = from.shutdown(Shutdown::Both);
                let _ = to.shutdown(Shutdown::Both);
                return;
            }
        }
        if let Some(record) = &record {
            record.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn the_test_helpers_encode_like_the_references() {
    assert_eq!(base64_encode(b"hello"), "aGVsbG8=");
    assert_eq!(base64_decode("aGVsbG8="), b"hello");
    assert_eq!(
        base64_decode(&base64_encode(&[0, 255, 7, 9])),
        [0, 255, 7, 9]
    );
    // RFC 4231 test case 2.
    let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
    assert_eq!(
        mac.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
    assert!(httpdate().ends_with(" GMT"));
}
