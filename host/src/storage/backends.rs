//! Turning a storage location into an object store: local directories,
//! `memory://`, and S3, GCS and Azure by URL.
//!
//! Cloud stores are configured the way object_store's builders read them:
//! from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`) and then from the
//! user's key=value options, which win. Every request is retried with
//! backoff and bounded by timeouts (see [`StorageOptions`]).
//!
//! Without credentials, object_store's builders fall back to the cloud's
//! instance metadata service. trainhost refuses that by default, with an
//! error saying which credentials to set: a laptop would otherwise spend
//! minutes retrying an address that does not answer before training starts.
//! On a cloud machine whose role should be used, say so with the option
//! `instance_metadata=true`.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, ObjectStoreScheme, RetryConfig};

use crate::config::StorageOptions;
use crate::error::Error;

/// The trainhost option that allows credentials from the instance metadata
/// service.
const INSTANCE_METADATA: &str = "instance_metadata";

/// Waits between retries are drawn from [init, base × the last wait], at
/// most `max_backoff`. object_store's default base of 2 lets them grow by
/// only ~50 ms a retry on average, so ten retries ended within about two
/// seconds whatever the retry timeout said; with base 3 they grow ~1.5×
/// a retry, and an outage of seconds is waited out.
const BACKOFF: BackoffConfig = BackoffConfig {
    init_backoff: Duration::from_millis(200),
    max_backoff: Duration::from_secs(15),
    base: 3.0,
};

fn retry(options: &StorageOptions) -> RetryConfig {
    RetryConfig {
        backoff: BACKOFF,
        max_retries: options.max_retries,
        retry_timeout: options.retry_timeout,
    }
}

fn client(options: &StorageOptions) -> ClientOptions {
    ClientOptions::new()
        .with_timeout(options.request_timeout)
        .with_connect_timeout(options.connect_timeout)
}

/// The user's options without trainhost's own, and whether instance
/// metadata credentials are allowed.
fn split(options: &StorageOptions) -> Result<(Vec<(String, String)>, bool), Error> {
    let mut metadata = false;
    let mut rest = Vec::new();
    for (k, v) in &options.options {
        if k == INSTANCE_METADATA {
            metadata = v.parse().map_err(|_| {
                Error::InvalidConfig(format!("storage option {k}={v}: give true or false"))
            })?;
        } else {
            rest.push((k.clone(), v.clone()));
        }
    }
    Ok((rest, metadata))
}

/// Whether any of `names` is set, as an option (case-insensitive key) or
/// an environment variable (upper case).
fn given(options: &[(String, String)], names: &[&str]) -> bool {
    names.iter().any(|n| {
        options
            .iter()
            .any(|(k, v)| k.eq_ignore_ascii_case(n) && !v.is_empty())
            || std::env::var(n.to_ascii_uppercase()).is_ok_and(|v| !v.is_empty())
    })
}

/// `b` with its payload signing as [`signs_payload`] says, unless the
/// user's options or environment set it.
fn payload_signing(b: AmazonS3Builder, pairs: &[(String, String)]) -> AmazonS3Builder {
    if given(pairs, &["aws_unsigned_payload", "unsigned_payload"]) {
        return b;
    }
    let endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint);
    b.with_unsigned_payload(!signs_payload(endpoint.as_deref()))
}

/// Whether S3 requests sign their payload's SHA-256 where the user has
/// not said (`aws_unsigned_payload`): over plain HTTP they do, as the AWS
/// CLI does, since nothing else guards the bytes on the way; over HTTPS
/// (AWS itself when no endpoint is given) they send `UNSIGNED-PAYLOAD`, as
/// the AWS CLI and SDKs do, since TLS guards them. Signing there would
/// cost every part of a multipart upload a digest of its own for its
/// signature alone (the manifest's digest is of the whole file, not of a
/// part), about a third more hashing (`part_digests`).
fn signs_payload(endpoint: Option<&str>) -> bool {
    endpoint.is_some_and(|e| {
        !e.get(..8)
            .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
    })
}

fn option_error(url: &str, key: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidConfig(format!(
        "storage option {key:?} is not valid for {url}: {e}"
    ))
}

fn build_error(url: &str, e: object_store::Error) -> Error {
    Error::InvalidConfig(format!("storage {url}: {e}"))
}

