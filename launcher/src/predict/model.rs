//! The scaling model's formulas: one step's time at N ranks from a 1-rank compute
//! profile and a link (alpha, beta). The formulas are stated in the parent module's docs;
//! each function here names the one it computes.

use serde::Serialize;

/// One rank's step as measured on one rank (seconds, bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Words (source + target) one worker processes per step.
    pub words_per_step: f64,
    /// Waiting for the batch.
    pub data_wait: f64,
    /// Forward pass.
    pub forward: f64,
    /// Backward pass.
    pub backward: f64,
    /// Optimizer update (all parameters).
    pub optimizer: f64,
    /// The gradient ranges in the order backward finished them: (f32 bytes, seconds after
    /// backward began). Their bytes add up to the whole gradient.
    pub ready: Vec<(f64, f64)>,
    /// Bytes crossing one pipeline stage boundary per batch, forward (the same again
    /// backward).
    pub boundary_bytes: f64,
    /// Whether `ready` was measured (else: one range at the end of backward).
    pub ready_measured: bool,
    /// One rank's step compute at evenly spaced quantiles from its fastest (first) to its
    /// slowest (last) step, seconds: how much a step varies (empty: unknown, taken as
    /// not at all).
    pub compute_quantiles: Vec<f64>,
}

impl Profile {
    /// f32 gradient bytes of the whole model.
    pub fn gradient_bytes(&self) -> f64 {
        self.ready.iter().map(|r| r.0).sum()
    }

    /// Compute of one step on one rank: data, forward, backward, optimizer.
    pub fn compute(&self) -> f64 {
        self.data_wait + self.forward + self.backward + self.optimizer
    }
}

/// A link between ranks: `alpha` seconds per message, `beta` seconds per byte.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    /// Latency per message, seconds.
    pub alpha: f64,
    /// Seconds per byte (1 / bandwidth).
    pub beta: f64,
}

impl Link {
    /// Bytes per second, 1 / beta (infinite for beta 0).
    pub fn bandwidth(&self) -> f64 {
        if self.beta > 0.0 {
            1.0 / self.beta
        } else {
            f64::INFINITY
        }
    }
}

/// What joins the ranks: one link between every pair (a flat network), or nodes of
/// [`Nodes::ranks`] ranks joined within by [`Nodes::within`] and to each other by
/// [`Nodes::nics`] links `across` per node (a NIC per GPU, as the eight of a DGX H100, or
/// fewer that the node's ranks share).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Network {
    /// Between nodes; between every pair of ranks on a flat network.
    pub across: Link,
    /// The nodes, on a network of nodes.
    pub nodes: Option<Nodes>,
}

/// The nodes of a [`Network`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Nodes {
    /// Ranks per node; N ranks fill `ceil(N / ranks)` nodes, taken as full ones.
    pub ranks: usize,
    /// Between the ranks of one node.
    pub within: Link,
    /// Links between nodes per node (its NICs): ranks that send across at once share
    /// them evenly; at most one per rank is used.
    pub nics: usize,
}

impl Nodes {
    /// Nodes of `ranks` ranks joined within by `within`, a NIC per rank.
    pub fn nic_per_rank(ranks: usize, within: Link) -> Nodes {
        Nodes {
            ranks,
            within,
            nics: ranks,
        }
    }

    /// How many of the node's ranks share each NIC when all of them send across at once
    /// (at least 1).
    fn ranks_per_nic(&self) -> f64 {
        (self.ranks as f64 / self.nics.max(1) as f64).max(1.0)
    }
}

impl From<Link> for Network {
    fn from(link: Link) -> Network {
        Network {
            across: link,
            nodes: None,
        }
    }
}

impl Network {
    /// The link a step between neighbours of `n` ranks waits for: within a node when they
    /// all fit on one, else the slower of the two in latency and in bandwidth (a ring
    /// through the nodes crosses between them at some step, and every step waits for its
    /// slowest pair).
    pub fn slowest(&self, n: usize) -> Link {
        match self.nodes {
            Some(nodes) if n <= nodes.ranks => nodes.within,
            Some(nodes) => Link {
                alpha: nodes.within.alpha.max(self.across.alpha),
                beta: nodes.within.beta.max(self.across.beta),
            },
            None => self.across,
        }
    }

    /// All-reduce of `bytes` over `n` ranks, as (bandwidth, latency) seconds: a ring
    /// over [`Network::slowest`], or with `hierarchical` on a network of K-rank nodes
    /// spanning M > 1 of them, the hierarchical all-reduce: a ring reduce-scatter and
    /// all-gather within each node (the cost of a ring all-reduce of `bytes` over K
    /// within) and a ring all-reduce of `bytes / K` over the M nodes, all K of a node at
    /// once, sharing the node's NICs (each one's bandwidth split among the ranks on it).
    /// A ring through the nodes crosses between two nodes with one rank at a time, so it
    /// does not share them.
    pub fn all_reduce(&self, n: usize, bytes: f64, hierarchical: bool) -> (f64, f64) {
        match self.nodes {
            Some(nodes) if hierarchical && nodes.ranks > 1 && n > nodes.ranks => {
                let k = nodes.ranks;
                let (bw_in, lat_in) = ring_all_reduce(nodes.within, k, bytes);
                let shared = Link {
                    alpha: self.across.alpha,
                    beta: self.across.beta * nodes.ranks_per_nic(),
                };
                let (bw_out, lat_out) = ring_all_reduce(shared, n.div_ceil(k), bytes / k as f64);
                (bw_in + bw_out, lat_in + lat_out)
            }
            _ => ring_all_reduce(self.slowest(n), n, bytes),
        }
    }
}

/// Ring all-reduce of `bytes` over `n` ranks: `2(N-1)/N * bytes * beta + 2(N-1) * alpha`,
/// returned as (bandwidth term, latency term).
pub fn ring_all_reduce(link: Link, n: usize, bytes: f64) -> (f64, f64) {
    if n <= 1 || bytes <= 0.0 {
        return (0.0, 0.0);
    }
    let n1 = (n - 1) as f64;
    (
        2.0 * n1 / n as f64 * bytes * link.beta,
        2.0 * n1 * link.alpha,
    )
}

