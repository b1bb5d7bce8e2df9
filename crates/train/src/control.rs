//! The control plane: the messages ranks exchange about the run rather than its data.
//!
//! [`Control`] owns a duplicate of the world communicator (`MPI_Comm_dup`, or the local
//! transport's equivalent), so its messages never mix with the gradient traffic of the
//! fusion engine, which owns the original and runs it on its own thread. Agreements
//! (did every rank load the checkpoint?), checks that ranks share a value, the step's
//! figures and the final per-rank summaries all go through it.

use ringtrain_collective::{AllReduceOptions, Communicator, ReduceOp};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// The control communicator of one rank.
pub struct Control {
    comm: Communicator,
}

impl Control {
    /// A control plane beside `world` (collective: every rank calls it).
    ///
    /// # Errors
    /// The transport's, when it cannot duplicate the communicator.
    pub fn beside(world: &Communicator) -> Result<Self> {
        Ok(Control {
            comm: world.duplicate()?,
        })
    }

    /// Names the training step in stall warnings and errors of every communicator of
    /// this rank (the control plane shares it with the data path).
    pub fn set_step(&self, step: usize) {
        self.comm.set_stall_context(format!("training step {step}"));
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Turns a per-rank success or failure into the same outcome on every rank: a rank
    /// that failed returns its own error, the others [`Error::OtherRanksFailed`].
    ///
    /// # Errors
    /// As described, or a transport error.
    pub fn agree<T>(&mut self, what: &str, local: Result<T>) -> Result<T> {
        let mut failed = [f64::from(u8::from(local.is_err()))];
        self.comm
            .all_reduce(&mut failed, &AllReduceOptions::sum())?;
        match local {
            Err(e) => Err(e),
            Ok(_) if failed[0] > 0.0 => Err(Error::OtherRanksFailed {
                ranks: failed[0] as usize,
                what: what.to_string(),
            }),
            Ok(v) => Ok(v),
        }
    }

    /// Errors on every rank when the ranks hold different values of `what`.
    ///
    /// # Errors
    /// [`Error::RankMismatch`] naming `what` and the range of values, or a transport error.
    pub fn check_same(&mut self, what: &str, value: f64) -> Result<()> {
        let mut low = [value];
        let mut high = [value];
        self.comm
            .all_reduce(&mut low, &AllReduceOptions::with_op(ReduceOp::Min))?;
        self.comm
            .all_reduce(&mut high, &AllReduceOptions::with_op(ReduceOp::Max))?;
        if low[0] != high[0] {
            return Err(Error::RankMismatch(format!(
                "{what} differs between ranks (from {} to {}; this rank has {value}): \
                 start every rank with the same flags",
                low[0], high[0]
            )));
        }
        Ok(())
    }

    /// Errors on every rank when the ranks hold different `(name, value)` lists, naming
    /// each name whose value differs and which ranks hold which value (all ranks must
    /// pass lists of the same names in the same order, such as
    /// [`TrainConfig::shared_flags`](crate::TrainConfig::shared_flags)).
    ///
    /// # Errors
    /// [`Error::RankMismatch`] naming `what` and the differences; [`Error::Json`] or a
    /// transport error.
    pub fn check_same_values(&mut self, what: &str, values: &[(String, String)]) -> Result<()> {
        let all: Vec<Vec<(String, String)>> = self.gather(&values.to_vec())?;
        let differences = differences(&all);
        if differences.is_empty() {
            return Ok(());
        }
        Err(Error::RankMismatch(format!(
            "ranks were started with different {what}: {}; start every rank with the same {what}",
            differences.join("; ")
        )))
    }

    /// Element-wise sum of `values` over the ranks, in place.
    ///
    /// # Errors
    /// A transport error.
    pub fn sum(&mut self, values: &mut [f64]) -> Result<()> {
        self.comm.all_reduce(values, &AllReduceOptions::sum())?;
        Ok(())
    }

    /// Every rank's `value`, in rank order.
    ///
    /// # Errors
    /// [`Error::Json`] when a value does not serialise or a received one does not parse;
    /// a transport error.
    pub fn gather<T: Serialize + DeserializeOwned>(&mut self, value: &T) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(value).map_err(|source| Error::Json {
            action: "serialising a control message",
            source,
        })?;
        self.comm
            .all_gather_bytes(&bytes)?
            .iter()
            .map(|b| {
                serde_json::from_slice(b).map_err(|source| Error::Json {
                    action: "parsing a control message",
                    source,
                })
            })
            .collect()
    }
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

