//! With the `mpi` feature, compile `csrc/mpi_in_place.c` against the MPI
//! library's header, found as the `mpi` crate finds it: with its `mpicc`
//! where there is one, else with the include paths the probe reports.

fn main() {
    println!("cargo:rerun-if-changed=csrc/mpi_in_place.c");
    #[cfg(feature = "mpi")]
    mpi_in_place();
}

#[cfg(feature = "mpi")]
fn mpi_in_place() {
    let library = match build_probe_mpi::probe() {
        Ok(library) => library,
        Err(errors) => {
            for error in errors {
                println!("cargo:warning=looking for MPI: {error}");
            }
            panic!(
                "the `mpi` feature needs an MPI library with its headers: \
                 apt-get install libmpich-dev libclang-dev (or scripts/install-mpi.sh)"
            );
        }
    };
    let mut build = cc::Build::new();
    build.file("csrc/mpi_in_place.c");
    match library.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            build.includes(&library.include_paths);
        }
    }
    build.compile("trainhost_mpi");
}