/// The expected largest of `n` independent draws from the distribution whose quantile
/// function is `q` (values at evenly spaced quantiles from 0 to 1, linear between them):
/// `integral of Q(u) n u^(n-1) du` over [0, 1], exact for that piecewise linear `Q`. With
/// `n = 1` it is the distribution's mean. 0 for fewer than two quantiles.
pub fn expected_largest(q: &[f64], n: usize) -> f64 {
    if q.len() < 2 || n == 0 {
        return 0.0;
    }
    let nf = n as f64;
    let du = 1.0 / (q.len() - 1) as f64;
    q.windows(2)
        .enumerate()
        .map(|(k, w)| {
            // Q(u) = a + b u on [u0, u1].
            let (u0, u1) = (k as f64 * du, (k + 1) as f64 * du);
            let b = (w[1] - w[0]) / du;
            let a = w[0] - b * u0;
            a * (u1.powf(nf) - u0.powf(nf))
                + b * nf / (nf + 1.0) * (u1.powf(nf + 1.0) - u0.powf(nf + 1.0))
        })
        .sum()
}

/// How much longer the slowest of `n` ranks computes a step than a rank does on
/// average, when each rank's step varies independently as the quantiles `q` of one
/// rank's steps say: `expected_largest(q, n) - expected_largest(q, 1)`. It grows with
/// `n` and never exceeds the slowest step measured less the mean (an empirical
/// distribution has no longer tail than what was seen).
pub fn stragglers(q: &[f64], n: usize) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    (expected_largest(q, n) - expected_largest(q, 1)).max(0.0)
}

/// How the replicated strategy reduces.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Exchange {
    /// Ranges are reduced while backward runs (fusion engine).
    pub overlap: bool,
    /// Fusion buffer threshold, bytes (0 = every range on its own).
    pub fusion_threshold: f64,
    /// Fusion cycle time, seconds.
    pub cycle_time: f64,
    /// `--gradient-repacking R` (0 = off): R equal packs after backward.
    pub repacking: usize,
    /// f16 on the wire: half the bytes.
    pub f16: bool,
    /// The hierarchical all-reduce (`--allreduce-algorithm hier`) instead of the ring:
    /// see [`Network::all_reduce`].
    pub hierarchical: bool,
}

/// A way to use the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Strategy {
    /// All-reduce of the gradients; every rank trains.
    Replicated(Exchange),
    /// Parameter servers: `servers` = 0 puts a shard on every rank; K > 0 dedicates the
    /// last K ranks (they do not train).
    ParameterServer {
        /// Dedicated server ranks (0 = a shard on every rank).
        servers: usize,
        /// f16 on the wire.
        f16: bool,
    },
    /// No communication: the ideal.
    Independent,
    /// K stages x D replicas (D = ranks / K), M micro-batches; each stage all-reduces
    /// its 1/K of the gradients with the same stage of the other replicas.
    Pipeline {
        /// Stages K.
        stages: usize,
        /// Micro-batches M.
        micro_batches: usize,
        /// How the replicas of a stage reduce.
        exchange: Exchange,
    },
}

impl Strategy {
    /// The strategy as the table names it.
    pub fn label(&self) -> String {
        match self {
            Strategy::Replicated(e) => {
                let mut s = "replicated".to_string();
                if e.repacking > 0 {
                    s.push_str(&format!(" (repacking {})", e.repacking));
                } else if e.overlap {
                    s.push_str(" (overlapped)");
                } else {
                    s.push_str(" (after backward)");
                }
                if e.f16 {
                    s.push_str(" f16");
                }
                if e.hierarchical {
                    s.push_str(" hier");
                }
                s
            }
            Strategy::ParameterServer { servers: 0, f16 } => {
                format!("parameter_server (shard per rank){}", f16_tag(*f16))
            }
            Strategy::ParameterServer { servers, f16 } => {
                format!("parameter_server ({servers} servers){}", f16_tag(*f16))
            }
            Strategy::Independent => "independent".to_string(),
            Strategy::Pipeline {
                stages,
                micro_batches,
                ..
            } => format!("pipeline {stages} stages x {micro_batches} micro-batches"),
        }
    }

    /// Whether the strategy can run on `n` ranks (at least one worker; whole replicas).
    pub fn fits(&self, n: usize) -> bool {
        match self {
            Strategy::ParameterServer { servers, .. } => n > *servers,
            Strategy::Pipeline { stages, .. } => *stages >= 1 && n.is_multiple_of(*stages),
            _ => n >= 1,
        }
    }
}

fn f16_tag(f16: bool) -> &'static str {
    if f16 {
        " f16"
    } else {
        ""
    }
}

/// The cores a node's ranks share: the machine the prediction describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sharing {
    /// Hardware threads of the node that its ranks share (0: every rank has cores, or a
    /// GPU, of its own).
    pub cores: usize,
    /// CPU threads each rank computes with.
    pub threads_per_rank: usize,
}

impl Sharing {
    /// Every rank on cores (or a GPU) of its own.
    pub const NONE: Sharing = Sharing {
        cores: 0,
        threads_per_rank: 1,
    };

    /// Whether `n` ranks want more threads than the cores.
    pub fn oversubscribed(&self, n: usize) -> bool {
        self.cores > 0 && n * self.threads_per_rank.max(1) > self.cores
    }

    /// How many times longer a synchronised step takes when `n` ranks share the cores,
    /// against the calibration's one rank: the ranks run in waves. A step ends only when
    /// every rank has computed and reduced, and a rank that waits for the others polls
    /// on its core, so the scheduler does not interleave the ranks within a step: whole
    /// ranks of T threads run `floor(cores / T)` at a time, `ceil(n / that)` waves (n
    /// when one rank alone has more threads than cores: they take turns).
    pub fn waves(&self, n: usize) -> f64 {
        self.wave_sizes(n).len() as f64
    }

