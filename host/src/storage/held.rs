//! A store in memory whose deletes, reads or writes wait until a test lets
//! them through, for tests of what must not wait on storage, of what stops
//! while it waits, and of the order writes land in.

use std::sync::Arc;

use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};
use tokio::sync::{Semaphore, watch};

#[derive(Debug)]
pub struct Held {
    inner: Arc<InMemory>,
    /// One permit per delete let through.
    pub deletes: Arc<Semaphore>,
    /// While it names a file, reads of a file of that name wait until it
    /// is cleared.
    pub hold_reads_of: watch::Sender<Option<String>>,
    /// Counts the reads that came while held.
    pub reads_held: watch::Sender<usize>,
    /// While it names a file, writes of a file of that name wait until it
    /// is cleared.
    pub hold_puts_of: watch::Sender<Option<String>>,
    /// Counts the writes that came while held.
    pub puts_held: watch::Sender<usize>,
}

impl Held {
    /// Every delete waits for a permit; reads go through.
    pub fn deletes() -> Self {
        Self {
            inner: Arc::default(),
            deletes: Arc::new(Semaphore::new(0)),
            hold_reads_of: watch::Sender::new(None),
            reads_held: watch::Sender::new(0),
            hold_puts_of: watch::Sender::new(None),
            puts_held: watch::Sender::new(0),
        }
    }

    /// Deletes go through; reads and writes are held once `hold_reads_of`
    /// or `hold_puts_of` is set.
    pub fn reads() -> Self {
        let held = Self::deletes();
        held.deletes.add_permits(Semaphore::MAX_PERMITS);
        held
    }
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held")
    }
}

#[async_trait::async_trait]
impl ObjectStore for Held {
    async fn put_opts(&self, l: &Path, p: PutPayload, o: PutOptions) -> Result<PutResult> {
        hold(l, &self.hold_puts_of, &self.puts_held).await;
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
        hold(l, &self.hold_reads_of, &self.reads_held).await;
        self.inner.get_opts(l, o).await
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let (inner, gate) = (Arc::clone(&self.inner), Arc::clone(&self.deletes));
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

/// Wait while `of` names `l`'s file, counting the wait in `count`.
async fn hold(l: &Path, of: &watch::Sender<Option<String>>, count: &watch::Sender<usize>) {
    let name = l.filename();
    let mut held = of.subscribe();
    if held.borrow_and_update().as_deref() == name {
        count.send_modify(|n| *n += 1);
        let _ = held.wait_for(|held| held.as_deref() != name).await;
    }
}
