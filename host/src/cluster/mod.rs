//! Where this process sits among the processes a launcher started for one
//! job: `mpiexec` (MPICH's Hydra, Open MPI), or Slurm's `srun`.
//!
//! A run lives in one process today, so a process that finds itself one of
//! several refuses to start ([`crate::Error::SeveralProcesses`]): each
//! would otherwise train the whole run on its own, and with a generated
//! run name nothing would even collide. Launchers say how many processes
//! they started, and which one this is, in the environment they give each
//! process; those variables are read here and nowhere else.

/// This process among those a launcher started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch {
    /// This process's index, from 0.
    pub index: u32,
    /// How many processes the launcher started.
    pub processes: u32,
    /// The launcher, for messages.
    pub launcher: &'static str,
}

/// The variables each launcher sets: (launcher, size, index). Slurm's batch
/// script sees `SLURM_NTASKS` and `SLURM_PROCID` too, though it is one
/// process: only a step that `srun` started has `SLURM_STEP_NUM_TASKS`.
const LAUNCHERS: [(&str, &str, &str); 3] = [
    // MPICH's Hydra (also behind Intel MPI), then Open MPI; either is
    // started as `mpiexec` or `mpirun`.
    ("mpiexec", "PMI_SIZE", "PMI_RANK"),
    ("mpiexec", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
];

/// How this process was launched, if by one of the known launchers, from
/// the environment `var` reads.
pub(crate) fn detect(var: impl Fn(&str) -> Option<String>) -> Option<Launch> {
    LAUNCHERS.iter().find_map(|(launcher, size, index)| {
        let processes = var(size)?.trim().parse().ok()?;
        let index = var(index).and_then(|i| i.trim().parse().ok()).unwrap_or(0);
        Some(Launch {
            index,
            processes,
            launcher,
        })
    })
}

/// Refuse to run when a launcher started several processes for this job.
pub(crate) fn check_single_process() -> Result<(), crate::error::Error> {
    match detect(|name| std::env::var(name).ok()) {
        Some(launch) if launch.processes > 1 => Err(crate::error::Error::SeveralProcesses {
            index: launch.index,
            processes: launch.processes,
            launcher: launch.launcher,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Option<Launch> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        detect(|name| vars.get(name).cloned())
    }

    #[test]
    fn each_launcher_is_read_from_its_own_variables() {
        assert_eq!(launch(&[]), None);
        assert_eq!(
            launch(&[("PMI_SIZE", "2"), ("PMI_RANK", "1")]),
            Some(Launch {
                index: 1,
                processes: 2,
                launcher: "mpiexec"
            })
        );
        assert_eq!(
            launch(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "3")])
                .map(|l| (l.index, l.processes)),
            Some((3, 4))
        );
        assert_eq!(
            launch(&[("SLURM_STEP_NUM_TASKS", "8"), ("SLURM_PROCID", "5")]).map(|l| (
                l.launcher,
                l.index,
                l.processes
            )),
            Some(("srun", 5, 8))
        );
    }

    #[test]
    fn a_slurm_batch_script_is_one_process() {
        assert_eq!(
            launch(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "0")]),
            None
        );
    }

    #[test]
    fn garbage_is_no_launch() {
        assert_eq!(launch(&[("PMI_SIZE", "two")]), None);
    }
}
