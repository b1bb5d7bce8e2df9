//! Checks that every rank holds the same values of the settings they must share.
//!
//! Each rank decides on its own how a reduction is carved (the fusion buffer's size, the
//! algorithm, the ring's segments, where tensors are reduced in place), so ranks started
//! with different settings send messages of different lengths, wait for messages that
//! never come, or, with a different operation or scale, quietly compute different sums.
//! [`Communicator::check_same_values`] gathers a list of named values from every rank and
//! fails on every rank at once, naming each value that differs and which ranks hold
//! which, before any of that happens. [`crate::FusionEngine::start`] checks its own
//! settings and the communicator's this way, and so does a gradient plan's first
//! [`crate::GradientPacker::all_reduce`].

use crate::communicator::Communicator;
use crate::error::{Error, Result};

impl Communicator {
    /// Errors on every rank when the ranks hold different `(name, value)` lists, naming
    /// each name whose value differs and which ranks hold which value
    /// (`--seed: ranks 0, 3 = 1, ranks 1-2 = 5`). Every rank passes the same names in
    /// the same order; `what` names the whole list in the error (`flags`,
    /// `fusion engine settings`). Collective: one all-gather of the lists.
    ///
    /// # Errors
    /// [`Error::SettingsDiffer`] naming `what` and the differences (on every rank); a
    /// transport error.
    pub fn check_same_values(&mut self, what: &str, values: &[(String, String)]) -> Result<()> {
        let mine = serde_json::to_vec(values).map_err(|e| Error::Transport {
            rank: self.rank(),
            detail: format!("cannot encode the {what} to compare: {e}"),
        })?;
        let gathered = self.all_gather_bytes(&mine)?;
        let mut all = Vec::with_capacity(gathered.len());
        for (rank, bytes) in gathered.iter().enumerate() {
            let list: Vec<(String, String)> =
                serde_json::from_slice(bytes).map_err(|e| Error::Transport {
                    rank: self.rank(),
                    detail: format!(
                        "rank {rank} sent {what} that do not parse ({e}): the ranks called different collectives"
                    ),
                })?;
            all.push(list);
        }
        let differences = differences(&all);
        if differences.is_empty() {
            return Ok(());
        }
        Err(Error::SettingsDiffer {
            what: what.to_string(),
            differences: differences.join("; "),
        })
    }
}

/// `(name, value)` pairs as [`Communicator::check_same_values`] takes them.
pub(crate) fn named<'a>(
    pairs: impl IntoIterator<Item = (&'a str, String)>,
) -> Vec<(String, String)> {
    pairs
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect()
}

/// For each name whose value is not the same on every rank: `name: rank 0 = A, ranks
/// 1-2 = B` (ranks grouped by value, in order of first appearance). A name missing on a
/// rank shows as `(missing)`.
fn differences(all: &[Vec<(String, String)>]) -> Vec<String> {
    let Some(first) = all.first() else {
        return Vec::new();
    };
    let mut names: Vec<&str> = first.iter().map(|(n, _)| n.as_str()).collect();
    for list in all {
        for (n, _) in list {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    names
        .into_iter()
        .filter_map(|name| {
            let per_rank: Vec<&str> = all
                .iter()
                .map(|list| {
                    list.iter()
                        .find(|(n, _)| n == name)
                        .map_or("(missing)", |(_, v)| v.as_str())
                })
                .collect();
            if per_rank.iter().all(|v| *v == per_rank[0]) {
                return None;
            }
            let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
            for (rank, value) in per_rank.iter().enumerate() {
                match groups.iter_mut().find(|(v, _)| v == value) {
                    Some((_, ranks)) => ranks.push(rank),
                    None => groups.push((value, vec![rank])),
                }
            }
            let groups: Vec<String> = groups
                .into_iter()
                .map(|(value, ranks)| format!("{} = {value}", rank_list(&ranks)))
                .collect();
            Some(format!("{name}: {}", groups.join(", ")))
        })
        .collect()
}

/// `rank 3`, or `ranks 0-2, 5` for several.
fn rank_list(ranks: &[usize]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        runs.push(if i == j {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    let word = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{word} {}", runs.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn differing_values_are_named_with_each_rank_s_value() {
        let out = Communicator::run_local(4, |mut comm| {
            let r = comm.rank();
            let flags = |seed: &str| {
                let resume = (r == 3).to_string();
                list(&[
                    ("--batch-size", "32"),
                    ("--seed", seed),
                    ("--resume", &resume),
                ])
            };
            let resume_differs = comm.check_same_values("flags", &flags("1"));
            let seed = if r == 1 || r == 2 { "5" } else { "1" };
            let differ = comm.check_same_values("flags", &flags(seed));
            let same = comm.check_same_values("flags", &list(&[("--seed", "1")]));
            Ok::<_, Error>((resume_differs, differ, same))
        })
        .unwrap_or_default();
        assert_eq!(out.len(), 4);
        for result in out {
            let Ok((resume_differs, differ, same)) = result else {
                panic!("a rank failed");
            };
            let resume = resume_differs
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert_eq!(
                resume,
                "ranks were started with different flags: --resume: ranks 0-2 = false, \
                 rank 3 = true; start every rank with the same flags"
            );
            let differ = differ.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                differ.contains("--seed: ranks 0, 3 = 1, ranks 1-2 = 5")
                    && !differ.contains("--batch-size"),
                "{differ}"
            );
            assert!(same.is_ok(), "{same:?}");
        }
    }

    #[test]
    fn one_list_on_every_rank_is_no_difference() {
        let one = list(&[("a", "1")]);
        assert!(differences(&[one.clone(), one.clone()]).is_empty());
        assert_eq!(
            differences(&[one, list(&[("b", "1")])]),
            [
                "a: rank 0 = 1, rank 1 = (missing)",
                "b: rank 0 = (missing), rank 1 = 1"
            ]
        );
    }

    #[test]
    fn the_communicator_s_settings_are_compared_by_value() {
        let out = Communicator::run_local(3, |mut comm| {
            if comm.rank() == 2 {
                comm.set_segment_bytes(4096);
                comm.set_min_in_place_piece_bytes(Some(512));
            }
            let settings = comm.shared_settings();
            comm.check_same_values("communicator settings", &settings)
        })
        .expect("run");
        for result in out {
            let message = result.expect_err("the settings differ").to_string();
            assert!(
                message.contains("segment_bytes: ranks 0-1 = ")
                    && message.contains(", rank 2 = 4096")
                    && message
                        .contains("min_in_place_piece_bytes: ranks 0-1 = measured, rank 2 = 512")
                    && !message.contains("auto_threshold_bytes"),
                "{message}"
            );
        }
    }
}
