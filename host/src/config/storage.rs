//! Where runs are stored: the location as the user writes it, classified
//! once, and how to reach an object store beyond its URL.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::Error;

/// How to reach a storage location beyond its URL.
///
/// ```
/// use std::time::Duration;
/// use trainhost::StorageOptions;
///
/// // An S3-compatible server with static keys:
/// let options = StorageOptions {
///     options: vec![
///         ("aws_endpoint".into(), "http://127.0.0.1:9000".into()),
///         ("aws_allow_http".into(), "true".into()),
///         ("aws_region".into(), "us-east-1".into()),
///     ],
///     retry_timeout: Duration::from_secs(60),
///     ..StorageOptions::default()
/// };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageOptions {
    /// `key=value` settings for the object store, on top of the
    /// environment: object_store's config keys for the URL's scheme
    /// (`aws_endpoint`, `aws_region`, `google_service_account`,
    /// `azure_storage_account_name`, ... and client keys such as
    /// `allow_http`), plus trainhost's `instance_metadata=true`.
    pub options: Vec<(String, String)>,
    /// How many times a failed request is retried, at most. Default 50:
    /// waits grow from 0.2 s to 15 s between retries, so with the default
    /// retry timeout it is the timeout that ends retrying.
    pub max_retries: usize,
    /// How long a request keeps being retried in all: a storage outage
    /// shorter than this costs time, not the run. Default 3 minutes.
    pub retry_timeout: Duration,
    /// How long one request may take. Default 30 seconds.
    pub request_timeout: Duration,
    /// How long connecting may take. Default 5 seconds.
    pub connect_timeout: Duration,
    /// How long a host's claim on a run in an object store lasts unless
    /// renewed (R27); it is renewed every quarter of this. A host that dies
    /// holds its run this long at most; a host paused for longer loses the
    /// run to the next one started. Default 30 seconds, at least 2.
    pub lease_timeout: Duration,
    /// Draw progress bars for checkpoint uploads and restores on stderr
    /// when it is a terminal. Default off (the CLI turns it on).
    pub progress: bool,
}

impl Default for StorageOptions {
    fn default() -> Self {
        Self {
            options: Vec::new(),
            max_retries: 50,
            retry_timeout: Duration::from_secs(180),
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            lease_timeout: Duration::from_secs(30),
            progress: false,
        }
    }
}

/// A storage location (a run's `storage_path`, a checkpoint's location),
/// read once: every other part of trainhost asks it what kind it is instead
/// of looking at the text again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Location {
    /// A local directory: a plain path or a `file://` URL.
    Local(PathBuf),
    /// `memory://` with a prefix: a fresh in-memory store, for tests.
    Memory(String),
    /// An object store URL: `s3://`, `gs://`, `az://` and their aliases.
    ObjectStore(url::Url),
}

impl Location {
    /// Read `text`: a plain path, `file:///abs/path`, `memory://[/prefix]`,
    /// or an object store URL. Trailing slashes do not matter.
    pub fn parse(text: &str) -> Result<Self, Error> {
        if text.is_empty() {
            return Err(Error::InvalidConfig(
                "storage location is empty; give a directory or a URL such as file:///data/runs"
                    .into(),
            ));
        }
        if text == "memory://" || text.starts_with("memory:///") {
            let prefix = text.trim_start_matches("memory://").trim_matches('/');
            return Ok(Self::Memory(prefix.to_owned()));
        }
        if !text.contains("://") {
            return Ok(Self::Local(PathBuf::from(text)));
        }
        let parse = |text: &str| {
            url::Url::parse(text).map_err(|e| {
                Error::InvalidConfig(format!("storage URL {text:?} is not a valid URL: {e}"))
            })
        };
        if text.starts_with("file://") {
            let path = parse(text)?.to_file_path().map_err(|()| {
                Error::InvalidConfig(format!(
                    "storage URL {text:?} is not an absolute local path (write file:///abs/path, got {text})"
                ))
            })?;
            return Ok(Self::Local(path));
        }
        let mut url = parse(text)?;
        // `s3://bucket/runs/` and `s3://bucket/runs` are one location.
        let path = url.path().trim_end_matches('/').to_owned();
        url.set_path(&path);
        Ok(Self::ObjectStore(url))
    }

    /// The location `name` below this one (a run below its storage).
    pub fn child(&self, name: &str) -> Self {
        match self {
            Self::Local(dir) => Self::Local(dir.join(name)),
            Self::Memory(prefix) if prefix.is_empty() => Self::Memory(name.to_owned()),
            Self::Memory(prefix) => Self::Memory(format!("{prefix}/{name}")),
            Self::ObjectStore(url) => {
                let mut url = url.clone();
                let path = format!("{}/{name}", url.path().trim_end_matches('/'));
                url.set_path(&path);
                Self::ObjectStore(url)
            }
        }
    }

    /// The local directory, if this is one.
    pub fn local_dir(&self) -> Option<&Path> {
        match self {
            Self::Local(dir) => Some(dir),
            _ => None,
        }
    }

    /// Whether this names an object store (not a local directory or
    /// `memory://`).
    pub fn is_object_store(&self) -> bool {
        matches!(self, Self::ObjectStore(_))
    }
}

/// The location as the user would write it again.
impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(dir) => write!(f, "{}", dir.display()),
            Self::Memory(prefix) => write!(f, "memory:///{prefix}"),
            Self::ObjectStore(url) => f.write_str(url.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_classified_once_and_joined_alike() {
        let local = Location::parse("runs/here").unwrap();
        assert_eq!(local.child("demo").to_string(), "runs/here/demo");
        let file = Location::parse("file:///data/runs/").unwrap();
        assert_eq!(file, Location::Local("/data/runs".into()));
        assert!(Location::parse("file://relative/path").is_err());
        let s3 = Location::parse("s3://bucket/runs/").unwrap();
        assert!(s3.is_object_store());
        assert_eq!(s3.child("demo").to_string(), "s3://bucket/runs/demo");
        assert_eq!(
            Location::parse("s3://bucket")
                .unwrap()
                .child("demo")
                .to_string(),
            "s3://bucket/demo"
        );
        let memory = Location::parse("memory://").unwrap();
        assert!(!memory.is_object_store() && memory.local_dir().is_none());
        assert_eq!(memory.child("demo").to_string(), "memory:///demo");
        assert_eq!(
            Location::parse("s3://").unwrap().child("x").to_string(),
            "s3:///x",
            "no bucket stays no bucket, for the store to refuse"
        );
        assert!(Location::parse("").is_err());
        assert!(Location::parse("s3://bad host/x").is_err());
    }
}
