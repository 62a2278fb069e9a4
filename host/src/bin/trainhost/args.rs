//! Flags and values shared by the subcommands: how to reach an object
//! store, sizes and durations as people write them.

use std::time::Duration;

use clap::Args;
use trainhost::{RunConfig, StorageOptions};

/// The location of the run a subcommand names: a run name under
/// `storage`, or (anything with a `/`) the run's own directory or URL.
pub fn run_location(run: &str, storage: &str) -> Result<String, trainhost::Error> {
    if run.contains('/') {
        return Ok(run.to_owned());
    }
    RunConfig {
        name: Some(run.to_owned()),
        storage_path: storage.to_owned(),
        ..RunConfig::default()
    }
    .run_location()
}

/// How to reach an object store.
#[derive(Args, Debug)]
pub struct StorageFlags {
    /// A setting for the object store, repeatable: object_store's keys for
    /// the URL's scheme, e.g. aws_endpoint=http://127.0.0.1:9000,
    /// aws_region=eu-west-1, google_service_account=key.json,
    /// azure_storage_account_name=acct, allow_http=true. The environment
    /// (AWS_*, GOOGLE_*, AZURE_*) is read first; these win.
    /// instance_metadata=true allows credentials from the cloud's metadata
    /// service.
    #[arg(long = "storage-option", value_name = "KEY=VALUE", value_parser = parse_key_value, help_heading = "Storage")]
    storage_options: Vec<(String, String)>,

    /// How many times a failed storage request is retried at most, with
    /// backoff (0.2 s growing to 15 s); --storage-retry-timeout usually
    /// ends retrying first.
    #[arg(long, value_name = "N", default_value_t = StorageOptions::default().max_retries, help_heading = "Storage")]
    storage_retries: usize,

    /// How long a storage request keeps being retried in all: a storage
    /// outage shorter than this costs time, not the run.
    #[arg(long, value_name = "DURATION", default_value = "3m", value_parser = parse_duration, help_heading = "Storage")]
    storage_retry_timeout: Duration,

    /// How long one storage request may take.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration, help_heading = "Storage")]
    storage_timeout: Duration,
}

impl StorageFlags {
    pub fn options(&self, progress: bool) -> StorageOptions {
        StorageOptions {
            options: self.storage_options.clone(),
            max_retries: self.storage_retries,
            retry_timeout: self.storage_retry_timeout,
            request_timeout: self.storage_timeout,
            progress,
            ..StorageOptions::default()
        }
    }
}

fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// A size such as `4096`, `64KiB`, `512MiB`, `2GiB` (K, M, G and KB, MB,
/// GB are read as binary units too).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size; write e.g. 4096, 64KiB, 512MiB or 2GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?}; use KiB, MiB or GiB"
            ));
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 90s, 30m, 2h)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("lots").unwrap_err().contains("not a size"));
        assert!(
            parse_size("5 parsecs")
                .unwrap_err()
                .contains("unknown size unit")
        );
    }
}
