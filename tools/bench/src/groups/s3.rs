//! Uploading to S3 against `aws s3 cp`.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use trainhost::bench::Durability;
use trainhost::{RunConfig, StorageOptions};

use crate::common::{
    Paired, Row, Sampling, describe, local_run, self_cpu, size_name, time_command,
};
use crate::goals;
use crate::groups::blocked::{Target, measure};

/// A moto S3 server on loopback, stopped on drop.
struct Moto(std::process::Child, u16);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// moto on a free loopback port; over HTTPS with a certificate it makes
/// up if `tls`.
fn start_moto(tls: bool) -> Result<Moto> {
    let bin = std::env::var("TRAINHOST_MOTO_SERVER")
        .context("TRAINHOST_MOTO_SERVER is not set (scripts/bench.sh installs moto)")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(&bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .args(tls.then_some("--ssl"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {bin}"))?;
    let moto = Moto(child, port);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("moto did not start on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(moto)
}

pub(crate) fn s3(quick: bool) -> Result<Vec<Row>> {
    let aws = std::env::var("TRAINHOST_AWS_CLI")
        .context("TRAINHOST_AWS_CLI is not set (scripts/bench.sh installs the AWS CLI v1)")?;
    let bucket = "bench";
    // SAFETY: set before any thread of ours reads the environment.
    for (k, v) in [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ] {
        unsafe { std::env::set_var(k, v) };
    }
    // About 30 s a sample of every row.
    let reps = Sampling::Standard.per_pass(quick);
    let uploader = Uploader::start(&aws, bucket, false)?;
    let options = &uploader.options;
    // Files of several pooled buffers sent in one request each, signed
    // with the digest the manifest records; small files; and files above
    // what one request takes (`trainhost::bench::SINGLE_REQUEST_AT_MOST`),
    // sent in parts, each signed over plain HTTP with its own digest
    // (computed in the pass that hashes the file).
    let (mut rows, work) = uploader.rows(&[(if quick { 2 } else { 8 }, 16 << 20)], "big", reps)?;
    rows.extend(
        uploader
            .rows(&[(if quick { 16 } else { 128 }, 1 << 20)], "small", reps)?
            .0,
    );
    let above = 2 * trainhost::bench::SINGLE_REQUEST_AT_MOST;
    rows.extend(uploader.rows(&[(2, above)], "parts", reps)?.0);
    rows.extend(over_https(&aws, bucket, if quick { 2 } else { 8 }, reps)?);
    let blocked_runs = std::sync::atomic::AtomicUsize::new(0);
    // How long a guest waits in `report` when the checkpoint goes to S3.
    let s3_run = |i: usize| -> Result<(RunConfig, Box<dyn std::any::Any>)> {
        let run = RunConfig {
            storage_path: format!(
                "s3://{bucket}/blocked-{i}-{}",
                blocked_runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            storage_options: options.clone(),
            ..local_run(work.path())
        };
        Ok((run, Box::new(())))
    };
    let shares = format!(
        "files of {} or more copied by the server, smaller ones sent again",
        size_name(trainhost::bench::COPY_AT_LEAST)
    );
    let target = Target {
        name: "S3",
        shares: &shares,
        run: &s3_run,
    };
    let blocked_rows = measure(&target, 64 << 20, reps)?;
    rows.extend(blocked_rows);
    Ok(rows)
}

/// The multipart rows again over HTTPS, where both sides leave payloads
/// unsigned by default (TLS guards them) and pay for encryption.
fn over_https(aws: &str, bucket: &str, files: u32, reps: usize) -> Result<Vec<Row>> {
    let uploader = Uploader::start(aws, bucket, true)?;
    Ok(uploader.rows(&[(files, 16 << 20)], "big-tls", reps)?.0)
}

/// Uploads to one bucket of a moto server of its own, by the AWS CLI and
/// by the host.
struct Uploader<'a> {
    aws: &'a str,
    endpoint: String,
    /// More arguments for the AWS CLI.
    aws_args: &'static [&'static str],
    bucket: &'a str,
    options: StorageOptions,
    /// How the rows name the transport, if not plain HTTP.
    over: &'static str,
    _moto: Moto,
}

impl<'a> Uploader<'a> {
    /// Start moto (over HTTPS if `tls`) and make `bucket` there.
    fn start(aws: &'a str, bucket: &'a str, tls: bool) -> Result<Self> {
        let moto = start_moto(tls)?;
        let scheme = if tls { "https" } else { "http" };
        let endpoint = format!("{scheme}://127.0.0.1:{}", moto.1);
        // moto's certificate is made up: neither side may verify it.
        let (aws_args, transport): (&'static [&'static str], _) = if tls {
            (&["--no-verify-ssl"], "allow_invalid_certificates")
        } else {
            (&[], "allow_http")
        };
        time_command(
            Command::new(aws)
                .args(["s3", "mb", &format!("s3://{bucket}"), "--endpoint-url"])
                .arg(&endpoint)
                .args(aws_args),
        )?;
        let options = StorageOptions {
            options: vec![
                ("aws_endpoint".into(), endpoint.clone()),
                (transport.into(), "true".into()),
            ],
            ..StorageOptions::default()
        };
        Ok(Self {
            aws,
            endpoint,
            aws_args,
            bucket,
            options,
            over: if tls { ", HTTPS" } else { "" },
            _moto: moto,
        })
    }
}

impl Uploader<'_> {
    /// The wall and CPU rows for uploading files of `layout`, alternately
    /// by `aws s3 cp` and by the host, `reps` times each (under keys
    /// starting with `tag`); and the directory holding the files.
    fn rows(
        &self,
        layout: &[(u32, u64)],
        tag: &str,
        reps: usize,
    ) -> Result<(Vec<Row>, tempfile::TempDir)> {
        let work = tempfile::tempdir()?;
        trainhost_bench_kernel::write_layout(work.path(), layout, 1)?;
        let (mut wall_pairs, mut cpu_pairs) = (Paired::default(), Paired::default());
        for i in 0..reps {
            let (wall, cpu) = time_command(
                Command::new(self.aws)
                    .args(["s3", "cp", "--recursive", "--quiet"])
                    .arg(work.path())
                    .arg(format!("s3://{}/aws-{tag}-{i}", self.bucket))
                    .args(["--endpoint-url", &self.endpoint])
                    .args(self.aws_args),
            )?;
            let (aws_wall, aws_cpu) = (wall.as_nanos() as f64, cpu.as_nanos() as f64);
            let cpu = self_cpu();
            let started = Instant::now();
            trainhost::bench::persist_directory(
                work.path(),
                &format!("s3://{}", self.bucket),
                &format!("ours-{tag}-{i}"),
                &self.options,
                Durability::OnDisk,
            )?;
            wall_pairs.push(aws_wall, started.elapsed().as_nanos() as f64);
            cpu_pairs.push(aws_cpu, self_cpu().saturating_sub(cpu).as_nanos() as f64);
        }
        let what = describe(layout);
        let rows = vec![
            wall_pairs.row(
                "s3",
                format!("upload {what} to S3 (moto on loopback{}), wall", self.over),
                "`aws s3 cp --recursive` (awscli v1)".into(),
                format!(
                    "≥ {}× faster (ratio ≤ {:.2})",
                    goals::S3_SPEEDUP,
                    1.0 / goals::S3_SPEEDUP
                ),
                |b, o| Some(o * goals::S3_SPEEDUP <= b),
            ),
            cpu_pairs.row(
                "s3",
                format!(
                    "upload {what} to S3{}, CPU time of the uploading process",
                    self.over
                ),
                "`aws s3 cp --recursive` (awscli v1)".into(),
                format!("≤ {} × its CPU", goals::S3_CPU_SHARE),
                |b, o| Some(o <= goals::S3_CPU_SHARE * b),
            ),
        ];
        Ok((rows, work))
    }
}