    /// How many ranks of `n` run in each wave ([`Sharing::waves`]): all of them in one
    /// when the cores suffice; else `floor(cores / T)` a wave, the last wave the rest.
    pub fn wave_sizes(&self, n: usize) -> Vec<usize> {
        if !self.oversubscribed(n) {
            return vec![n];
        }
        let per_wave = (self.cores / self.threads_per_rank.max(1)).max(1);
        let mut sizes = vec![per_wave; n / per_wave];
        if !n.is_multiple_of(per_wave) {
            sizes.push(n % per_wave);
        }
        sizes
    }

    /// How many times longer ranks that never wait for each other (independent
    /// replicas) compute when `n` share the cores: a plain time-share,
    /// `max(1, n T / cores) / max(1, T / cores)` (the calibration's one rank already had
    /// its share).
    pub fn time_share(&self, n: usize) -> f64 {
        if self.cores == 0 {
            return 1.0;
        }
        let t = self.threads_per_rank.max(1) as f64;
        let c = self.cores as f64;
        (n as f64 * t / c).max(1.0) / (t / c).max(1.0)
    }
}

/// What one row predicts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Ranks.
    pub ranks: usize,
    /// The strategy, as [`Strategy::label`] names it.
    pub strategy: String,
    /// Predicted seconds per step.
    pub step_seconds: f64,
    /// Words/s over all ranks.
    pub words_per_sec: f64,
    /// words/s against the 1-rank step of the same profile.
    pub speedup: f64,
    /// speedup / ranks.
    pub efficiency: f64,
    /// The largest term of the step, as [`Terms::named`] names it.
    pub bottleneck: &'static str,
    /// Every term of the step, seconds (they add up to `step_seconds`).
    pub terms: Terms,
}

/// A step's time, term by term (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Terms {
    /// Data, forward, backward and optimizer of one rank (of one stage in a pipeline).
    pub compute: f64,
    /// A synchronised step waits for its slowest rank: see [`stragglers`].
    pub stragglers: f64,
    /// Bytes over the link not hidden behind backward.
    pub bandwidth: f64,
    /// Message latencies not hidden behind backward.
    pub latency: f64,
    /// Pipeline fill and drain: stage compute x (K - 1) / M.
    pub bubble: f64,
    /// A parameter server's link: the pushes into it and the pulls out of it.
    pub server_link: f64,
    /// A pipeline stage's activations and their gradients to its neighbours.
    pub stage_link: f64,
    /// Ranks sharing a node's cores: the other waves of a synchronised step (see
    /// [`Sharing::waves`]), or the time-share of independent ranks.
    pub shared_cores: f64,
}

impl Terms {
    /// Every term with its name, in the order tables and plots list them.
    pub fn named(&self) -> [(&'static str, f64); 8] {
        [
            ("compute", self.compute),
            ("stragglers", self.stragglers),
            ("bandwidth", self.bandwidth),
            ("latency", self.latency),
            ("bubble", self.bubble),
            ("server link", self.server_link),
            ("stage link", self.stage_link),
            ("shared cores", self.shared_cores),
        ]
    }

    fn total(&self) -> f64 {
        self.named().iter().map(|t| t.1).sum()
    }

    fn largest(&self) -> &'static str {
        let named = self.named();
        named
            .iter()
            .fold(named[0], |best, t| if t.1 > best.1 { *t } else { best })
            .0
    }
}

/// The buffers the fusion engine reduces, in order: consecutive ranges joined while the
/// buffer stays within `threshold` bytes (a range larger than the threshold goes alone);
/// `ready` holds (bytes, ready time). Returns (bytes, ready time of its last range).
pub fn fuse(ready: &[(f64, f64)], threshold: f64) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    let mut open: Option<(f64, f64)> = None;
    for &(bytes, at) in ready {
        open = match open {
            Some((b, _)) if threshold > 0.0 && b + bytes <= threshold => Some((b + bytes, at)),
            Some(done) => {
                out.push(done);
                Some((bytes, at))
            }
            None => Some((bytes, at)),
        };
    }
    out.extend(open);
    out
}

/// Exposed communication of the replicated reduction over `n` ranks, as (bandwidth,
/// latency) seconds after backward ends; `backward` is the backward pass's length and
/// `ready` the ranges' (f32 bytes, ready time).
///
/// - repacking R: R packs of G/R after backward, `R * ring(G/R)`;
/// - after backward: the ranges fused by the threshold, one ring each, all exposed;
/// - overlapped: the engine wakes every cycle time (at c, 2c, ...); at each wake-up the
///   ranges ready by then are fused and queued on one channel, which reduces the buffers
///   one after another; at the end of backward whatever is left is queued at once. The
///   groups depend on the ready times and the cycle only, so a faster link never
///   finishes later. What runs past the end of backward is exposed, split between
///   bandwidth and latency in proportion to their shares.
pub fn replicated_exchange(
    network: impl Into<Network>,
    n: usize,
    e: &Exchange,
    backward: f64,
    ready: &[(f64, f64)],
) -> (f64, f64) {
    let network = network.into();
    let all_reduce = |bytes: f64| network.all_reduce(n, bytes, e.hierarchical);
    if n <= 1 {
        return (0.0, 0.0);
    }
    let wire = if e.f16 { 0.5 } else { 1.0 };
    let total: f64 = ready.iter().map(|r| r.0).sum();
    if e.repacking > 0 {
        let r = e.repacking as f64;
        let (bw, lat) = all_reduce(total * wire / r);
        return (bw * r, lat * r);
    }
    if !e.overlap {
        return fuse(ready, e.fusion_threshold)
            .iter()
            .map(|&(b, _)| all_reduce(b * wire))
            .fold((0.0, 0.0), |a, c| (a.0 + c.0, a.1 + c.1));
    }
    let cycle = e.cycle_time.max(1e-9);
    let (mut sum_bw, mut sum_lat) = (0.0, 0.0);
    let mut channel_free = 0.0_f64;
    let mut next = 0usize;
    while next < ready.len() {
        // The first wake-up at or after the next range's ready time; the end of
        // backward sends the rest.
        let tick = (ready[next].1 / cycle - 1e-9).ceil().max(1.0) * cycle;
        let wake = tick.min(backward);
        let upto = if wake >= backward {
            ready.len()
        } else {
            next + ready[next..].iter().take_while(|r| r.1 <= wake).count()
        }
        .max(next + 1);
        let mut at = channel_free.max(wake);
        for (bytes, _) in fuse(&ready[next..upto], e.fusion_threshold) {
            let (bw, lat) = all_reduce(bytes * wire);
            sum_bw += bw;
            sum_lat += lat;
            at += bw + lat;
        }
        channel_free = at;
        next = upto;
    }
    let exposed = (channel_free - backward).max(0.0);
    let busy = sum_bw + sum_lat;
    if busy <= 0.0 {
        return (0.0, 0.0);
    }
    (exposed * sum_bw / busy, exposed * sum_lat / busy)
}

