//! Host bindings generated from `wit/trainhost.wit`. Nothing here is written
//! by hand; `session.rs`, `collective.rs` and `tensors.rs` implement the
//! generated traits for a rank (`rank.rs`).
//!
//! They are generated for the guests' world `trainer` but for its
//! `collective-bits` import, whose functions are written by hand
//! (`collective_bits.rs`): generated ones lift every list into a host
//! vector, and those read the guest's list where it lies. A guest's import
//! the world below lacks is found missing when the guest is linked, so an
//! import added to `trainer` and not here fails every test run.

wasmtime::component::bindgen!({
    path: "../wit",
    inline: "
        package trainhost:host;

        world trainer {
            import trainhost:train/context@0.1.8;
            import trainhost:train/session@0.1.8;
            import trainhost:train/collective@0.1.8;
            import trainhost:train/tensors@0.1.8;

            export train: func() -> result<_, string>;
        }
    ",
    world: "trainer",
    // Every import may trap: that is how a rank is stopped when the run
    // fails elsewhere while it waits in `report`. The calls that wait for
    // the other ranks are async, so that ranks sharing a thread take turns
    // while they wait (see `crate::executor`).
    imports: {
        "trainhost:train/session.report": async | trappable,
        "trainhost:train/session.report-handing-over": async | trappable,
        "trainhost:train/collective": async | trappable,
        "trainhost:train/tensors.all-reduce": async | trappable,
        "trainhost:train/tensors.all-reduce-list": async | trappable,
        "trainhost:train/tensors.broadcast": async | trappable,
        "trainhost:train/tensors.[method]program.run": async | trappable,
        default: trappable,
    },
    // A rank's host tensors, in its own resource table.
    with: {
        "trainhost:train/tensors.tensor": crate::tensor::Tensor,
        "trainhost:train/tensors.program": super::recording::Program,
    },
    // `train` is called asynchronously, so that a stopping attempt can drop
    // the call wherever the guest waits in WASI (see `rank.rs`).
    exports: { default: async },
});
