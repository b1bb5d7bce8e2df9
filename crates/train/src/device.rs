//! Which device a rank uses: its local rank on the node, as Horovod does.
//!
//! The local rank comes from the launcher's environment: Open MPI
//! (`OMPI_COMM_WORLD_LOCAL_RANK`), MPICH/Hydra (`MPI_LOCALRANKID`), Slurm (`SLURM_LOCALID`);
//! when none is set, from the ranks that share this node ([`Communicator::node_rank`],
//! the MPI shared-memory split).

use ringtrain_collective::Communicator;

use crate::error::Result;

/// Environment variables that carry the local rank, in the order they are tried.
pub const LOCAL_RANK_VARS: [&str; 3] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
];
/// Environment variables that carry the number of ranks on this node.
pub const LOCAL_SIZE_VARS: [&str; 3] = [
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
];

/// Where a local rank came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalRankSource {
    /// An environment variable set by the launcher.
    Env(&'static str),
    /// Split of the MPI shared-memory communicator.
    SharedMemorySplit,
    /// A single process.
    Default,
}

/// Local rank and local size of this process and where they came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRank {
    /// Index of this rank among the ranks on this node.
    pub rank: usize,
    /// Ranks on this node.
    pub size: usize,
    /// Where the numbers came from.
    pub source: LocalRankSource,
}

/// Reads the local rank from `lookup` (the environment in production, a map in tests).
pub fn local_rank_from(lookup: impl Fn(&str) -> Option<String>) -> Option<LocalRank> {
    for (i, var) in LOCAL_RANK_VARS.iter().enumerate() {
        if let Some(rank) = lookup(var).and_then(|v| v.trim().parse::<usize>().ok()) {
            let size = lookup(LOCAL_SIZE_VARS[i])
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|s| *s > rank)
                .unwrap_or(rank + 1);
            return Some(LocalRank {
                rank,
                size,
                source: LocalRankSource::Env(var),
            });
        }
    }
    None
}

/// Reads the local rank from the process environment.
pub fn local_rank_from_env() -> Option<LocalRank> {
    local_rank_from(|k| std::env::var(k).ok())
}

/// This rank's local rank: a single process is rank 0 of 1; else the launcher's
/// environment, else the ranks sharing the node (collective then: every rank of a job
/// started by one launcher takes the same branch).
///
/// # Errors
/// The transport's, when the node split fails.
pub fn local_rank(comm: &Communicator) -> Result<LocalRank> {
    if comm.size() == 1 {
        return Ok(LocalRank {
            rank: 0,
            size: 1,
            source: LocalRankSource::Default,
        });
    }
    if let Some(local) = local_rank_from_env() {
        return Ok(local);
    }
    let node = comm.node_rank()?;
    Ok(LocalRank {
        rank: node.rank,
        size: node.size,
        source: LocalRankSource::SharedMemorySplit,
    })
}

/// Bytes of memory the kernel says can be allocated now without swapping
/// (`MemAvailable` of `/proc/meminfo`), or `None` where that is not known.
pub fn available_host_memory() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<f64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Memory shared by the ranks that use it: a node's host memory, or a GPU's.
#[derive(Debug, Clone, PartialEq)]
pub struct Room {
    /// Where: `this node` (host memory) or `GPU N`.
    pub place: String,
    /// Bytes available in all.
    pub available: f64,
    /// Ranks sharing them.
    pub ranks: usize,
}

impl Room {
    /// The host memory available now to each of the node's `local_ranks` ranks (`None`
    /// where the kernel does not say).
    pub fn host(local_ranks: usize) -> Option<Room> {
        available_host_memory().map(|available| Room {
            place: "this node".to_string(),
            available,
            ranks: local_ranks,
        })
    }

    /// Bytes for each rank.
    pub fn per_rank(&self) -> f64 {
        self.available / self.ranks.max(1) as f64
    }

    /// Whether one rank's `estimate` fits its share.
    pub fn holds(&self, estimate: &ringtrain_model::MemoryEstimate) -> bool {
        estimate.total_bytes() <= self.per_rank()
    }