/// Parameter servers over `n` ranks with `servers` dedicated ones (0 = a shard on every
/// rank): tensors (the ranges) are placed greedily on the least loaded server, as the
/// strategy does; a server of load L with W workers other than itself takes W * L bytes
/// in (the pushes) and sends W * L out (the pulls), each tensor a message each way per
/// worker: `2 * W * L * beta + 2 * W * tensors * alpha`. Servers work side by side: the
/// busiest one is the term. Returns (server link seconds, largest load in bytes).
pub fn parameter_server_link(
    link: Link,
    n: usize,
    servers: usize,
    f16: bool,
    tensors: &[f64],
) -> (f64, f64) {
    let holders = if servers == 0 { n } else { servers };
    let workers = n - servers.min(n);
    let wire = if f16 { 0.5 } else { 1.0 };
    let mut load = vec![(0.0_f64, 0usize); holders.max(1)];
    for &t in tensors {
        let (best, _) =
            load.iter().enumerate().fold(
                (0, f64::INFINITY),
                |b, (i, l)| if l.0 < b.1 { (i, l.0) } else { b },
            );
        load[best].0 += t;
        load[best].1 += 1;
    }
    // A shard-holding worker does not send its own gradient over the link.
    let others = if servers == 0 {
        workers.saturating_sub(1)
    } else {
        workers
    } as f64;
    let worst = load
        .iter()
        .map(|&(bytes, count)| {
            2.0 * others * bytes * wire * link.beta + 2.0 * others * count as f64 * link.alpha
        })
        .fold(0.0, f64::max);
    let largest = load.iter().map(|l| l.0).fold(0.0, f64::max);
    (worst, largest)
}

/// The 1-rank step of `profile`: its compute.
pub fn one_rank_step(profile: &Profile) -> f64 {
    profile.compute()
}

