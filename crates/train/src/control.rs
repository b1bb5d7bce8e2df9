//! The control plane: the messages ranks exchange about the run rather than its data.
//!
//! [`Control`] owns a duplicate of the world communicator (`MPI_Comm_dup`, or the local
//! transport's equivalent), so its messages never mix with the gradient traffic of the
//! fusion engine, which owns the original and runs it on its own thread. Agreements
//! (did every rank load the checkpoint?), checks that ranks share a value, the step's
//! figures and the final per-rank summaries all go through it.

use ringtrain_collective::{AllReduceOptions, Communicator};
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

    /// Errors on every rank when the ranks hold different `(name, value)` lists, naming
    /// each name whose value differs and which ranks hold which value (all ranks must
    /// pass lists of the same names in the same order, such as
    /// [`TrainConfig::shared_flags`](crate::TrainConfig::shared_flags)).
    ///
    /// # Errors
    /// The collective's `SettingsDiffer` naming `what` and the differences, or a
    /// transport error.
    pub fn check_same_values(&mut self, what: &str, values: &[(String, String)]) -> Result<()> {
        Ok(self.comm.check_same_values(what, values)?)
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

#[cfg(test)]
mod tests {
    use super::*;

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
            let answer = [("answer".to_string(), "42".to_string())];
            let same = control.check_same_values("values", &answer);
            let rank = [("rank".to_string(), r.to_string())];
            let differs = control.check_same_values("values", &rank);
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
            assert!(
                differs.contains("rank: rank 0 = 0, rank 1 = 1, rank 2 = 2"),
                "{differs}"
            );
            assert_eq!(gathered, ["rank 0", "rank 1", "rank 2"]);
            assert_eq!(sum, [3.0, 3.0]);
        }
    }
}
