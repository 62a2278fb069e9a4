//! A store whose deletes wait until a test lets them through, for tests
//! of what must not wait on deletions.

use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use tokio::sync::Semaphore;

#[derive(Debug)]
pub struct HeldDeletes {
    inner: Arc<InMemory>,
    /// One permit per delete let through.
    pub gate: Arc<Semaphore>,
}

impl Default for HeldDeletes {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

impl std::fmt::Display for HeldDeletes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeldDeletes")
    }
}

#[async_trait::async_trait]
impl ObjectStore for HeldDeletes {
    async fn put_opts(&self, l: &Path, p: PutPayload, o: PutOptions) -> Result<PutResult> {
        self.inner.put_opts(l, p, o).await
    }
    async fn put_multipart_opts(
        &self,
        l: &Path,
        o: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(l, o).await
    }
    async fn get_opts(&self, l: &Path, o: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(l, o).await
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let (inner, gate) = (Arc::clone(&self.inner), Arc::clone(&self.gate));
        locations
            .then(move |location| {
                let (inner, gate) = (Arc::clone(&inner), Arc::clone(&gate));
                async move {
                    gate.acquire().await.expect("open").forget();
                    let one = futures::stream::once(async { location }).boxed();
                    inner.delete_stream(one).next().await.expect("one answer")
                }
            })
            .boxed()
    }
    fn list(&self, p: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(p)
    }
    async fn list_with_delimiter(&self, p: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(p).await
    }
    async fn copy_opts(&self, from: &Path, to: &Path, o: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, o).await
    }
}