/// Predicts `strategy` at `n` ranks with `profile` on `network` (a [`Link`] for a flat
/// one), on a node whose cores the ranks share as `sharing` says ([`Sharing::NONE`]: not
/// at all). Parameter servers and a pipeline's stages and replicas exchange over
/// [`Network::slowest`].
pub fn predict(
    profile: &Profile,
    network: impl Into<Network>,
    strategy: &Strategy,
    n: usize,
    sharing: Sharing,
) -> Prediction {
    let network = network.into();
    let link = network.slowest(n);
    let p = profile;
    let mut t = Terms::default();
    let workers;
    // The ranks a step waits for, and how much of one rank's spread each of them has.
    let (waited_for, spread) = match strategy {
        Strategy::Independent => (0, 0.0),
        Strategy::ParameterServer { servers, .. } => (n - servers.min(&n), 1.0),
        // A stage computes 1/K of the model: taken to vary 1/K as much (see Limits).
        Strategy::Pipeline { stages, .. } => (n, 1.0 / (*stages).max(1) as f64),
        Strategy::Replicated(_) => (n, 1.0),
    };
    match strategy {
        Strategy::Independent => {
            t.compute = p.compute();
            workers = n;
        }
        Strategy::Replicated(e) => {
            t.compute = p.compute();
            let (bw, lat) = replicated_exchange(network, n, e, p.backward, &p.ready);
            t.bandwidth = bw;
            t.latency = lat;
            workers = n;
        }
        Strategy::ParameterServer { servers, f16 } => {
            let tensors: Vec<f64> = p.ready.iter().map(|r| r.0).collect();
            let (server, largest) = parameter_server_link(link, n, *servers, *f16, &tensors);
            let g = p.gradient_bytes().max(1.0);
            // Each server updates its own tensors only.
            let optimizer = p.optimizer * (largest / g).min(1.0);
            t.compute = p.data_wait + p.forward + p.backward + optimizer;
            t.server_link = if n > 1 { server } else { 0.0 };
            workers = n - servers.min(&n);
        }
        Strategy::Pipeline {
            stages,
            micro_batches,
            exchange,
        } => {
            let k = (*stages).max(1);
            let m = (*micro_batches).max(1) as f64;
            let d = (n / k).max(1);
            let kf = k as f64;
            let stage = (p.forward + p.backward) / kf;
            t.compute = p.data_wait + stage + p.optimizer / kf;
            t.bubble = stage * (kf - 1.0) / m;
            if k > 1 {
                // Each micro-batch crosses a boundary forward and its gradient back.
                let per = p.boundary_bytes / m;
                t.stage_link = 2.0 * m * (link.alpha + per * link.beta);
            }
            let share: Vec<(f64, f64)> = p.ready.iter().map(|r| (r.0 / kf, r.1)).collect();
            let after = Exchange {
                overlap: false,
                ..*exchange
            };
            let (bw, lat) = replicated_exchange(link, d, &after, 0.0, &share);
            t.bandwidth = bw;
            t.latency = lat;
            workers = d;
        }
    }
    // Ranks sharing the cores: independent ones time-share them; synchronised ones run
    // the whole step, compute and reduction alike, once per wave, and each wave waits
    // for its own slowest rank.
    t.shared_cores = match strategy {
        Strategy::Independent => (sharing.time_share(n) - 1.0) * t.compute,
        _ => (sharing.waves(n) - 1.0) * t.total(),
    };
    t.stragglers = sharing
        .wave_sizes(waited_for)
        .iter()
        .map(|&w| stragglers(&p.compute_quantiles, w) * spread)
        .sum();
    let step = t.total();
    let words_per_sec = if step > 0.0 {
        workers as f64 * p.words_per_step / step
    } else {
        0.0
    };
    let one = one_rank_step(p);
    let base = if one > 0.0 {
        p.words_per_step / one
    } else {
        0.0
    };
    let speedup = if base > 0.0 {
        words_per_sec / base
    } else {
        0.0
    };
    Prediction {
        ranks: n,
        strategy: strategy.label(),
        step_seconds: step,
        words_per_sec,
        speedup,
        efficiency: speedup / n.max(1) as f64,
        bottleneck: t.largest(),
        terms: t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
    }

    fn profile() -> Profile {
        // 1 s forward, 2 s backward, four 1000-byte ranges finished at 0.5, 1, 1.5, 2 s.
        Profile {
            words_per_step: 1000.0,
            data_wait: 0.0,
            forward: 1.0,
            backward: 2.0,
            optimizer: 1.0,
            ready: vec![(1000.0, 0.5), (1000.0, 1.0), (1000.0, 1.5), (1000.0, 2.0)],
            boundary_bytes: 100.0,
            ready_measured: true,
            compute_quantiles: Vec::new(),
        }
    }

    const LINK: Link = Link {
        alpha: 0.01,
        beta: 0.001,
    };

    /// A network of nodes: the ring over its slowest links, or the hierarchical
    /// all-reduce's two levels; one node or a flat network: the ring over the one link.
    #[test]
    fn a_network_of_nodes_reduces_by_ring_or_by_levels() {
        let within = Link {
            alpha: 1e-6,
            beta: 1e-11,
        };
        let across = Link {
            alpha: 5e-6,
            beta: 1e-10,
        };
        let net = Network {
            across,
            nodes: Some(Nodes::nic_per_rank(4, within)),
        };
        let b = 1e8;
        for hierarchical in [false, true] {
            // Within one node, the ring over the node's link.
            assert_eq!(
                net.all_reduce(4, b, hierarchical),
                ring_all_reduce(within, 4, b)
            );
            // A flat network knows one link only.
            assert_eq!(
                Network::from(across).all_reduce(16, b, hierarchical),
                ring_all_reduce(across, 16, b)
            );
        }
        // 16 ranks on 4 nodes: the ring waits for the link between nodes at every step.
        assert_eq!(net.all_reduce(16, b, false), ring_all_reduce(across, 16, b));
        // The levels: a ring all-reduce's cost within a node, and one of b / 4 across
        // the 4 nodes.
        let (bw, lat) = net.all_reduce(16, b, true);
        assert!(close(
            bw,
            2.0 * 3.0 / 4.0 * b * 1e-11 + 2.0 * 3.0 / 4.0 * (b / 4.0) * 1e-10
        ));
        assert!(close(lat, 2.0 * 3.0 * 1e-6 + 2.0 * 3.0 * 5e-6));
        let (flat_bw, flat_lat) = net.all_reduce(16, b, false);
        assert!(
            bw < flat_bw / 3.0 && lat < flat_lat,
            "{bw} {lat} against {flat_bw} {flat_lat}"
        );
        // Two NICs per node of 4 ranks: the levels' step across the nodes gets half the
        // bandwidth per rank, its latency and the ring's cost stay.
        let shared = Network {
            across,
            nodes: Some(Nodes {
                nics: 2,
                ..Nodes::nic_per_rank(4, within)
            }),
        };
        let (shared_bw, shared_lat) = shared.all_reduce(16, b, true);
        assert!(close(
            shared_bw,
            2.0 * 3.0 / 4.0 * b * 1e-11 + 2.0 * 3.0 / 4.0 * (b / 4.0) * 2e-10
        ));
        assert!(close(shared_lat, lat));
        assert_eq!(shared.all_reduce(16, b, false), (flat_bw, flat_lat));
        // More NICs than ranks: one per rank is used.
        let more = Network {
            across,
            nodes: Some(Nodes {
                nics: 8,
                ..Nodes::nic_per_rank(4, within)
            }),
        };
        assert_eq!(more.all_reduce(16, b, true), (bw, lat));
        // 18 ranks fill 5 nodes; the slowest link of a mixed pair is slow in both terms.
        let (_, lat) = net.all_reduce(18, b, true);
        assert!(close(lat, 2.0 * 3.0 * 1e-6 + 2.0 * 4.0 * 5e-6));
        assert_eq!(
            Network {
                across: Link {
                    alpha: 1e-7,
                    beta: 1e-10
                },
                nodes: Some(Nodes::nic_per_rank(4, within)),
            }
            .slowest(8),
            Link {
                alpha: 1e-6,
                beta: 1e-10
            }
        );
        // The replicated step follows it.
        let p = profile();
        let e = Exchange {
            hierarchical: true,
            ..after_backward()
        };
        let levels = predict(&p, net, &Strategy::Replicated(e), 16, Sharing::NONE);
        let ring = predict(
            &p,
            net,
            &Strategy::Replicated(after_backward()),
            16,
            Sharing::NONE,
        );
        assert!(levels.step_seconds < ring.step_seconds);
        assert!(levels.strategy.ends_with(" hier"), "{}", levels.strategy);
    }

    fn after_backward() -> Exchange {
        Exchange {
            overlap: false,
            fusion_threshold: 0.0,
            cycle_time: 0.001,
            repacking: 0,
            f16: false,
            hierarchical: false,
        }
    }

    #[test]
    fn ring_cost_by_hand() {
        // N = 4, 1000 bytes: 2*3/4*1000*0.001 = 1.5 s and 2*3*0.01 = 0.06 s.
        let (bw, lat) = ring_all_reduce(LINK, 4, 1000.0);
        assert!(close(bw, 1.5) && close(lat, 0.06), "{bw} {lat}");
        assert_eq!(ring_all_reduce(LINK, 1, 1000.0), (0.0, 0.0));
    }

    #[test]
    fn fusion_joins_ranges_up_to_the_threshold() {
        let r = [(10.0, 1.0), (10.0, 2.0), (25.0, 3.0), (5.0, 4.0)];
        assert_eq!(fuse(&r, 20.0), vec![(20.0, 2.0), (25.0, 3.0), (5.0, 4.0)]);
        assert_eq!(fuse(&r, 0.0).len(), 4);
        assert_eq!(fuse(&r, 1e9), vec![(50.0, 4.0)]);
    }

    #[test]
    fn after_backward_every_range_is_exposed() {
        // 2 ranks: per range 2*1/2*1000*0.001 = 1 s, 2*1*0.01 = 0.02 s; four ranges.
        let (bw, lat) = replicated_exchange(LINK, 2, &after_backward(), 2.0, &profile().ready);
        assert!(close(bw, 4.0) && close(lat, 0.08), "{bw} {lat}");
        // Fused into one buffer: 4 s and one latency.
        let fused = Exchange {
            fusion_threshold: 1e9,
            ..after_backward()
        };
        let (bw, lat) = replicated_exchange(LINK, 2, &fused, 2.0, &profile().ready);
        assert!(close(bw, 4.0) && close(lat, 0.02), "{bw} {lat}");
        // f16 halves the bytes, not the latency.
        let half = Exchange { f16: true, ..fused };
        let (bw, lat) = replicated_exchange(LINK, 2, &half, 2.0, &profile().ready);
        assert!(close(bw, 2.0) && close(lat, 0.02), "{bw} {lat}");
    }

    #[test]
    fn repacking_cuts_the_gradient_into_equal_packs() {
        let e = Exchange {
            repacking: 2,
            ..after_backward()
        };
        // Two packs of 2000 bytes at 2 ranks: 2 * (2 s + 0.02 s).
        let (bw, lat) = replicated_exchange(LINK, 2, &e, 2.0, &profile().ready);
        assert!(close(bw, 4.0) && close(lat, 0.04), "{bw} {lat}");
    }

    #[test]
    fn overlap_hides_what_finishes_before_backward_ends() {
        // Cycle 0.5 s, no fusion; each range takes 1.02 s at 2 ranks. Wakes at 0.5, 1,
        // 1.5 and 2 (the end of backward) queue one range each: they run 0.5..1.52,
        // 1.52..2.54, 2.54..3.56, 3.56..4.58. Exposed: 2.58 s.
        let e = Exchange {
            overlap: true,
            cycle_time: 0.5,
            ..after_backward()
        };
        let (bw, lat) = replicated_exchange(LINK, 2, &e, 2.0, &profile().ready);
        assert!(close(bw + lat, 2.58), "{bw} {lat}");
        // Fused up to 2000 bytes a wake-up at 1 s finds ranges 1 and 2 together.
        let slow = Exchange {
            cycle_time: 1.0,
            fusion_threshold: 2000.0,
            ..e
        };
        // Wake 1: ranges 1+2 (2 s + 0.02) run 1..3.02; wake 2: ranges 3+4 3.02..5.04.
        let (bw2, lat2) = replicated_exchange(LINK, 2, &slow, 2.0, &profile().ready);
        assert!(close(bw2 + lat2, 3.04), "{bw2} {lat2}");
        // Split in proportion of 4 s bandwidth to 0.08 s latency.
        assert!(close(bw / lat, 4.0 / 0.08), "{bw} {lat}");
        // A fast link hides all of it.
        let fast = Link {
            alpha: 0.0,
            beta: 1e-6,
        };
        let (bw, lat) = replicated_exchange(fast, 2, &e, 2.0, &profile().ready);
        assert!(bw + lat < 0.01, "{bw} {lat}");
    }

    #[test]
    fn replicated_prediction_by_hand() {
        let p = profile();
        let s = Strategy::Replicated(after_backward());
        let one = predict(&p, LINK, &s, 1, Sharing::NONE);
        assert!(close(one.step_seconds, 4.0) && close(one.speedup, 1.0));
        // 2 ranks: 4 s compute + 4.08 s exchange; 2000 words / 8.08 s.
        let two = predict(&p, LINK, &s, 2, Sharing::NONE);
        assert!(close(two.step_seconds, 8.08), "{two:?}");
        assert!(close(two.words_per_sec, 2000.0 / 8.08));
        assert!(close(two.speedup, 2.0 * 4.0 / 8.08));
        assert!(close(two.efficiency, two.speedup / 2.0));
        // 3 ranks: 4 * 2*2/3*1000*0.001 = 5.33 s of bandwidth outweighs 4 s of compute.
        let three = predict(&p, LINK, &s, 3, Sharing::NONE);
        assert!(close(three.terms.bandwidth, 16.0 / 3.0), "{three:?}");
        assert_eq!(three.bottleneck, "bandwidth");
    }

    #[test]
    fn shared_cores_by_hand() {
        let p = profile();
        let s = Strategy::Replicated(after_backward());
        let two_cores = Sharing {
            cores: 2,
            threads_per_rank: 1,
        };
        // 2 ranks of 1 thread on 2 cores: nothing shared.
        assert_eq!(
            predict(&p, LINK, &s, 2, two_cores),
            predict(&p, LINK, &s, 2, Sharing::NONE)
        );
        // 4 ranks on 2 cores: two waves, the whole step twice.
        let alone = predict(&p, LINK, &s, 4, Sharing::NONE);
        let shared = predict(&p, LINK, &s, 4, two_cores);
        assert!(
            close(shared.terms.shared_cores, alone.step_seconds),
            "{shared:?}"
        );
        assert!(close(shared.step_seconds, 2.0 * alone.step_seconds));
        assert!(close(shared.terms.compute, alone.terms.compute));
        assert_eq!(shared.bottleneck, "shared cores");
        // 3 ranks on 2 cores: two waves as well (whole ranks, not 1.5).
        let three = predict(&p, LINK, &s, 3, two_cores);
        let three_alone = predict(&p, LINK, &s, 3, Sharing::NONE);
        assert!(close(three.step_seconds, 2.0 * three_alone.step_seconds));
        // Independent ranks do not wait for each other: they time-share, 4 on 2 cores
        // double the compute, 3 take 1.5 times as long.
        let ind = predict(&p, LINK, &Strategy::Independent, 4, two_cores);
        assert!(close(ind.terms.shared_cores, 4.0) && close(ind.step_seconds, 8.0));
        assert!(close(ind.speedup, 2.0) && ind.bottleneck == "compute");
        let ind3 = predict(&p, LINK, &Strategy::Independent, 3, two_cores);
        assert!(close(ind3.step_seconds, 6.0), "{ind3:?}");
    }

    #[test]
    fn the_slowest_of_n_uniform_draws_by_hand() {
        // Uniform on [0, 1] (two quantiles, linear between): the largest of n has mean
        // n / (n + 1), whatever the spacing of the quantiles that describe it.
        for q in [
            vec![0.0, 1.0],
            (0..=100).map(|k| k as f64 / 100.0).collect(),
        ] {
            for n in [1, 2, 3, 8, 1024] {
                let want = n as f64 / (n as f64 + 1.0);
                assert!(close(expected_largest(&q, n), want), "{n}: {q:?}");
            }
            // 2 ranks wait 2/3 - 1/2 = 1/6 for the slower.
            assert!(close(stragglers(&q, 2), 1.0 / 6.0));
            assert_eq!(stragglers(&q, 1), 0.0);
        }
        // Steps that never vary keep no rank waiting; nothing known, nothing predicted.
        assert!(stragglers(&[2.0; 101], 1024).abs() < 1e-12);
        assert_eq!(stragglers(&[], 8), 0.0);
    }

    #[test]
    fn stragglers_grow_with_the_ranks_up_to_the_slowest_step_seen() {
        // Mostly 1 s, the slowest 10 % of the steps up to 3 s.
        let q: Vec<f64> = (0..=100)
            .map(|k| {
                if k <= 90 {
                    1.0
                } else {
                    1.0 + (k - 90) as f64 * 0.2
                }
            })
            .collect();
        let mean = expected_largest(&q, 1);
        let wait: Vec<f64> = [2, 3, 8, 64, 1024]
            .iter()
            .map(|&n| stragglers(&q, n))
            .collect();
        assert!(wait.windows(2).all(|w| w[0] < w[1]), "{wait:?}");
        assert!(wait[4] <= 3.0 - mean + 1e-12 && wait[4] > 0.9 * (3.0 - mean));
    }

    #[test]
    fn synchronised_strategies_wait_for_the_slowest_rank_and_independent_ones_do_not() {
        let mut p = profile();
        // One rank's steps spread uniformly over 3.5..4.5 s (mean 4 s, as `compute`).
        p.compute_quantiles = vec![3.5, 4.5];
        let s = Strategy::Replicated(after_backward());
        let two = predict(&p, LINK, &s, 2, Sharing::NONE);
        assert!(close(two.terms.stragglers, 1.0 / 6.0), "{two:?}");
        assert!(close(two.step_seconds, 8.08 + 1.0 / 6.0), "{two:?}");
        // The 1-rank step has no one to wait for.
        assert_eq!(
            predict(&p, LINK, &s, 1, Sharing::NONE).terms.stragglers,
            0.0
        );
        let ind = predict(&p, LINK, &Strategy::Independent, 2, Sharing::NONE);
        assert_eq!(ind.terms.stragglers, 0.0);
        // Dedicated servers do not train: 3 ranks, 1 server, 2 workers to wait for.
        let ps = Strategy::ParameterServer {
            servers: 1,
            f16: false,
        };
        assert!(close(
            predict(&p, LINK, &ps, 3, Sharing::NONE).terms.stragglers,
            1.0 / 6.0
        ));
        // A stage of two computes half the model: half the spread.
        let pipe = Strategy::Pipeline {
            stages: 2,
            micro_batches: 4,
            exchange: after_backward(),
        };
        let staged = predict(&p, LINK, &pipe, 2, Sharing::NONE);
        assert!(close(staged.terms.stragglers, 1.0 / 12.0), "{staged:?}");
        // Ranks in waves on 2 cores: each wave waits for its own slowest rank, once. 3
        // ranks: a wave of 2 and a wave of 1; 4 ranks: two waves of 2. The other waves'
        // term repeats the rest of the step, not the waiting.
        let two_cores = Sharing {
            cores: 2,
            threads_per_rank: 1,
        };
        let three = predict(&p, LINK, &s, 3, two_cores);
        assert!(close(three.terms.stragglers, 1.0 / 6.0), "{three:?}");
        let four = predict(&p, LINK, &s, 4, two_cores);
        assert!(close(four.terms.stragglers, 2.0 / 6.0), "{four:?}");
        let rest = four.step_seconds - four.terms.stragglers;
        assert!(close(four.terms.shared_cores, rest / 2.0), "{four:?}");
    }

    #[test]
    fn waves_hold_whole_ranks_the_last_one_the_rest() {
        let on = |cores, threads_per_rank| Sharing {
            cores,
            threads_per_rank,
        };
        assert_eq!(on(2, 1).wave_sizes(2), vec![2]);
        assert_eq!(on(2, 1).wave_sizes(3), vec![2, 1]);
        assert_eq!(on(2, 1).wave_sizes(4), vec![2, 2]);
        assert_eq!(on(4, 2).wave_sizes(5), vec![2, 2, 1]);
        // One rank with more threads than cores: one at a time.
        assert_eq!(on(2, 4).wave_sizes(3), vec![1, 1, 1]);
        assert_eq!(Sharing::NONE.wave_sizes(1024), vec![1024]);
        for (sharing, n) in [(on(2, 1), 3), (on(4, 2), 5), (on(2, 4), 3)] {
            assert_eq!(sharing.wave_sizes(n).iter().sum::<usize>(), n);
        }
    }

    #[test]
    fn waves_count_whole_ranks() {
        let on = |cores, threads_per_rank| Sharing {
            cores,
            threads_per_rank,
        };
        assert_eq!(Sharing::NONE.waves(1024), 1.0);
        assert_eq!(on(2, 1).waves(1), 1.0);
        assert_eq!(on(2, 1).waves(2), 1.0);
        assert_eq!(on(2, 1).waves(3), 2.0);
        assert_eq!(on(2, 1).waves(4), 2.0);
        assert_eq!(on(2, 1).waves(5), 3.0);
        // Two threads each: one rank at a time on 2 cores, two at a time on 5.
        assert_eq!(on(2, 2).waves(2), 2.0);
        assert_eq!(on(5, 2).waves(3), 2.0);
        // More threads than cores: the ranks take turns.
        assert_eq!(on(2, 4).waves(3), 3.0);
        assert_eq!(on(2, 1).time_share(3), 1.5);
        assert_eq!(on(2, 4).time_share(2), 2.0);
        assert_eq!(on(0, 4).time_share(64), 1.0);
    }

    #[test]
    fn parameter_server_by_hand() {
        let p = profile();
        // 2 dedicated servers at 4 ranks: 2 workers; each server holds two 1000-byte
        // tensors: 2*2*2000*0.001 + 2*2*2*0.01 = 8.08 s; optimizer on half the bytes.
        let s = Strategy::ParameterServer {
            servers: 2,
            f16: false,
        };
        let r = predict(&p, LINK, &s, 4, Sharing::NONE);
        assert!(close(r.terms.server_link, 8.08), "{r:?}");
        assert!(close(r.terms.compute, 3.5), "{r:?}");
        assert!(close(r.words_per_sec, 2000.0 / 11.58));
        assert_eq!(r.bottleneck, "server link");
        assert!(!s.fits(2));
        // A shard on each of 4 ranks: one tensor each, 3 other workers:
        // 2*3*1000*0.001 + 2*3*1*0.01 = 6.06 s.
        let shard = Strategy::ParameterServer {
            servers: 0,
            f16: false,
        };
        let r = predict(&p, LINK, &shard, 4, Sharing::NONE);
        assert!(close(r.terms.server_link, 6.06), "{r:?}");
    }

    #[test]
    fn pipeline_by_hand() {
        let p = profile();
        let s = Strategy::Pipeline {
            stages: 2,
            micro_batches: 4,
            exchange: after_backward(),
        };
        // K = 2, M = 4, one replica: stage 1.5 s, optimizer 0.5 s, bubble 1.5 * 1/4,
        // boundary 2 * 4 * (0.01 + 25 * 0.001) = 0.28 s.
        let r = predict(&p, LINK, &s, 2, Sharing::NONE);
        assert!(close(r.terms.compute, 2.0), "{r:?}");
        assert!(close(r.terms.bubble, 0.375), "{r:?}");
        assert!(close(r.terms.stage_link, 0.28), "{r:?}");
        assert_eq!(r.terms.bandwidth, 0.0);
        assert!(close(r.words_per_sec, 1000.0 / 2.655));
        // 2 x 2: each stage all-reduces its half (four 500-byte ranges) over 2 replicas.
        let r = predict(&p, LINK, &s, 4, Sharing::NONE);
        assert!(close(r.terms.bandwidth, 2.0) && close(r.terms.latency, 0.08));
        assert!(!s.fits(3));
    }

    #[test]
    fn more_bandwidth_never_predicts_fewer_words() {
        let p = profile();
        let strategies = [
            Strategy::Replicated(after_backward()),
            Strategy::Replicated(Exchange {
                overlap: true,
                cycle_time: 0.3,
                fusion_threshold: 1500.0,
                ..after_backward()
            }),
            Strategy::ParameterServer {
                servers: 1,
                f16: false,
            },
            Strategy::Pipeline {
                stages: 2,
                micro_batches: 2,
                exchange: after_backward(),
            },
        ];
        for s in &strategies {
            for n in [2, 4, 8, 64, 1024] {
                if !s.fits(n) {
                    continue;
                }
                let mut last = 0.0;
                for beta in [1e-2, 1e-3, 1e-4, 1e-6, 0.0] {
                    let link = Link { alpha: 0.01, beta };
                    let w = predict(&p, link, s, n, Sharing::NONE).words_per_sec;
                    assert!(w >= last - 1e-9, "{s:?} n={n} beta={beta}: {w} < {last}");
                    last = w;
                }
            }
        }
    }

    mod properties {
        use super::super::{fuse, replicated_exchange, Exchange, Link};
        use proptest::prelude::{any, prop, proptest, Strategy as _};
        use proptest::prop_assert;

        fn ranges() -> impl proptest::strategy::Strategy<Value = Vec<(f64, f64)>> {
            prop::collection::vec((1.0f64..1e6, 0.0f64..1.0), 1..12).prop_map(|mut v| {
                // Ready times in backward's order.
                let mut t = 0.0;
                for r in &mut v {
                    t += r.1 * 0.01;
                    r.1 = t;
                }
                v
            })
        }

        proptest! {
            #[test]
            fn fusion_keeps_every_byte_and_the_order(r in ranges(), threshold in 0.0f64..4e6) {
                let fused = fuse(&r, threshold);
                let total: f64 = r.iter().map(|x| x.0).sum();
                let kept: f64 = fused.iter().map(|x| x.0).sum();
                prop_assert!((total - kept).abs() <= 1e-9 * total);
                prop_assert!(fused.windows(2).all(|w| w[0].1 <= w[1].1));
                prop_assert!(fused.len() <= r.len());
            }

            #[test]
            fn a_faster_link_never_exposes_more(
                r in ranges(),
                n in 2usize..2048,
                alpha in 0.0f64..1e-4,
                beta in 1e-12f64..1e-8,
                faster in 1.0f64..100.0,
                overlap in any::<bool>(),
                cycle in 1e-4f64..0.02,
                threshold in 0.0f64..4e6,
            ) {
                let e = Exchange { overlap, fusion_threshold: threshold, cycle_time: cycle, repacking: 0, f16: false, hierarchical: false };
                let backward = r.last().map_or(0.0, |x| x.1);
                let slow = replicated_exchange(Link { alpha, beta }, n, &e, backward, &r);
                let fast = replicated_exchange(Link { alpha: alpha / faster, beta: beta / faster }, n, &e, backward, &r);
                prop_assert!(fast.0 + fast.1 <= (slow.0 + slow.1) * (1.0 + 1e-9) + 1e-15);
            }
        }
    }
}
