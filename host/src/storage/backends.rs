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

/// The object store and root path of a cloud URL.
pub(super) fn cloud(
    location: &str,
    url: &url::Url,
    options: &StorageOptions,
) -> Result<(Arc<dyn ObjectStore>, ObjectPath), Error> {
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
    let store: Arc<dyn ObjectStore> = match scheme {
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
            Arc::new(b.build().map_err(|e| build_error(location, e))?)
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
            Arc::new(b.build().map_err(|e| build_error(location, e))?)
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
            Arc::new(b.build().map_err(|e| build_error(location, e))?)
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
    Ok((store, path))
}
