//! The WebAssembly side: the engine, compiling a guest once, and running
//! ranks. Nothing here knows about storage.

mod bindings;
pub(crate) mod cache;
mod collective;
mod collective_bits;
mod guest;
mod kernel_calls;
pub(crate) mod limits;
mod listing;
pub(crate) mod output;
mod program;
mod program_run;
mod rank;
mod recording;
pub(crate) mod sandbox;
mod session;
mod tensor_exchange;
mod tensor_files;
mod tensors;
mod trap;
mod writes;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine};

pub use guest::GuestSource;
pub(crate) use rank::{RankDirs, RankInfo, RankShared, run_rank};
pub(crate) use sandbox::RESTORE_GUEST_PATH;

use crate::config::Interruption;
use crate::error::Error;
use bindings::{Trainer, TrainerPre};
pub(crate) use cache::{CacheOutcome, CompileCache};
use rank::RankState;

/// How often running guests check whether the run is stopping.
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// The WIT package this host implements (`trainhost:train@x.y.z`), for
/// messages and the nodes' agreement: read from `wit/trainhost.wit`, the
/// one place its version is written (the bindings come from the same
/// file).
pub(crate) fn wit_package() -> &'static str {
    static PACKAGE: OnceLock<&str> = OnceLock::new();
    PACKAGE.get_or_init(|| {
        include_str!("../../../wit/trainhost.wit")
            .lines()
            .find_map(|l| l.trim().strip_prefix("package ")?.strip_suffix(';'))
            .expect("wit/trainhost.wit declares its package")
    })
}

/// A guest compiled once and ready to instantiate for any number of ranks.
pub(crate) struct GuestComponent {
    engine: Engine,
    pre: TrainerPre<RankState>,
    interruption: Interruption,
}

impl std::fmt::Debug for GuestComponent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestComponent").finish_non_exhaustive()
    }
}

impl GuestComponent {
    /// Compile `bytes` (named `shown` in errors), or load it from `cache`,
    /// and link it against trainhost's world and WASI.
    pub fn compile(
        bytes: &[u8],
        shown: &str,
        interruption: Interruption,
        cache: Option<&CompileCache>,
    ) -> Result<(Self, Option<CacheOutcome>), Error> {
        let guest_err = |message: String, source: Option<wasmtime::Error>| Error::Guest {
            path: shown.to_owned(),
            message,
            source: source.map(|e| e.into_boxed_dyn_error()),
        };
        check_header(bytes).map_err(|m| guest_err(m.to_owned(), None))?;
        let mut config = Config::new();
        // Part of the engine's compatibility hash, so the compile cache
        // keeps code compiled with and without the checks apart.
        config.epoch_interruption(interruption.uses_epochs());
        let engine_err = |operation| {
            move |e: wasmtime::Error| Error::Engine {
                operation,
                source: e.into_boxed_dyn_error(),
            }
        };
        let engine = Engine::new(&config).map_err(engine_err("configure the engine"))?;
        let compile = || {
            Component::new(&engine, bytes)
                .map_err(|e| guest_err("is not a valid WebAssembly component".into(), Some(e)))
        };
        let (component, outcome) = match cache {
            Some(cache) => {
                let (component, outcome) = cache.get_or_compile(&engine, bytes, compile)?;
                (component, Some(outcome))
            }
            None => (compile()?, None),
        };
        let mut linker = Linker::<RankState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(engine_err("link the WASI imports"))?;
        // Some of wasmtime-wasi's file system functions are replaced.
        linker.allow_shadowing(true);
        let wrapped = writes::wrap_filesystem::<RankState>(&mut linker)
            .and_then(|()| listing::wrap_listings::<RankState>(&mut linker));
        linker.allow_shadowing(false);
        wrapped.map_err(engine_err("link the WASI imports"))?;
        Trainer::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)
            .map_err(engine_err("link trainhost's imports"))?;
        collective_bits::add_to_linker(&mut linker)
            .map_err(engine_err("link trainhost's imports"))?;
        if let Some(message) = describe_mismatch(&engine, &component) {
            return Err(guest_err(message, None));
        }
        let instance_pre = linker.instantiate_pre(&component).map_err(|e| {
            guest_err(
                format!(
                    "does not fit trainhost's world ({package}, world `trainer`): it imports something the host does not provide; build it against trainhost-guest or wit/trainhost.wit",
                    package = wit_package()
                ),
                Some(e),
            )
        })?;
        let pre = TrainerPre::new(instance_pre).map_err(|e| {
            guest_err(
                format!(
                    "does not export trainhost's `train` function ({package}, world `trainer`); declare an entry point with trainhost_guest::entry!",
                    package = wit_package()
                ),
                Some(e),
            )
        })?;
        Ok((
            Self {
                engine,
                pre,
                interruption,
            },
            outcome,
        ))
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn pre(&self) -> &TrainerPre<RankState> {
        &self.pre
    }