fn missing_credentials(url: &str, what: &str) -> Error {
    Error::InvalidConfig(format!(
        "storage {url}: no credentials found; {what}. On a cloud machine whose role should be used, pass the storage option {INSTANCE_METADATA}=true"
    ))
}

/// A cloud URL's store, as [`cloud`] opens it.
pub(super) struct Cloud {
    pub(super) store: Arc<dyn ObjectStore>,
    /// The path the URL names in the store.
    pub(super) root: ObjectPath,
    /// Whether every request is signed with its payload's SHA-256 (S3,
    /// unless the payload goes unsigned or nothing is signed).
    pub(super) signs_payloads: bool,
}

/// The object store and root path of a cloud URL.
pub(super) fn cloud(
    location: &str,
    url: &url::Url,
    options: &StorageOptions,
) -> Result<Cloud, Error> {
    if matches!(
        url.scheme(),
        "s3" | "s3a" | "gs" | "az" | "azure" | "abfs" | "abfss"
    ) && url.host_str().is_none_or(str::is_empty)
    {
        return Err(Error::InvalidConfig(format!(
            "storage URL {location:?} names no bucket or container; write {}://BUCKET/PREFIX",
            url.scheme()
        )));
    }
    let (scheme, path) = ObjectStoreScheme::parse(url).map_err(|e| {
        Error::InvalidConfig(format!(
            "storage URL {location:?} is not supported: {e}; use a local directory, file://, memory://, s3://, gs:// or az://"
        ))
    })?;
    let (pairs, metadata) = split(options)?;
    let (store, signs_payloads): (Arc<dyn ObjectStore>, bool) = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let mut b = AmazonS3Builder::from_env()
                .with_url(url.as_str())
                .with_retry(retry(options))
                .with_client_options(client(options))
                .with_crypto_provider(Arc::new(super::signing::Signing));
            for (k, v) in &pairs {
                let key: AmazonS3ConfigKey = k.parse().map_err(|e| option_error(location, k, e))?;
                b = b.with_config(key, v);
            }
            b = payload_signing(b, &pairs);
            let set = |key| {
                b.get_config_value(&key)
                    .is_some_and(|v| v.eq_ignore_ascii_case("true"))
            };
            let signs_payloads =
                !set(AmazonS3ConfigKey::UnsignedPayload) && !set(AmazonS3ConfigKey::SkipSignature);
            let has = given(
                &pairs,
                &[
                    "aws_access_key_id",
                    "access_key_id",
                    "aws_web_identity_token_file",
                    "aws_container_credentials_relative_uri",
                    "aws_container_credentials_full_uri",
                ],
            ) || given(&pairs, &["aws_skip_signature", "skip_signature"]);
            if !has && !metadata {
                return Err(missing_credentials(
                    location,
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or the storage options aws_access_key_id and aws_secret_access_key",
                ));
            }
            (
                Arc::new(b.build().map_err(|e| build_error(location, e))?),
                signs_payloads,
            )
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_url(url.as_str())
                .with_retry(retry(options))
                .with_client_options(client(options));
            for (k, v) in &pairs {
                let key: GoogleConfigKey = k.parse().map_err(|e| option_error(location, k, e))?;
                b = b.with_config(key, v);
            }
            let adc = std::env::var_os("HOME")
                .map(|h| {
                    std::path::Path::new(&h)
                        .join(".config/gcloud/application_default_credentials.json")
                })
                .is_some_and(|p| p.exists());
            let has = adc
                || given(
                    &pairs,
                    &[
                        "google_service_account",
                        "google_service_account_path",
                        "service_account",
                        "google_service_account_key",
                        "service_account_key",
                        "google_application_credentials",
                        "application_credentials",
                        "google_bearer_token",
                        "bearer_token",
                        "google_skip_signature",
                        "skip_signature",
                    ],
                );
            if !has && !metadata {
                return Err(missing_credentials(
                    location,
                    "set GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT to a service account key file (or run `gcloud auth application-default login`)",
                ));
            }
            (
                Arc::new(b.build().map_err(|e| build_error(location, e))?),
                false,
            )
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let mut b = MicrosoftAzureBuilder::from_env()
                .with_url(url.as_str())
                .with_retry(retry(options))
                .with_client_options(client(options));
            for (k, v) in &pairs {
                let key: AzureConfigKey = k.parse().map_err(|e| option_error(location, k, e))?;
                b = b.with_config(key, v);
            }
            let has = given(
                &pairs,
                &[
                    "azure_storage_account_key",
                    "azure_storage_access_key",
                    "account_key",
                    "access_key",
                    "azure_storage_sas_key",
                    "azure_storage_sas_token",
                    "sas_key",
                    "sas_token",
                    "azure_storage_token",
                    "bearer_token",
                    "token",
                    "azure_client_secret",
                    "client_secret",
                    "azure_federated_token_file",
                    "federated_token_file",
                    "azure_use_azure_cli",
                    "use_azure_cli",
                    "azure_storage_use_emulator",
                    "use_emulator",
                    "azure_skip_signature",
                    "skip_signature",
                ],
            );
            if !has && !metadata {
                return Err(missing_credentials(
                    location,
                    "set AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN, or a client secret) with AZURE_STORAGE_ACCOUNT_NAME, or use_azure_cli=true",
                ));
            }
            (
                Arc::new(b.build().map_err(|e| build_error(location, e))?),
                false,
            )
        }
        ObjectStoreScheme::Local | ObjectStoreScheme::Memory => {
            unreachable!("local and memory locations are opened before this")
        }
        other => {
            return Err(Error::InvalidConfig(format!(
                "storage URL {location:?} ({other:?}) is not supported; use a local directory, file://, memory://, s3://, gs:// or az://"
            )));
        }
    };
    Ok(Cloud {
        store,
        root: path,
        signs_payloads,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unsigned(endpoint: Option<&str>, pairs: &[(&str, &str)]) -> bool {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let mut b = AmazonS3Builder::new().with_url("s3://bucket/prefix");
        if let Some(endpoint) = endpoint {
            b = b.with_endpoint(endpoint);
        }
        for (k, v) in &pairs {
            b = b.with_config(k.parse().unwrap(), v);
        }
        let b = payload_signing(b, &pairs);
        b.get_config_value(&AmazonS3ConfigKey::UnsignedPayload) == Some("true".into())
    }

    #[test]
    fn payloads_are_signed_over_plain_http_only_unless_the_user_says() {
        // AWS itself, and any HTTPS endpoint: TLS guards the bytes.
        assert!(unsigned(None, &[]));
        assert!(unsigned(Some("https://minio.example:9000"), &[]));
        assert!(unsigned(Some("HTTPS://minio.example"), &[]));
        // Plain HTTP: the signature is all that guards them.
        assert!(!unsigned(Some("http://127.0.0.1:5000"), &[]));
        // The user's choice stands either way.
        assert!(!unsigned(None, &[("aws_unsigned_payload", "false")]));
        assert!(unsigned(
            Some("http://127.0.0.1:5000"),
            &[("unsigned_payload", "true")]
        ));
    }

    /// What the uploads are told (`Storage::signs_payloads`) follows the
    /// store's own configuration, the user's options included.
    #[test]
    fn a_store_says_whether_it_signs_payloads() {
        let signs = |url: &str, pairs: &[(&str, &str)]| {
            let options = StorageOptions {
                options: pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                ..Default::default()
            };
            cloud(url, &url.parse().unwrap(), &options)
                .unwrap()
                .signs_payloads
        };
        let keys = |more: &[(&'static str, &'static str)]| {
            let mut all = vec![("aws_access_key_id", "k"), ("aws_secret_access_key", "s")];
            all.extend_from_slice(more);
            all
        };
        let http = ("aws_endpoint", "http://127.0.0.1:5000");
        assert!(signs("s3://b/p", &keys(&[http])));
        assert!(!signs("s3://b/p", &keys(&[])), "AWS over HTTPS");
        assert!(!signs(
            "s3://b/p",
            &keys(&[("aws_endpoint", "https://minio.example")])
        ));
        assert!(!signs(
            "s3://b/p",
            &keys(&[http, ("aws_unsigned_payload", "true")])
        ));
        assert!(!signs("s3://b/p", &[http, ("aws_skip_signature", "true")]));
        assert!(!signs("gs://b/p", &[("google_skip_signature", "true")]));
    }
}
