//! The examples for the launchers people run: a Slurm batch script and a
//! Kubeflow MPIJob manifest. Neither launcher runs here: the script is
//! checked by bash's parser and the manifest by a YAML parser (PyYAML,
//! from the test servers' virtual environment, found through
//! `TRAINHOST_MOTO_SERVER`), and both for what trainhost needs of them.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn example(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(path)
}

#[test]
fn the_slurm_script_parses_and_starts_one_trainhost_per_node_that_resumes() {
    let script = example("slurm/train.sbatch");
    let out = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&script).unwrap();
    for needed in [
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --signal=TERM@",
        "srun --mpi=pmi2 \"$TRAINHOST\" run \"$GUEST\"",
        "--workers $((SLURM_NNODES * RANKS_PER_NODE))",
        // Stable across requeues, so a requeued job resumes.
        "--name \"digits-$SLURM_JOB_ID\"",
    ] {
        assert!(text.contains(needed), "{needed:?} missing");
    }
}

/// The manifest as JSON, through PyYAML; `None` (skipped) without it.
fn manifest() -> Option<Value> {
    let python = crate::util::venv_python("PyYAML")?;
    let out = Command::new(python)
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(example("kubernetes/mpijob.yaml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docs: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(docs.len(), 1);
    docs.into_iter().next()
}

#[test]
fn the_mpijob_starts_one_trainhost_per_worker_with_credentials_where_it_runs() {
    let Some(job) = manifest() else {
        return;
    };
    assert_eq!(job["apiVersion"], "kubeflow.org/v2beta1");
    assert_eq!(job["kind"], "MPIJob");
    assert_eq!(job["spec"]["mpiImplementation"], "MPICH");
    let specs = &job["spec"]["mpiReplicaSpecs"];
    let workers = specs["Worker"]["replicas"].as_u64().unwrap();
    let command: Vec<&str> = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    // One trainhost per worker pod.
    assert_eq!(&command[..3], ["mpirun", "-n", &workers.to_string()]);
    assert_eq!(command[4], "run");
    let ranks: u64 = command[command.iter().position(|a| *a == "--workers").unwrap() + 1]
        .parse()
        .unwrap();
    assert_eq!(ranks % workers, 0, "--workers splits evenly over the pods");
    let storage = command[command.iter().position(|a| *a == "--storage").unwrap() + 1];
    assert!(
        storage.starts_with("s3://"),
        "shared by every pod: {storage}"
    );
    let env = &specs["Worker"]["template"]["spec"]["containers"][0]["env"];
    let names: Vec<&str> = env
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for needed in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] {
        assert!(names.contains(&needed), "{needed} on the workers");
    }
}