    pub(crate) fn interruption(&self) -> Interruption {
        self.interruption
    }

    /// Start the thread that advances the engine's epoch while ranks run,
    /// if the guest was compiled to check it.
    pub fn start_ticker(&self) -> Option<EpochTicker> {
        self.interruption
            .uses_epochs()
            .then(|| EpochTicker::start(self.engine.clone()))
    }
}

/// What is wrong with a component that will not fit trainhost's world, said
/// in terms of what to build instead: another version of the trainhost WIT
/// package, or a WASI command instead of a training loop.
fn describe_mismatch(engine: &Engine, component: &Component) -> Option<String> {
    let ty = component.component_type();
    let ours = wit_package()
        .rsplit_once('@')
        .map(|(_, v)| v)
        .unwrap_or_default();
    // Semver for 0.x: the minor version is the breaking one.
    let series = |v: &str| v.split('.').take(2).collect::<Vec<_>>().join(".");
    for (name, _) in ty.imports(engine) {
        if let Some(rest) = name.strip_prefix("trainhost:train/")
            && let Some((_, version)) = rest.split_once('@')
            && series(version) != series(ours)
        {
            return Some(format!(
                "was built against trainhost:train@{version}, but this host implements {package} (compatible with {}.x); rebuild the guest with the trainhost-guest version that matches this host, or run it with a trainhost that implements {version}",
                series(ours),
                package = wit_package()
            ));
        }
    }
    let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_owned()).collect();
    if exports.iter().any(|n| n == "train") {
        return None;
    }
    Some(if exports.iter().any(|n| n.starts_with("wasi:cli/run@")) {
        "is a WASI command (a `bin` crate with `fn main`), not a training loop; build a `cdylib` that declares its entry point with trainhost_guest::entry!".to_owned()
    } else {
        format!(
            "does not export trainhost's `train` function ({package}, world `trainer`); it exports {exports:?}. Declare an entry point with trainhost_guest::entry!",
            package = wit_package()
        )
    })
}

/// Tell a core module or garbage apart from a component before compiling,
/// so the error says what to do.
fn check_header(bytes: &[u8]) -> Result<(), &'static str> {
    const MAGIC: &[u8] = b"\0asm";
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(
            "is not WebAssembly (no \\0asm header); pass the .wasm file cargo built for wasm32-wasip2",
        );
    }
    // Core modules have layer 0 in bytes 6..8; components layer 1.
    if bytes[6..8] == [0, 0] {
        return Err(
            "is a core WebAssembly module, not a component; build it for the wasm32-wasip2 target (which produces a component) or wrap it with `wasm-tools component new`",
        );
    }
    Ok(())
}

/// Advances an engine's epoch every [`EPOCH_TICK`] on its own OS thread (a
/// tokio task would starve behind busy guests) until dropped.
pub(crate) struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    fn start(engine: Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("trainhost-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    // Parked rather than asleep, so that dropping the
                    // ticker does not wait out a tick.
                    std::thread::park_timeout(EPOCH_TICK);
                    engine.increment_epoch();
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{check_header, wit_package};

    #[test]
    fn the_package_is_the_one_the_wit_file_declares() {
        let version = wit_package()
            .strip_prefix("trainhost:train@")
            .expect("the package is trainhost:train");
        let parts: Vec<u32> = version.split('.').map(|p| p.parse().unwrap()).collect();
        assert_eq!(parts.len(), 3, "{version}");
    }

    #[test]
    fn tells_modules_and_garbage_from_components() {
        assert!(
            check_header(b"hello world")
                .unwrap_err()
                .contains("not WebAssembly")
        );
        let module = b"\0asm\x01\0\0\0";
        assert!(
            check_header(module)
                .unwrap_err()
                .contains("core WebAssembly module")
        );
        let component = b"\0asm\x0d\0\x01\0";
        assert!(check_header(component).is_ok());
    }
}
