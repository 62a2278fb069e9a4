//! The script's steps that write files other than by replacing them:
//! - `{"patch": PATH, "text": TEXT}`: opens PATH for writing without
//!   truncating it and writes TEXT at its start (in place)
//! - `{"append": PATH, "text": TEXT}`: appends TEXT to PATH
//! - `{"hold": PATH}`: opens PATH for writing (creating it, not truncating)
//!   and keeps it open for the steps below
//! - `{"write_held": PATH, "text": TEXT, "times": N}`: appends TEXT (N
//!   times, default 1) through the handle `hold` kept, which works after
//!   PATH is removed too
//! - `{"release": PATH}`: closes that handle
//! - `{"rename": PATH, "to": NEW}`: renames PATH to NEW, replacing it
//!
//! Paths are below the scratch directory unless absolute.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;

thread_local! {
    static HELD: RefCell<HashMap<String, File>> = RefCell::new(HashMap::new());
}

/// Run `step` if it is one of these; `Ok(false)` if it is not.
/// `text(key)` is the step's string under `key`, placeholders replaced.
pub(crate) fn run(
    text: impl Fn(&str) -> Option<String>,
    number: impl Fn(&str) -> Option<u64>,
) -> Result<bool, String> {
    let io = |e: std::io::Error| e.to_string();
    let body = || text("text").unwrap_or_default();
    if let Some(path) = text("patch") {
        let mut file = OpenOptions::new()
            .write(true)
            .open(crate::scratch_path(&path))
            .map_err(io)?;
        file.write_all(body().as_bytes()).map_err(io)?;
    } else if let Some(path) = text("append") {
        let mut file = OpenOptions::new()
            .append(true)
            .open(crate::scratch_path(&path))
            .map_err(io)?;
        file.write_all(body().as_bytes()).map_err(io)?;
    } else if let Some(path) = text("hold") {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(crate::scratch_path(&path))
            .map_err(io)?;
        HELD.with(|h| h.borrow_mut().insert(path, file));
    } else if let Some(path) = text("write_held") {
        HELD.with(|h| {
            let mut held = h.borrow_mut();
            let file = held.get_mut(&path).ok_or("write_held before hold")?;
            let body = body();
            for _ in 0..number("times").unwrap_or(1) {
                file.write_all(body.as_bytes()).map_err(io)?;
            }
            Ok::<(), String>(())
        })?;
    } else if let Some(path) = text("release") {
        HELD.with(|h| h.borrow_mut().remove(&path));
    } else if let Some(path) = text("rename") {
        let to = text("to").ok_or("rename needs to")?;
        std::fs::rename(crate::scratch_path(&path), crate::scratch_path(&to)).map_err(io)?;
    } else {
        return Ok(false);
    }
    Ok(true)
}
