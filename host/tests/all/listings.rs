//! A guest's directory listings: every entry once, with its type; each
//! listing counts among the rank's open files; and a listing holds no
//! host memory for the entries it has not read yet.

use serde_json::json;

use crate::util::*;

/// Every entry of a directory is listed once, with its type, without `.`
/// and `..`; in a directory of long names, where each read from the
/// system holds a few entries, none is skipped or repeated.
#[test]
fn a_listing_names_each_entry_once_with_its_type() {
    let run = run(
        1,
        json!([
            {"mkdir": "d/sub"},
            {"write": "d/a", "text": "x"},
            {"symlink": "d/link", "target": "a"},
            {"list": "d"},
            {"list_many": "long", "files": 600, "name_bytes": 200, "count": 0},
            {"list": "long"},
        ]),
    );
    run.assert_ok();
    let listed: Vec<String> = run
        .stdout(0)
        .into_iter()
        .filter_map(|l| l.strip_prefix("listed: ").map(str::to_owned))
        .collect();
    let (short, long) = listed.split_at(3);
    assert_eq!(short, ["a file", "link symlink", "sub dir"]);
    let expected: Vec<String> = (0..600).map(|i| format!("{i:0>200} file")).collect();
    assert_eq!(long, expected);
}

/// A listing holds a descriptor of the directory, so it counts toward the
/// rank's share of the process's open files: with the limit lowered to
/// 512, a single rank may hold 256, and each listing the guest's standard
/// library opens holds two (the directory and its listing).
#[test]
fn listings_count_among_a_ranks_open_files() {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"steps": [
        {"list_many": "d", "files": 3, "count": 1000},
        {"report": {"i": 1}},
    ]});
    let (stdout, stderr) = run_with_512_open_files(dir.path(), 1, &config);
    assert!(
        stdout.contains("[rank 0] listing failed after 128: Quota exceeded"),
        "{stdout}"
    );
    assert!(stdout.contains("[rank 0] listings: 128\n"), "{stdout}");
    assert!(
        stderr.contains("rank 0 holds 256 open files, directories and directory listings"),
        "{stderr}"
    );
}

/// What a listing holds between calls (one read of entries, 8 KiB at
/// most) counts against the rank's memory limit, as its tensors do: past
/// it, a listing is refused with `insufficient-memory` and the rank goes
/// on; closed listings give their share back.
#[test]
fn listings_count_against_the_memory_limit() {
    let mut steps = vec![json!({"list_many": "d", "files": 3, "count": 0})];
    // More listings, one at a time, than the limit holds at once.
    steps.extend((0..1000).map(|_| json!({"count_entries": "d"})));
    steps.push(json!({"list_many": "d", "count": 100_000}));
    steps.push(json!({"report": {"i": 1}}));
    let (builder, storage, lines) = scripted(1, json!(steps));
    let run = finish(with_max_memory(builder, &storage, 3 << 20), storage, lines);
    run.assert_ok();
    let out = run.stdout(0);
    let counted = out.iter().filter(|l| *l == "entries: 3").count();
    assert_eq!(counted, 1000, "{out:?}");
    let failed = out
        .iter()
        .find_map(|l| l.strip_prefix("listing failed after "))
        .unwrap_or_else(|| panic!("no listing was refused: {out:?}"));
    let (held, error) = failed.split_once(": ").unwrap();
    let held: u64 = held.parse().unwrap();
    // 3 MiB less the guest's linear memory, 8 KiB a listing.
    assert!((64..384).contains(&held), "{out:?}");
    assert!(error.contains("Out of memory"), "{out:?}");
}

/// The host's peak memory while one rank holds `listings` listings of a
/// directory of 8000 names of 200 bytes, each read past its first entry.
fn peak_memory_holding(listings: u64) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"steps": [
        {"list_many": "d", "files": 8000, "name_bytes": 200, "count": listings},
        {"sleep_ms": 60_000},
    ]});
    let config = config.to_string();
    let mut host = HostProcess::spawn(
        &[
            "run",
            trainhost_test_artifacts::TEST_GUEST,
            "--config",
            &config,
            "--storage",
            "st",
            "--name",
            "listings",
        ],
        dir.path(),
    );
    let line = host.wait_for(|l| l.contains("listings: ") || l.contains("listing failed"));
    let status = std::fs::read_to_string(format!("/proc/{}/status", host.child.id()));
    let _ = host.child.kill();
    let _ = host.child.wait();
    assert_eq!(line, format!("[rank 0] listings: {listings}"));
    let status = status.unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in /proc/PID/status:\n{status}"));
    kib << 10
}

/// Holding 200 listings of a large directory costs the host no more
/// memory than holding one: a listing reads its entries as the guest asks
/// for them. Read whole on opening, as wasmtime-wasi's own do, they would
/// hold about 400 MB.
#[test]
fn many_listings_of_a_large_directory_hold_no_host_memory() {
    let one = peak_memory_holding(1);
    let many = peak_memory_holding(200);
    assert!(
        many < one + (64 << 20),
        "holding 200 listings peaked at {} MiB, one at {} MiB",
        many >> 20,
        one >> 20
    );
}