    #[test]
    fn differing_values_are_named_with_each_rank_s_value() {
        let out = Communicator::run_local(4, |comm| {
            let mut control = Control::beside(&comm)?;
            let r = control.rank();
            let flags = |seed: &str| {
                vec![
                    ("--batch-size".to_string(), "32".to_string()),
                    ("--seed".to_string(), seed.to_string()),
                    ("--resume".to_string(), (r == 3).to_string()),
                ]
            };
            let resume_differs = control.check_same_values("flags", &flags("1"));
            let seed = if r == 1 || r == 2 { "5" } else { "1" };
            let differ = control.check_same_values("flags", &flags(seed));
            Ok::<_, Error>((resume_differs, differ))
        })
        .unwrap_or_default();
        assert_eq!(out.len(), 4);
        for result in out {
            let Ok((resume_differs, differ)) = result else {
                panic!("a rank failed");
            };
            let same = resume_differs
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                same.contains("--resume: ranks 0-2 = false, rank 3 = true"),
                "{same}"
            );
            assert!(
                !same.contains("--seed") && !same.contains("--batch-size"),
                "{same}"
            );
            let differ = differ.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                differ.contains("--seed: ranks 0, 3 = 1, ranks 1-2 = 5"),
                "{differ}"
            );
        }
    }

    #[test]
    fn one_list_on_every_rank_is_no_difference() {
        let list = vec![("a".to_string(), "1".to_string())];
        assert!(differences(&[list.clone(), list.clone()]).is_empty());
        let other = vec![("b".to_string(), "1".to_string())];
        assert_eq!(
            differences(&[list, other]),
            [
                "a: rank 0 = 1, rank 1 = (missing)",
                "b: rank 0 = (missing), rank 1 = 1"
            ]
        );
    }

    #[test]
    fn agreements_checks_and_gathers_reach_every_rank() {
        let out = Communicator::run_local(3, |comm| {
            let mut control = Control::beside(&comm)?;
            let r = control.rank();
            let failing: Result<()> = if r == 1 {
                Err(Error::Internal("rank 1 fails".into()))
            } else {
                Ok(())
            };
            let agreed = control.agree("to test", failing);
            let same = control.check_same("the answer", 42.0);
            let differs = control.check_same("the rank", r as f64);
            let gathered = control.gather(&format!("rank {r}"))?;
            let mut sum = [1.0, r as f64];
            control.sum(&mut sum)?;
            Ok::<_, Error>((r, agreed, same, differs, gathered, sum))
        })
        .unwrap_or_default();
        assert_eq!(out.len(), 3);
        for result in out {
            let Ok((r, agreed, same, differs, gathered, sum)) = result else {
                panic!("a rank failed");
            };
            let agreed = agreed.err().map(|e| e.to_string()).unwrap_or_default();
            if r == 1 {
                assert!(agreed.contains("rank 1 fails"), "{agreed}");
            } else {
                assert!(agreed.contains("1 rank(s) failed to test"), "{agreed}");
            }
            assert!(same.is_ok());
            let differs = differs.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(differs.contains("from 0 to 2"), "{differs}");
            assert_eq!(gathered, ["rank 0", "rank 1", "rank 2"]);
            assert_eq!(sum, [3.0, 3.0]);
        }
    }
}
