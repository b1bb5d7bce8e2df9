//! Calibration: the compute profile from a 1-rank `train --json-report`, and a link's
//! alpha and beta fitted to a `bench allreduce --json` table.

use std::path::Path;

use ringtrain_train::RunReport;

use super::model::{Link, Profile};
use crate::error::{LauncherError, Result};

/// What to run to make a report the model can read.
pub const MAKE_REPORT: &str = "make one with `ringtrain train --json-report FILE ...` on one \
rank (the same model flags as the runs to predict)";

/// What to run to make a bench table the model can read.
pub const MAKE_BENCH: &str = "make one with `ringtrain launch --np 2 -- bench allreduce --json \
FILE` (at least 2 ranks, at least 2 sizes)";

/// The profile of `report` (read from `path`, named in errors), which must be a 1-rank
/// run without a pipeline. Without `gradient_ready` (a device-resident run on one rank,
/// whose gradients never reach the host, or an older report) the whole gradient counts
/// as ready at the end of backward and [`Profile::ready_measured`] is false.
///
/// # Errors
/// [`LauncherError::InvalidValue`] for `--report` naming the file, what is wrong and how
/// to make a usable one.
pub fn profile_of(report: &RunReport, path: &Path) -> Result<Profile> {
    let bad = |reason: String| LauncherError::invalid("--report", path.display(), reason);
    if report.ranks != 1 {
        return Err(bad(format!(
            "it is a report of {} ranks; the model is calibrated on one rank: {MAKE_REPORT}",
            report.ranks
        )));
    }
    if report.pipeline.is_some() || report.config.exchange.pipeline_stages > 1 {
        return Err(bad(format!(
            "it is a pipelined run; calibrate on the whole model: {MAKE_REPORT} without \
             --pipeline-stages"
        )));
    }
    if report.timed_batches == 0 || report.timed_words <= 0.0 {
        return Err(bad(format!(
            "it has no timed batches; {MAKE_REPORT} with --timed-batches 1 or more"
        )));
    }
    let rank = report
        .per_rank
        .first()
        .ok_or_else(|| bad(format!("it lists no rank's figures; {MAKE_REPORT}")))?;
    if rank.gradient_ready.is_empty() && report.parameters == 0 {
        return Err(bad(format!(
            "it lists neither gradient ranges (`gradient_ready`) nor parameters; {MAKE_REPORT}"
        )));
    }
    let q = &rank.compute_quantiles;
    if q.iter().any(|v| !v.is_finite() || *v < 0.0) || q.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad(format!(
            "its `compute_quantiles` are not seconds in increasing order (was it edited?); \
             {MAKE_REPORT}"
        )));
    }
    let b = &report.breakdown;
    let data = &report.config.data;
    let batch = data.total_batch_size.unwrap_or(data.batch_size) as f64;
    Ok(Profile {
        words_per_step: report.timed_words / report.timed_batches as f64,
        data_wait: b.data_wait,
        forward: b.forward,
        backward: b.backward,
        optimizer: b.optimizer,
        // A run whose gradients never left the device (one rank on cuda) or a report of an
        // older version has no ready-times: the whole gradient is taken as ready at the end
        // of backward, which hides nothing behind it.
        ready: if rank.gradient_ready.is_empty() {
            vec![(report.parameters as f64 * 4.0, b.backward)]
        } else {
            rank.gradient_ready
                .iter()
                .map(|r| (r.elements as f64 * 4.0, r.seconds))
                .collect()
        },
        ready_measured: !rank.gradient_ready.is_empty(),
        compute_quantiles: rank.compute_quantiles.clone(),
        boundary_bytes: batch
            * data.src_max_len as f64
            * report.config.model.num_units as f64
            * 4.0,
    })
}

/// Reads `path` as a 1-rank run report and returns its profile and the report.
///
/// # Errors
/// [`LauncherError::InvalidValue`] for `--report`: missing, unreadable or malformed file,
/// or a report [`profile_of`] cannot use.
pub fn read_profile(path: &Path) -> Result<(Profile, RunReport)> {
    let bad = |reason: String| LauncherError::invalid("--report", path.display(), reason);
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("it cannot be read ({e}); {MAKE_REPORT}")))?;
    let report: RunReport = serde_json::from_str(&text)
        .map_err(|e| bad(format!("it is not a run report ({e}); {MAKE_REPORT}")))?;
    let profile = profile_of(&report, path)?;
    Ok((profile, report))
}

