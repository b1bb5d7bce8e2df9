//! The `ringtrain` command.
fn main() {
    eprintln!("ringtrain: the trainer is not written yet");
    std::process::exit(2);
}
