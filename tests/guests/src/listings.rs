//! The script's steps that list directories:
//! - `{"list": DIR}`: prints `listed: NAME TYPE` for each entry of DIR, by
//!   name, TYPE one of `file`, `dir`, `symlink`, `other`
//! - `{"list_many": DIR, "count": N, "files": F, "name_bytes": B}`: makes
//!   F files in DIR, each name B bytes long, then opens N listings of DIR,
//!   reads one entry of each and keeps them all open to the end of the
//!   run; prints `listings: K` and, if a listing failed, `listing failed
//!   after K: ERROR` before it
//!
//! Paths are below the scratch directory unless absolute.

use std::fs;

use serde_json::{Map, Value};

/// Run `step` if it is one of these; `Ok(false)` if it is not.
/// `text(key)` is the step's string under `key`, placeholders replaced.
pub(crate) fn run(
    step: &Map<String, Value>,
    text: impl Fn(&str) -> Option<String>,
) -> Result<bool, String> {
    let io = |e: std::io::Error| e.to_string();
    let number = |key: &str| step.get(key).and_then(Value::as_u64).unwrap_or(0);
    if let Some(dir) = text("list") {
        let mut listed = Vec::new();
        for entry in fs::read_dir(crate::scratch_path(&dir)).map_err(io)? {
            let entry = entry.map_err(io)?;
            let kind = entry.file_type().map_err(io)?;
            let kind = if kind.is_file() {
                "file"
            } else if kind.is_dir() {
                "dir"
            } else if kind.is_symlink() {
                "symlink"
            } else {
                "other"
            };
            listed.push(format!("{} {kind}", entry.file_name().to_string_lossy()));
        }
        listed.sort();
        for line in listed {
            println!("listed: {line}");
        }
    } else if let Some(dir) = text("list_many") {
        let dir = crate::scratch_path(&dir);
        fs::create_dir_all(&dir).map_err(io)?;
        let width = number("name_bytes").max(8) as usize;
        for i in 0..number("files") {
            fs::write(dir.join(format!("{i:0>width$}")), "").map_err(io)?;
        }
        let mut kept = Vec::new();
        for i in 0..number("count") {
            match fs::read_dir(&dir) {
                Ok(mut listing) => match listing.next() {
                    Some(Err(e)) => {
                        println!("listing failed after {i}: {e}");
                        break;
                    }
                    _ => kept.push(listing),
                },
                Err(e) => {
                    println!("listing failed after {i}: {e}");
                    break;
                }
            }
        }
        println!("listings: {}", kept.len());
        // Held, not closed, to the end of the run.
        std::mem::forget(kept);
    } else {
        return Ok(false);
    }
    Ok(true)
}