/// A link fitted to a bench table.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// The algorithm whose rows were fitted.
    pub algorithm: String,
    /// alpha and beta.
    pub link: Link,
    /// Rows fitted.
    pub rows: usize,
    /// The largest |fitted - measured| / measured over the rows.
    pub max_relative_error: f64,
}

/// One measured all-reduce: ranks, bytes, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Ranks.
    pub ranks: usize,
    /// Message bytes.
    pub bytes: f64,
    /// Seconds per all-reduce.
    pub seconds: f64,
}

/// Fits `t = 2(N-1)/N * bytes * beta + 2(N-1) * alpha` to `samples` by least squares on
/// the relative error (each row weighted by 1 / t², so that small messages, which tell
/// alpha, count as much as large ones, which tell beta). A negative coefficient is set
/// to 0 and the other refitted alone. `None` with fewer than two distinct sizes.
pub fn fit_link(samples: &[Sample]) -> Option<(Link, f64)> {
    let rows: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.ranks >= 2 && s.seconds > 0.0 && s.bytes > 0.0)
        .map(|s| {
            let n1 = (s.ranks - 1) as f64;
            let x = 2.0 * n1 / s.ranks as f64 * s.bytes;
            let z = 2.0 * n1;
            (x / s.seconds, z / s.seconds)
        })
        .collect();
    let mut sizes: Vec<f64> = samples.iter().map(|s| s.bytes).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    if rows.len() < 2 || sizes.len() < 2 {
        return None;
    }
    let (mut uu, mut uv, mut vv, mut u1, mut v1) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(u, v) in &rows {
        uu += u * u;
        uv += u * v;
        vv += v * v;
        u1 += u;
        v1 += v;
    }
    let det = uu * vv - uv * uv;
    let (mut beta, mut alpha) = if det.abs() > 0.0 {
        ((u1 * vv - v1 * uv) / det, (uu * v1 - uv * u1) / det)
    } else {
        (u1 / uu, 0.0)
    };
    if alpha < 0.0 {
        alpha = 0.0;
        beta = u1 / uu;
    }
    if beta < 0.0 {
        beta = 0.0;
        alpha = v1 / vv;
    }
    let link = Link { alpha, beta };
    let worst = samples
        .iter()
        .filter(|s| s.ranks >= 2 && s.seconds > 0.0 && s.bytes > 0.0)
        .map(|s| {
            let (bw, lat) = super::model::ring_all_reduce(link, s.ranks, s.bytes);
            ((bw + lat) - s.seconds).abs() / s.seconds
        })
        .fold(0.0, f64::max);
    Some((link, worst))
}

/// The table rows of a `bench allreduce --json` file as (algorithm, sample). The ranks
/// are the row's `ranks` when it has one, else read back from `busbw / algbw =
/// 2(N-1)/N`; entries without an `algorithm` (the fusion-overhead cases) are skipped.
///
/// # Errors
/// A description of what is malformed.
pub fn bench_samples(text: &str) -> std::result::Result<Vec<(String, Sample)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("it is not JSON ({e})"))?;
    let entries = value
        .as_array()
        .ok_or("it is not a JSON array of bench rows")?;
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let Some(algorithm) = e.get("algorithm").and_then(|a| a.as_str()) else {
            continue;
        };
        let num = |key: &str| {
            e.get(key)
                .and_then(|v| v.as_f64())
                .ok_or_else(|| format!("row {i} ({algorithm}) has no number `{key}`"))
        };
        let bytes = num("bytes")?;
        let time_us = num("time_us")?;
        let ranks = match e.get("ranks").and_then(|v| v.as_u64()) {
            Some(r) => r as usize,
            None => {
                let (alg, bus) = (num("algbw")?, num("busbw")?);
                if alg <= 0.0 {
                    continue;
                }
                let ratio = bus / alg;
                if ratio >= 2.0 {
                    return Err(format!("row {i} has busbw/algbw {ratio} (at most 2)"));
                }
                (2.0 / (2.0 - ratio)).round() as usize
            }
        };
        out.push((
            algorithm.to_string(),
            Sample {
                ranks,
                bytes,
                seconds: time_us * 1e-6,
            },
        ));
    }
    Ok(out)
}

