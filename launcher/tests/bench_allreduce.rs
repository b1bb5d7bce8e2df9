//! `ringtrain bench allreduce` under mpirun: the fusion-overhead rows (baseline, fused
//! step and their ratio, per way of submitting) are printed and written to the `--json`
//! file beside the table's rows, and `--plot` draws the table. Times are only checked to be
//! positive numbers.

mod support;

use std::time::Duration;

use support::{output_within, ringtrain, texts};

const LIMIT: Duration = Duration::from_secs(180);

#[test]
fn fusion_overhead_rows_are_printed_and_written_as_json_entries() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("allreduce.json");
    let plot = dir.path().join("busbw.svg");
    let mut cmd = ringtrain();
    cmd.args(["launch", "--np", "2", "--", "bench", "allreduce"])
        .args([
            "--min-bytes",
            "4K",
            "--max-bytes",
            "8K",
            "--small-tensors",
            "0",
        ])
        .args(["--fusion-tensors", "3,5", "--fusion-tensor-bytes", "256,1K"])
        .args(["--fusion-steps", "2", "--json"])
        .arg(&json)
        .arg("--plot")
        .arg(&plot);
    let out = output_within(cmd, LIMIT, "ringtrain bench allreduce");
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");

    // Printed: a header naming the columns, then one row per case and submission.
    assert!(stdout.contains("# fusion overhead:"), "{stdout}");
    let header = stdout
        .lines()
        .find(|l| l.contains("fusion_overhead") && l.contains("allreduce_us"))
        .unwrap_or_else(|| panic!("no fusion-overhead header:\n{stdout}"));
    assert!(
        header.contains("submission") && header.contains("fused_us"),
        "{header}"
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() == 7 && (f[3] == "each" || f[3] == "group"))
        .collect();
    let mut printed: Vec<(usize, usize, &str)> = Vec::new();
    for f in &rows {
        let n: usize = f[0].parse().unwrap();
        let b: usize = f[1].parse().unwrap();
        assert_eq!(f[2].parse::<usize>().unwrap(), n * b, "total bytes: {f:?}");
        for t in [f[4], f[5]] {
            let t: f64 = t.parse().unwrap();
            assert!(t.is_finite() && t > 0.0, "{f:?}");
        }
        let ratio: f64 = f[6].strip_suffix('x').unwrap().parse().unwrap();
        assert!(ratio.is_finite() && ratio > 0.0, "{f:?}");
        printed.push((n, b, f[3]));
    }
    let mut expected = Vec::new();
    for n in [3, 5] {
        for b in [256, 1024] {
            for s in ["each", "group"] {
                expected.push((n, b, s));
            }
        }
    }
    assert_eq!(printed, expected, "{stdout}");

    // Written: the table's rows, then one entry per printed row.
    let value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let entries = value.as_array().expect("a JSON array");
    assert!(
        entries
            .iter()
            .any(|e| e["algorithm"] == "ring" && e["bytes"] == 4096),
        "the table's rows stay: {value}"
    );
    let overhead: Vec<&serde_json::Value> = entries
        .iter()
        .filter(|e| e["case"] == "fusion_overhead")
        .collect();
    assert_eq!(overhead.len(), expected.len(), "{value}");
    for (e, (n, b, s)) in overhead.iter().zip(&expected) {
        assert_eq!(e["ranks"], 2, "{e}");
        assert_eq!(e["tensors"], *n, "{e}");
        assert_eq!(e["tensor_bytes"], *b, "{e}");
        assert_eq!(e["submission"], *s, "{e}");
        let ratio = e["ratio"].as_f64().expect("ratio is a number");
        let fused = e["fused_us"].as_f64().expect("fused_us");
        let base = e["all_reduce_us"].as_f64().expect("all_reduce_us");
        assert!(ratio > 0.0 && fused > 0.0 && base > 0.0, "{e}");
        assert!(
            ((fused / base) / ratio - 1.0).abs() < 1e-9,
            "ratio = fused / base: {e}"
        );
    }

    // The plot: bus bandwidth against size, a line with a point per size for each
    // algorithm of the table (ring and MPI's).
    let svg = std::fs::read_to_string(&plot).unwrap();
    for text in [
        "all-reduce bus bandwidth, 2 ranks, f32",
        "ring",
        "mpi",
        "busbw (GB/s)",
    ] {
        assert!(svg.contains(text), "the plot lacks `{text}`");
    }
    assert_eq!(svg.matches("<circle").count(), 4, "2 sizes x 2 algorithms");
}