    /// The error for an `estimate` that does not fit: the estimate, the share, and the
    /// biggest term.
    pub(crate) fn refusal(&self, estimate: &ringtrain_model::MemoryEstimate) -> crate::Error {
        let biggest = estimate
            .biggest()
            .map(|t| {
                format!(
                    "{} ({})",
                    t.what,
                    ringtrain_model::memory::format_bytes(t.bytes)
                )
            })
            .unwrap_or_default();
        crate::Error::NotEnoughMemory {
            estimate: estimate.to_string(),
            available: ringtrain_model::memory::format_bytes(self.per_rank()),
            place: self.place.clone(),
            local_ranks: self.ranks,
            biggest,
        }
    }
}

/// Threads per core `--threads` may ask for: oversubscribing a little can hide stalls,
/// much more only adds switching (and an unbounded count spawns threads until the
/// machine gives out).
pub const MAX_THREADS_PER_CORE: usize = 4;

/// The largest `--threads` this machine accepts: [`MAX_THREADS_PER_CORE`] per core.
pub fn max_cpu_threads() -> usize {
    MAX_THREADS_PER_CORE * std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Hardware threads online on this node, whatever this process is bound to: mpirun
/// binds a rank to one core when the ranks fit the cores, and
/// `std::thread::available_parallelism` then says 1. Read from
/// `/sys/devices/system/cpu/online` (e.g. `0-3,6`); `available_parallelism` where that
/// file is missing or unreadable.
pub fn node_cores() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpu_list(&s))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPUs in a kernel CPU list such as `0-3,6` (`None` when malformed or empty).
fn count_cpu_list(list: &str) -> Option<usize> {
    let mut count = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        count += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (count > 0).then_some(count)
}

/// CPU threads a rank should use: `requested` when non-zero, else the machine's cores
/// divided evenly over the ranks on this node (at least one).
pub fn cpu_threads(requested: usize, local_size: usize) -> usize {
    if requested > 0 {
        return requested;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_size.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn cpu_lists_count_every_cpu_once() {
        assert_eq!(count_cpu_list("0-1\n"), Some(2));
        assert_eq!(count_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(count_cpu_list("5"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
        assert!(node_cores() >= 1);
    }

    #[test]
    fn too_big_a_configuration_names_its_estimate_and_biggest_term() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2097152 kB\n";
        let available = parse_mem_available(meminfo).unwrap_or_default();
        assert_eq!(available, 2.0 * 1024.0 * 1024.0 * 1024.0);
        let mut est = ringtrain_model::MemoryEstimate::default();
        est.add_bytes("parameters", 0.5 * available);
        est.add_bytes("output logits", 0.2 * available);
        let room = |ranks| Room {
            place: "GPU 0".to_string(),
            available,
            ranks,
        };
        assert!(room(1).holds(&est));
        assert!(!room(2).holds(&est));
        let err = room(2).refusal(&est).to_string();
        // benches/max_batch.py recognises a refusal by this prefix.
        assert!(err.starts_with("not enough memory: "), "{err}");
        assert!(
            err.contains("1.4 GiB")
                && err.contains("1.0 GiB")
                && err.contains("parameters (1.0 GiB)"),
            "{err}"
        );
    }

    #[test]
    fn reads_each_launcher_in_order() {
        let env: HashMap<&str, &str> = [
            ("SLURM_LOCALID", "3"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "4"),
        ]
        .into_iter()
        .collect();
        let lr = local_rank_from(|k| env.get(k).map(|s| s.to_string())).unwrap();
        assert_eq!(
            lr,
            LocalRank {
                rank: 1,
                size: 4,
                source: LocalRankSource::Env("MPI_LOCALRANKID")
            }
        );
        let env: HashMap<&str, &str> = [("SLURM_LOCALID", "2")].into_iter().collect();
        let lr = local_rank_from(|k| env.get(k).map(|s| s.to_string())).unwrap();
        assert_eq!((lr.rank, lr.size), (2, 3));
        assert!(local_rank_from(|_| None).is_none());
        assert_eq!(cpu_threads(3, 8), 3);
        assert!(cpu_threads(0, 1000) >= 1);
    }
}
