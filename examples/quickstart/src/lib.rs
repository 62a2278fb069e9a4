use serde::Deserialize;
use trainhost_guest::{Checkpoint, Metrics};

#[derive(Deserialize)]
struct Config {
    num_epochs: u32,
}

fn train(config: Config) -> Result<(), Box<dyn std::error::Error>> {
    let start = match trainhost_guest::get_checkpoint() {
        Some(c) => std::fs::read_to_string(c.path().join("epoch"))?.parse::<u32>()? + 1,
        None => 0,
    };
    for epoch in start..config.num_epochs {
        let loss = 1.0 / f64::from(epoch + 1);
        let dir = trainhost_guest::scratch_dir().join("ckpt");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("epoch"), epoch.to_string())?;
        let rank0 = trainhost_guest::world_rank() == 0;
        let checkpoint = rank0.then(|| Checkpoint::from_directory(&dir));
        let metrics = Metrics::new().with("loss", loss).with("epoch", epoch);
        trainhost_guest::report(metrics, checkpoint)?;
        // Asked to stop (SIGTERM, a preempted machine): the checkpoint just
        // reported is kept; rerunning the same name resumes after it.
        if trainhost_guest::preemption_requested() {
            return Ok(());
        }
    }
    Ok(())
}

trainhost_guest::entry!(train);