/// Every algorithm's fit in `path` (a `bench allreduce --json` file), in the order the
/// algorithms first appear; algorithms with too few multi-rank sizes are left out.
///
/// # Errors
/// [`LauncherError::InvalidValue`] for `--bench`: missing, unreadable or malformed file.
pub fn read_all_links(path: &Path) -> Result<Vec<Fit>> {
    let bad = |reason: String| LauncherError::invalid("--bench", path.display(), reason);
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("it cannot be read ({e}); {MAKE_BENCH}")))?;
    let samples = bench_samples(&text).map_err(|e| bad(format!("{e}; {MAKE_BENCH}")))?;
    let mut names: Vec<&str> = Vec::new();
    for (a, _) in &samples {
        if !names.contains(&a.as_str()) {
            names.push(a);
        }
    }
    Ok(names
        .iter()
        .filter_map(|name| {
            let rows: Vec<Sample> = samples
                .iter()
                .filter(|(a, s)| a == name && s.ranks >= 2)
                .map(|(_, s)| *s)
                .collect();
            fit_link(&rows).map(|(link, worst)| Fit {
                algorithm: name.to_string(),
                link,
                rows: rows.len(),
                max_relative_error: worst,
            })
        })
        .collect())
}

/// Reads `path` (a `bench allreduce --json` file) and fits `algorithm`'s rows (`None`:
/// `auto` if measured, else `ring`).
///
/// # Errors
/// [`LauncherError::InvalidValue`] for `--bench`: missing, unreadable or malformed file,
/// no such algorithm, or too few multi-rank sizes to fit.
pub fn read_link(path: &Path, algorithm: Option<&str>) -> Result<Fit> {
    let bad = |reason: String| LauncherError::invalid("--bench", path.display(), reason);
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("it cannot be read ({e}); {MAKE_BENCH}")))?;
    let samples = bench_samples(&text).map_err(|e| bad(format!("{e}; {MAKE_BENCH}")))?;
    let mut present: Vec<&str> = samples.iter().map(|(a, _)| a.as_str()).collect();
    present.dedup();
    let chosen = match algorithm {
        Some(a) => a.to_string(),
        None if present.contains(&"auto") => "auto".to_string(),
        None => "ring".to_string(),
    };
    let rows: Vec<Sample> = samples
        .iter()
        .filter(|(a, s)| *a == chosen && s.ranks >= 2)
        .map(|(_, s)| *s)
        .collect();
    let (link, worst) = fit_link(&rows).ok_or_else(|| {
        bad(format!(
            "it holds {} row(s) of algorithm `{chosen}` measured on 2 or more ranks, and a \
             fit needs 2 sizes or more (algorithms in it: {}); {MAKE_BENCH}",
            rows.len(),
            if present.is_empty() {
                "none".to_string()
            } else {
                present.join(", ")
            }
        ))
    })?;
    Ok(Fit {
        algorithm: chosen,
        link,
        rows: rows.len(),
        max_relative_error: worst,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(link: Link, ranks: usize) -> Vec<Sample> {
        [4096.0, 65536.0, 1048576.0, 16777216.0]
            .iter()
            .map(|&bytes| {
                let (bw, lat) = super::super::model::ring_all_reduce(link, ranks, bytes);
                Sample {
                    ranks,
                    bytes,
                    seconds: bw + lat,
                }
            })
            .collect()
    }

    #[test]
    fn the_fit_recovers_alpha_and_beta() {
        let truth = Link {
            alpha: 5e-6,
            beta: 1.0 / 10e9,
        };
        for ranks in [2, 3, 8] {
            let (fit, worst) = fit_link(&samples(truth, ranks)).expect("fit");
            assert!((fit.alpha - truth.alpha).abs() < 1e-12, "{fit:?}");
            assert!((fit.beta - truth.beta).abs() < 1e-18, "{fit:?}");
            assert!(worst < 1e-9);
        }
        // Rows of two rank counts fit together.
        let mut both = samples(truth, 2);
        both.extend(samples(truth, 4));
        let (fit, _) = fit_link(&both).expect("fit");
        assert!((fit.alpha - truth.alpha).abs() < 1e-12, "{fit:?}");
    }

    #[test]
    fn noise_gives_a_least_squares_answer_and_no_negative_alpha() {
        // Pure bandwidth with a little noise: alpha would come out below 0; it is 0.
        let s = vec![
            Sample {
                ranks: 2,
                bytes: 1000.0,
                seconds: 1.0e-6,
            },
            Sample {
                ranks: 2,
                bytes: 2000.0,
                seconds: 2.2e-6,
            },
        ];
        let (fit, _) = fit_link(&s).expect("fit");
        assert_eq!(fit.alpha, 0.0);
        assert!(fit.beta > 0.0);
        // One size cannot tell alpha from beta.
        assert!(fit_link(&s[..1]).is_none());
        let single_rank = vec![
            Sample {
                ranks: 1,
                bytes: 1.0,
                seconds: 1.0,
            };
            3
        ];
        assert!(fit_link(&single_rank).is_none());
    }

    #[test]
    fn bench_rows_give_their_ranks_and_skip_other_entries() {
        // busbw / algbw = 1.5 means 4 ranks; 1.0 means 2.
        let text = r#"[
            {"bytes": 4096, "algorithm": "ring", "time_us": 10.0, "algbw": 0.4, "busbw": 0.6},
            {"bytes": 8192, "algorithm": "mpi", "time_us": 12.0, "algbw": 0.5, "busbw": 0.5, "ranks": 3},
            {"case": "fusion_overhead", "ranks": 4, "ratio": 1.2}
        ]"#;
        let rows = bench_samples(text).expect("rows");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, "ring");
        assert_eq!(rows[0].1.ranks, 4);
        assert!((rows[0].1.seconds - 10e-6).abs() < 1e-15);
        assert_eq!(rows[1].1.ranks, 3);
        assert!(bench_samples("{}").unwrap_err().contains("array"));
        assert!(bench_samples("[{\"algorithm\": \"ring\"}]")
            .unwrap_err()
            .contains("`bytes`"));
        assert!(bench_samples("not json").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn errors_name_the_file_and_how_to_make_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.json");
        let e = read_link(&missing, None).unwrap_err().to_string();
        assert!(e.contains("--bench") && e.contains("missing.json"), "{e}");
        assert!(e.contains("bench allreduce --json"), "{e}");
        let e = read_profile(&missing).unwrap_err().to_string();
        assert!(e.contains("--report") && e.contains("--json-report"), "{e}");

        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{\"ranks\": 1}").expect("write");
        let e = read_profile(&bad).unwrap_err().to_string();
        assert!(
            e.contains("not a run report") && e.contains("bad.json"),
            "{e}"
        );
        let e = read_link(&bad, None).unwrap_err().to_string();
        assert!(e.contains("array"), "{e}");

        let one = dir.path().join("one.json");
        std::fs::write(
            &one,
            r#"[{"bytes": 4096, "algorithm": "ring", "time_us": 1.0, "algbw": 1.0, "busbw": 1.0}]"#,
        )
        .expect("write");
        let e = read_link(&one, None).unwrap_err().to_string();
        assert!(e.contains("1 row(s) of algorithm `ring`"), "{e}");
        let e = read_link(&one, Some("rd")).unwrap_err().to_string();
        assert!(
            e.contains("`rd`") && e.contains("algorithms in it: ring"),
            "{e}"
        );
    }

    #[test]
    fn a_report_without_ready_times_counts_the_gradient_ready_at_the_end_of_backward() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/predict-one-rank.json");
        let (measured, mut report) = read_profile(&path).expect("the fixture");
        assert!(measured.ready_measured && measured.ready.len() > 1);
        let bytes = report.parameters as f64 * 4.0;
        assert!((measured.gradient_bytes() - bytes).abs() < 1e-9);
        report.per_rank[0].gradient_ready.clear();
        let fallback = profile_of(&report, &path).expect("a profile");
        assert!(!fallback.ready_measured);
        assert_eq!(fallback.ready, vec![(bytes, report.breakdown.backward)]);
        report.parameters = 0;
        let e = profile_of(&report, &path).unwrap_err().to_string();
        assert!(e.contains("neither gradient ranges"), "{e}");
    }

    #[test]
    fn the_steps_spread_comes_from_the_report_and_is_none_when_absent() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/predict-one-rank.json");
        // The fixture predates the quantiles: no spread known.
        let (profile, mut report) = read_profile(&path).expect("the fixture");
        assert!(profile.compute_quantiles.is_empty());
        report.per_rank[0].compute_quantiles = vec![0.001, 0.002, 0.004];
        let profile = profile_of(&report, &path).expect("a profile");
        assert_eq!(profile.compute_quantiles, vec![0.001, 0.002, 0.004]);
        // Quantiles out of order, negative or not numbers are refused, naming them.
        for bad in [
            vec![0.002, 0.001],
            vec![-0.001, 0.001],
            vec![0.001, f64::NAN],
        ] {
            report.per_rank[0].compute_quantiles = bad;
            let e = profile_of(&report, &path).unwrap_err().to_string();
            assert!(
                e.contains("--report") && e.contains("compute_quantiles"),
                "{e}"
            );
        }
    }
}
