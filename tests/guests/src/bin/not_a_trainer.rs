//! A WASI command, not a trainhost guest: the host must refuse it with a
//! message saying what to build instead.

fn main() {
    println!("hello from a command");
}
