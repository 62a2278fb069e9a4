//! Compile the guests the tests run, from source, for wasm32-wasip2, and
//! export their paths as compile-time environment variables.
//!
//! The guests are built by a nested cargo into their own target directory
//! (`target/guests`), so it neither waits on the outer build's lock nor
//! rebuilds the host's dependencies. Release mode: a debug guest runs ~30x
//! slower.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// (package, wasm file stem, env var exported).
const GUESTS: &[(&str, &str, &str)] = &[
    (
        "trainhost-test-guest",
        "trainhost_test_guest",
        "TRAINHOST_TEST_GUEST",
    ),
    (
        "trainhost-test-guest",
        "not_a_trainer",
        "TRAINHOST_NOT_A_TRAINER",
    ),
    (
        "trainhost-test-guest-other-wit",
        "trainhost_test_guest_other_wit",
        "TRAINHOST_OTHER_WIT",
    ),
    (
        "trainhost-test-guest-wit-0-1-0",
        "trainhost_test_guest_wit_0_1_0",
        "TRAINHOST_WIT_0_1_0",
    ),
    (
        "linear-regression",
        "linear_regression",
        "TRAINHOST_LINEAR_REGRESSION",
    ),
    (
        "trainhost-bench-guest",
        "trainhost_bench_guest",
        "TRAINHOST_BENCH_GUEST",
    ),
    ("quickstart", "quickstart", "TRAINHOST_QUICKSTART"),
    ("digits-mlp", "digits_mlp", "TRAINHOST_DIGITS_MLP"),
    ("digits-burn", "digits_burn", "TRAINHOST_DIGITS_BURN"),
];

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let target_dir = root.join("target").join("guests");

    for dir in [
        "wit",
        "guest-sdk",
        "tests/guests",
        "tests/guest-other-wit",
        "tests/guest-wit-0-1-0",
        "examples/linear-regression",
        "examples/quickstart",
        "examples/digits-mlp",
        "examples/digits-burn",
        "guest-burn",
        "tools/bench/guest",
        "tools/bench/kernel",
        ".cargo",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("Cargo.lock").display()
    );

    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(&root)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--target-dir",
        ])
        .arg(&target_dir);
    let mut packages: Vec<&str> = GUESTS.iter().map(|(p, _, _)| *p).collect();
    packages.dedup();
    for package in packages {
        cmd.args(["-p", package]);
    }
    // What the outer cargo set for this build script must not leak into
    // the guests' build: flags and wrappers for the host target (clippy's
    // driver included) would break or slow the wasm build, and the
    // encoded flags would override .cargo/config.toml's simd128.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    let output = cmd
        .output()
        .expect("cannot run cargo to build the test guests");
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let hint =
            if stderr.contains("wasm32-wasip2") && stderr.contains("target may not be installed") {
                "\nthe wasm32-wasip2 target is missing: run `rustup target add wasm32-wasip2`"
            } else {
                ""
            };
        panic!("building the test guests failed:\n{stderr}{hint}");
    }
    for (_, stem, var) in GUESTS {
        let wasm = target_dir
            .join("wasm32-wasip2")
            .join("release")
            .join(format!("{stem}.wasm"));
        assert!(wasm.exists(), "{} was not built", wasm.display());
        println!("cargo:rustc-env={var}={}", wasm.display());
    }
}
