//! Scaling efficiency at 2 ranks: `replicated` (gradient all-reduce)
//! against `independent` (no communication, the ideal), both launched through
//! `ringtrain launch --np 2` in the same run.
//!
//! efficiency = replicated words/s / independent words/s; target ≥ 0.9.
//!
//! `cargo bench --bench scaling [-- --np N --rounds R]` (builds `ringtrain` in release mode first).
//! Replicated runs twice: reducing after backward (the CPU default) and overlapped.
//! Any further `train` flags can be given after `--train-args`, e.g.
//! `cargo bench --bench scaling -- --train-args --num-units 256 --batch-size 64`.

use std::path::PathBuf;
use std::process::Command;

const TARGET_EFFICIENCY: f64 = 0.9;

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target")))
}

fn build_ringtrain() -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet", "-p", "ringtrain-launcher"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .map_err(|e| format!("could not run cargo to build ringtrain: {e}"))?;
    if !status.success() {
        return Err("cargo build --release -p ringtrain-launcher failed".into());
    }
    let exe = target_dir().join("release").join("ringtrain");
    exe.is_file()
        .then_some(exe.clone())
        .ok_or_else(|| format!("{} was not built", exe.display()))
}

fn run(
    exe: &PathBuf,
    np: usize,
    update: &str,
    train_args: &[String],
    report: &PathBuf,
) -> Result<serde_json::Value, String> {
    let mut args: Vec<String> = [
        "launch",
        "--np",
        &np.to_string(),
        "--",
        "train",
        "--variable-update",
        update,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(train_args.iter().cloned());
    args.extend([
        "--display-every".to_string(),
        "0".to_string(),
        "--json-report".to_string(),
    ]);
    args.push(report.display().to_string());
    let out = Command::new(exe)
        .args(&args)
        .output()
        .map_err(|e| format!("could not start {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "ringtrain {} failed:\n{}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = std::fs::read_to_string(report)
        .map_err(|e| format!("no report {}: {e}", report.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("bad report: {e}"))
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let np = argv
        .iter()
        .position(|a| a == "--np")
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(2usize);
    let mut train_args: Vec<String> = [
        "--num-units",
        "128",
        "--vocab-size",
        "4000",
        "--batch-size",
        "64",
        "--src-max-len",
        "30",
        "--threads",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(i) = argv.iter().position(|a| a == "--train-args") {
        train_args = argv[i + 1..]
            .iter()
            .filter(|a| *a != "--bench")
            .cloned()
            .collect();
    }
    let exe = match build_ringtrain() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let dir = std::env::temp_dir();
    let pid = std::process::id();
    // Runs alternate (independent, replicated, overlapped, independent, ...) and each
    // configuration keeps its best round, so a burst of load from other processes hits
    // every configuration alike instead of deciding the ratio.
    let rounds = argv
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| argv.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(3usize)
        .max(1);
    let runs: [(&str, &str, &[&str]); 3] = [
        ("independent", "independent", &[]),
        ("replicated", "replicated", &["--overlap-backward", "off"]),
        (
            "replicated-overlap",
            "replicated",
            &["--overlap-backward", "on"],
        ),
    ];
    let mut figures: Vec<Option<serde_json::Value>> = vec![None, None, None];
    for round in 0..rounds {
        for (k, (label, update, extra)) in runs.iter().enumerate() {
            let report = dir.join(format!("ringtrain-scaling-{pid}-{label}.json"));
            let mut args = train_args.clone();
            args.extend(extra.iter().map(|s| s.to_string()));
            match run(&exe, np, update, &args, &report) {
                Ok(v) => {
                    let _ = std::fs::remove_file(&report);
                    let w = v["words_per_sec"].as_f64().unwrap_or(0.0);
                    println!("  round {round}: {label:<20} {w:>10.1} words/s");
                    let best = figures[k]
                        .as_ref()
                        .and_then(|b| b["words_per_sec"].as_f64())
                        .unwrap_or(0.0);
                    if w > best {
                        figures[k] = Some(v);
                    }
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    let figures: Vec<serde_json::Value> =
        figures.into_iter().map(Option::unwrap_or_default).collect();
    let wps = |v: &serde_json::Value| v["words_per_sec"].as_f64().unwrap_or(0.0);
    let comm_ms =
        |v: &serde_json::Value| v["breakdown"]["communication"].as_f64().unwrap_or(0.0) * 1e3;
    println!(
        "scaling: {np} ranks, best of {rounds} alternating rounds, train {}",
        train_args.join(" ")
    );
    println!(
        "  baseline  independent (no communication)      : {:>10.1} words/s",
        wps(&figures[0])
    );
    println!(
        "  ours      replicated (all-reduce after backward): {:>10.1} words/s  (communication {:.2} ms/step)",
        wps(&figures[1]),
        comm_ms(&figures[1])
    );
    println!(
        "  ours      replicated (overlapped with backward) : {:>10.1} words/s  (exposed communication {:.2} ms/step)",
        wps(&figures[2]),
        comm_ms(&figures[2])
    );
    let eff = wps(&figures[1]) / wps(&figures[0]);
    let eff_overlap = wps(&figures[2]) / wps(&figures[0]);
    println!(
        "  ratio     efficiency (default, after backward): {eff:.3}  (target >= {TARGET_EFFICIENCY}: {})",
        if eff >= TARGET_EFFICIENCY { "met" } else { "NOT met" }
    );
    println!("  ratio     efficiency (overlapped)             : {eff_overlap:.3}");
}
