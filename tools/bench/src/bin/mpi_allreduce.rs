//! The baseline of the `nodes` benchmarks: a bare `MPI_Allreduce` (f32,
//! sum) between the processes `mpiexec` started, timed as the bench guest
//! times its all-reduce (each call on its own, the median). Usage:
//! `mpiexec -n P mpi-allreduce FLOATS CALLS`; process 0 prints the median
//! nanoseconds per call.

use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::traits::{Communicator, CommunicatorCollectives};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let (Some(Ok(floats)), Some(Ok(calls))) = (args.next(), args.next()) else {
        eprintln!("usage: mpiexec -n P mpi-allreduce FLOATS CALLS");
        std::process::exit(2);
    };
    let universe = mpi::initialize().expect("MPI initializes");
    let world = universe.world();
    let data = vec![world.rank() as f32; floats];
    let mut out = vec![0f32; floats];
    // One call to warm up, as the guest makes one before timing.
    world.all_reduce_into(&data[..], &mut out[..], SystemOperation::sum());
    let mut times: Vec<u128> = (0..calls)
        .map(|_| {
            let started = Instant::now();
            world.all_reduce_into(&data[..], &mut out[..], SystemOperation::sum());
            started.elapsed().as_nanos()
        })
        .collect();
    times.sort_unstable();
    if world.rank() == 0 {
        println!("{}", times[times.len() / 2]);
    }
}
