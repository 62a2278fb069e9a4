//! The bindings generated from `wit/trainhost.wit`, kept apart from the
//! hand-written API in the crate root that wraps them. Not public API.
#![allow(missing_docs, clippy::all)]

wit_bindgen::generate!({
    path: "../wit",
    world: "trainer",
    // The `entry!` macro in the crate root exports through this.
    pub_export_macro: true,
    export_macro_name: "export_trainer",
    default_bindings_module: "trainhost_guest::wit",
});
