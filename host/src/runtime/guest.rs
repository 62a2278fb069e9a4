//! The guest component a run starts: where its bytes come from.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::Error;

/// The guest component to run.
///
/// ```
/// use trainhost::GuestSource;
/// let from_file = GuestSource::from("target/wasm32-wasip2/release/my_loop.wasm");
/// let from_bytes = GuestSource::from(vec![0u8; 0]); // e.g. bytes you fetched yourself
/// # let _ = (from_file, from_bytes);
/// ```
#[derive(Debug, Clone)]
pub enum GuestSource {
    /// A `.wasm` file.
    File(PathBuf),
    /// The component's bytes.
    Bytes(Arc<[u8]>),
}

impl From<&Path> for GuestSource {
    fn from(p: &Path) -> Self {
        GuestSource::File(p.to_path_buf())
    }
}

impl From<PathBuf> for GuestSource {
    fn from(p: PathBuf) -> Self {
        GuestSource::File(p)
    }
}

impl From<&str> for GuestSource {
    fn from(p: &str) -> Self {
        GuestSource::File(PathBuf::from(p))
    }
}

impl From<Vec<u8>> for GuestSource {
    fn from(b: Vec<u8>) -> Self {
        GuestSource::Bytes(b.into())
    }
}

impl GuestSource {
    /// The guest as the user gave it, for messages.
    pub(crate) fn shown(&self) -> String {
        match self {
            GuestSource::File(p) => p.display().to_string(),
            GuestSource::Bytes(_) => "<bytes>".into(),
        }
    }

    /// The file's name without extension (for default run names).
    pub(crate) fn stem(&self) -> String {
        match self {
            GuestSource::File(p) => p
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("trainhost")
                .to_owned(),
            GuestSource::Bytes(_) => "trainhost".into(),
        }
    }

    /// The component's bytes.
    pub(crate) fn read(&self) -> Result<Cow<'_, [u8]>, Error> {
        match self {
            GuestSource::File(path) => {
                std::fs::read(path)
                    .map(Cow::Owned)
                    .map_err(|e| Error::Guest {
                        path: path.display().to_string(),
                        message: "cannot be read".into(),
                        source: Some(Box::new(e)),
                    })
            }
            GuestSource::Bytes(b) => Ok(Cow::Borrowed(b)),
        }
    }
}
