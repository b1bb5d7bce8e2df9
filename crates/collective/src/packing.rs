//! Gradient packing as tf_cnn_benchmarks does it: `gradient_repacking` and
//! `agg_small_grads_max_bytes` / `agg_small_grads_max_group`, planned once and reused.

use crate::communicator::Communicator;
use crate::dtype::{DType, Element, TensorMut};
use crate::error::{Error, Result};
use crate::options::AllReduceOptions;

/// One gradient as the plan sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradientSpec {
    /// Variable name (for error messages).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Number of elements.
    pub len: usize,
}

impl GradientSpec {
    /// A spec from its parts.
    pub fn new(name: impl Into<String>, dtype: DType, len: usize) -> Self {
        GradientSpec {
            name: name.into(),
            dtype,
            len,
        }
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }
}

/// Packing settings, with tf_cnn_benchmarks' names and meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PackingConfig {
    /// `gradient_repacking = N`: concatenate the gradients (of each dtype, in list order)
    /// and split them into N packs of `T / N` elements, the remainder in the last pack.
    /// 0 turns it off.
    pub gradient_repacking: usize,
    /// Tensors of at most this many bytes that stand next to each other (and share a dtype)
    /// are reduced together. 0 turns aggregation off.
    pub agg_small_grads_max_bytes: usize,
    /// At most this many tensors per aggregated group.
    pub agg_small_grads_max_group: usize,
}

/// A contiguous run of one gradient's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitPiece {
    /// Index of the gradient in the spec list.
    pub grad: usize,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// What is all-reduced as one buffer: pieces of gradients concatenated in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReductionUnit {
    /// Element type of every piece.
    pub dtype: DType,
    /// The pieces, in buffer order.
    pub pieces: Vec<UnitPiece>,
}

impl ReductionUnit {
    /// Total elements.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// True when the unit has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total bytes.
    pub fn size_bytes(&self) -> usize {
        self.len() * self.dtype.size_bytes()
    }
}

/// A packing plan computed once from the gradient list.
#[derive(Debug)]
pub struct GradientPacker {
    specs: Vec<GradientSpec>,
    config: PackingConfig,
    units: Vec<ReductionUnit>,
    /// Whether the ranks were found to share the plan's settings (on the first
    /// [`GradientPacker::all_reduce`] that got that far).
    agreed: bool,
}

impl GradientPacker {
    /// Plans how `specs` are reduced under `config`.
    ///
    /// Repacking runs first (per dtype); aggregation then groups the small tensors of the
    /// resulting list (the packs, or the gradients themselves when repacking is off).
    pub fn new(specs: Vec<GradientSpec>, config: PackingConfig) -> Result<Self> {
        if config.agg_small_grads_max_bytes > 0 && config.agg_small_grads_max_group == 0 {
            return Err(Error::invalid(
                "agg_small_grads_max_group",
                0,
                "set it to at least 1 when agg_small_grads_max_bytes > 0 (or set agg_small_grads_max_bytes = 0)",
            ));
        }
        let tensors = if config.gradient_repacking > 0 {
            repack(&specs, config.gradient_repacking)
        } else {
            specs
                .iter()
                .enumerate()
                .filter(|(_, s)| s.len > 0)
                .map(|(grad, s)| ReductionUnit {
                    dtype: s.dtype,
                    pieces: vec![UnitPiece {
                        grad,
                        offset: 0,
                        len: s.len,
                    }],
                })
                .collect()
        };
        let units = if config.agg_small_grads_max_bytes > 0 {
            aggregate(
                tensors,
                config.agg_small_grads_max_bytes,
                config.agg_small_grads_max_group,
            )
        } else {
            tensors
        };
        Ok(GradientPacker {
            specs,
            config,
            units,
            agreed: false,
        })
    }

    /// The plan: one entry per all-reduce.
    pub fn units(&self) -> &[ReductionUnit] {
        &self.units
    }

    /// The gradient list the plan was made for.
    pub fn specs(&self) -> &[GradientSpec] {
        &self.specs
    }

    /// The settings the plan was made with.
    pub fn config(&self) -> PackingConfig {
        self.config
    }

    /// What every rank's plan must share, as `(name, value)` pairs for
    /// [`Communicator::check_same_values`]: the settings, and the gradients' number and
    /// elements per dtype (a plan of other gradients or settings carves other units).
    pub fn shared_settings(&self) -> Vec<(String, String)> {
        let c = self.config;
        let mut settings = crate::agreement::named([
            ("gradient_repacking", c.gradient_repacking.to_string()),
            (
                "agg_small_grads_max_bytes",
                c.agg_small_grads_max_bytes.to_string(),
            ),
            (
                "agg_small_grads_max_group",
                c.agg_small_grads_max_group.to_string(),
            ),
            ("gradients", self.specs.len().to_string()),
        ]);
        for dtype in DType::ALL {
            let of_dtype = self.specs.iter().filter(|s| s.dtype == dtype);
            let elements: usize = of_dtype.map(|s| s.len).sum();
            if elements > 0 {
                settings.push((format!("{} elements", dtype.name()), elements.to_string()));
            }
        }
        settings
    }

    /// All-reduces every gradient by the plan. `grads` must match the specs in order,
    /// dtype and length. The first call that gets past those checks compares
    /// [`GradientPacker::shared_settings`], `opts` and the communicator's settings with
    /// every other rank's ([`Communicator::check_same_values`]) and fails on every rank
    /// where they differ.
    ///
    /// Each unit is reduced where its pieces lie in the gradients, with the bits of one
    /// all-reduce of the pieces concatenated (as tf_cnn_benchmarks' concat, all-reduce and
    /// split give them), without copying them into a buffer of its own and back where the
    /// algorithm reduces pieces in place ([`Communicator::all_reduce_pieces`]).
    pub fn all_reduce(
        &mut self,
        comm: &mut Communicator,
        grads: &mut [TensorMut<'_>],
        opts: &AllReduceOptions,
    ) -> Result<()> {
        if grads.len() != self.specs.len() {
            return Err(Error::invalid(
                "number of gradients",
                grads.len(),
                "pass the gradients in the same order and number as the specs of the plan",
            ));
        }
        for (spec, g) in self.specs.iter().zip(grads.iter()) {
            if g.dtype() != spec.dtype || g.len() != spec.len {
                return Err(Error::invalid(
                    "gradient",
                    format!(
                        "`{}` as {}[{}] (planned as {}[{}])",
                        spec.name,
                        g.dtype(),
                        g.len(),
                        spec.dtype,
                        spec.len
                    ),
                    "pass each gradient with the dtype and length given to GradientPacker::new",
                ));
            }
        }
        if !self.agreed {
            let mut settings = self.shared_settings();
            settings.extend(opts.shared_settings());
            settings.extend(comm.shared_settings());
            comm.check_same_values("gradient packing settings", &settings)?;
            self.agreed = true;
        }
        for unit in &self.units {
            match unit.dtype {
                DType::F32 => reduce_unit::<f32>(comm, unit, grads, opts)?,
                DType::F64 => reduce_unit::<f64>(comm, unit, grads, opts)?,
                DType::F16 => reduce_unit::<half::f16>(comm, unit, grads, opts)?,
                DType::BF16 => reduce_unit::<half::bf16>(comm, unit, grads, opts)?,
            }
        }
        Ok(())
    }
}

/// Typed view of a gradient whose dtype was checked to be `T`.
fn typed<'a, T: Element>(g: &'a mut TensorMut<'_>) -> Result<&'a mut [T]> {
    let dtype = g.dtype();
    bytemuck::try_cast_slice_mut(g.as_bytes_mut()).map_err(|_| {
        Error::invalid(
            "gradient element type",
            dtype,
            "pass each gradient with the dtype given to GradientPacker::new",
        )
    })
}

/// All-reduces `unit` where its pieces lie in the gradients
/// ([`Communicator::all_reduce_pieces`], which copies them into one buffer only where the
/// algorithm or the pieces' sizes call for it): the bits of one all-reduce of the pieces
/// concatenated.
fn reduce_unit<T: Element>(
    comm: &mut Communicator,
    unit: &ReductionUnit,
    grads: &mut [TensorMut<'_>],
    opts: &AllReduceOptions,
) -> Result<()> {
    // Each gradient's part of the unit as one range: a plan's pieces come in list order,
    // and the pieces one gradient has in a unit (its packs aggregated together) follow
    // each other.
    let mut ranges: Vec<(usize, std::ops::Range<usize>)> = Vec::with_capacity(unit.pieces.len());
    for p in &unit.pieces {
        match ranges.last_mut() {
            Some((grad, range)) if *grad == p.grad && range.end == p.offset => range.end += p.len,
            _ => ranges.push((p.grad, p.offset..p.offset + p.len)),
        }
    }
    let mut pieces: Vec<&mut [T]> = Vec::with_capacity(ranges.len());
    // `rest` holds the gradients from index `first` on.
    let (mut rest, mut first) = (grads, 0);
    for (grad, range) in ranges {
        if grad < first {
            return Err(Error::invalid(
                "packing plan",
                format!("gradient {grad} appears twice, apart, in one reduction"),
                "plans come from GradientPacker::new, which never makes one",
            ));
        }
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(grad - first + 1);
        let g = typed::<T>(&mut head[grad - first])?;
        pieces.push(&mut g[range]);
        (rest, first) = (tail, grad + 1);
    }
    comm.all_reduce_pieces(&mut pieces, opts)
}

/// Concatenates the gradients of each dtype (dtypes in order of first appearance) and
/// splits each concatenation into `packs` packs; empty packs are dropped.
fn repack(specs: &[GradientSpec], packs: usize) -> Vec<ReductionUnit> {
    let mut dtypes: Vec<DType> = Vec::new();
    for s in specs {
        if !dtypes.contains(&s.dtype) {
            dtypes.push(s.dtype);
        }
    }
    let mut units = Vec::new();
    for dtype in dtypes {
        let members: Vec<usize> = (0..specs.len())
            .filter(|&i| specs[i].dtype == dtype)
            .collect();
        let total: usize = members.iter().map(|&i| specs[i].len).sum();
        let per_pack = total / packs;
        // Walk the concatenation once, cutting it at the pack boundaries.
        let mut member = 0;
        let mut offset = 0;
        for k in 0..packs {
            let mut want = if k + 1 == packs {
                total - per_pack * (packs - 1)
            } else {
                per_pack
            };
            let mut pieces = Vec::new();
            while want > 0 {
                let grad = members[member];
                let take = (specs[grad].len - offset).min(want);
                if take > 0 {
                    pieces.push(UnitPiece {
                        grad,
                        offset,
                        len: take,
                    });
                }
                offset += take;
                want -= take;
                if offset == specs[grad].len {
                    member += 1;
                    offset = 0;
                }
            }
            if !pieces.is_empty() {
                units.push(ReductionUnit { dtype, pieces });
            }
        }
    }
    units
}

/// Groups neighbouring tensors of at most `max_bytes` bytes and one dtype, at most
/// `max_group` per group. Larger tensors and lone small ones stay on their own.
fn aggregate(
    tensors: Vec<ReductionUnit>,
    max_bytes: usize,
    max_group: usize,
) -> Vec<ReductionUnit> {
    let mut out: Vec<ReductionUnit> = Vec::new();
    let mut group: Option<(ReductionUnit, usize)> = None;
    for t in tensors {
        let small = t.size_bytes() <= max_bytes;
        if let Some((g, members)) = group.as_mut() {
            if small && g.dtype == t.dtype && *members < max_group {
                g.pieces.extend(t.pieces);
                *members += 1;
                continue;
            }
        }
        if let Some((g, _)) = group.take() {
            out.push(g);
        }
        if small {
            group = Some((t, 1));
        } else {
            out.push(t);
        }
    }
    if let Some((g, _)) = group {
        out.push(g);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(lens: &[usize]) -> Vec<GradientSpec> {
        lens.iter()
            .enumerate()
            .map(|(i, &l)| GradientSpec::new(format!("g{i}"), DType::F32, l))
            .collect()
    }

    /// Ranks whose plans differ (other settings, another gradient list) or that reduce
    /// with other options fail on every rank at the first all-reduce, naming what
    /// differs; without the check they would reduce different units against each other.
    /// Plans that agree are checked once and reduce.
    #[test]
    fn plans_that_differ_between_ranks_fail_on_every_rank() {
        use crate::ReduceOp;
        let outs = Communicator::run_local(3, |mut comm| {
            let r = comm.rank();
            let lens: &[usize] = if r == 2 { &[5, 4] } else { &[5, 3] };
            let config = PackingConfig {
                gradient_repacking: if r == 1 { 2 } else { 0 },
                ..Default::default()
            };
            let opts = if r == 1 {
                AllReduceOptions::with_op(ReduceOp::Max)
            } else {
                AllReduceOptions::sum()
            };
            let mut packer = GradientPacker::new(specs(lens), config)?;
            let mut grads: Vec<Vec<f32>> = lens.iter().map(|&l| vec![1.0; l]).collect();
            let mut views: Vec<TensorMut<'_>> =
                grads.iter_mut().map(|g| g.as_mut_slice().into()).collect();
            let differ = packer.all_reduce(&mut comm, &mut views, &opts);
            // The same plan everywhere: checked on its first call, then reduced.
            let mut same = GradientPacker::new(specs(&[5, 3]), PackingConfig::default())?;
            let mut grads = [vec![1.0f32; 5], vec![2.0f32; 3]];
            for _ in 0..2 {
                let mut views: Vec<TensorMut<'_>> =
                    grads.iter_mut().map(|g| g.as_mut_slice().into()).collect();
                same.all_reduce(&mut comm, &mut views, &AllReduceOptions::sum())?;
            }
            Ok::<_, Error>((differ, grads))
        })
        .expect("run");
        for out in outs {
            let (differ, grads) = out.expect("rank");
            let message = differ.err().map(|e| e.to_string()).unwrap_or_default();
            for want in [
                "ranks were started with different gradient packing settings: ",
                "gradient_repacking: ranks 0, 2 = 0, rank 1 = 2",
                "f32 elements: ranks 0-1 = 8, rank 2 = 9",
                "op: ranks 0, 2 = sum, rank 1 = max",
            ] {
                assert!(message.contains(want), "{want} not in: {message}");
            }
            assert!(!message.contains("gradients:"), "{message}");
            assert_eq!(grads, [vec![9.0f32; 5], vec![18.0f32; 3]]);
        }
    }

    #[test]
    fn repacking_splits_the_concatenation_with_the_remainder_last() {
        let p = GradientPacker::new(
            specs(&[5, 3, 4]),
            PackingConfig {
                gradient_repacking: 5,
                ..Default::default()
            },
        )
        .unwrap();
        let lens: Vec<usize> = p.units().iter().map(|u| u.len()).collect();
        assert_eq!(lens, vec![2, 2, 2, 2, 4]);
        assert_eq!(
            p.units()[2].pieces,
            vec![
                UnitPiece {
                    grad: 0,
                    offset: 4,
                    len: 1
                },
                UnitPiece {
                    grad: 1,
                    offset: 0,
                    len: 1
                }
            ]
        );
    }

    #[test]
    fn aggregation_counts_real_bytes_and_caps_groups_exactly() {
        // f16 of 10 elements = 20 bytes: small under a 32-byte limit (4 bytes per element
        // would make it 40 and not small).
        let mut s: Vec<GradientSpec> = (0..7)
            .map(|i| GradientSpec::new(format!("h{i}"), DType::F16, 10))
            .collect();
        s.push(GradientSpec::new("big", DType::F16, 100));
        s.push(GradientSpec::new("lone", DType::F16, 1));
        let p = GradientPacker::new(
            s,
            PackingConfig {
                gradient_repacking: 0,
                agg_small_grads_max_bytes: 32,
                agg_small_grads_max_group: 3,
            },
        )
        .unwrap();
        let groups: Vec<Vec<usize>> = p
            .units()
            .iter()
            .map(|u| u.pieces.iter().map(|x| x.grad).collect())
            .collect();
        assert_eq!(
            groups,
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6], vec![7], vec![8]]
        );
    }

    #[test]
    fn zero_group_size_with_aggregation_on_is_rejected() {
        let err = GradientPacker::new(
            specs(&[1]),
            PackingConfig {
                gradient_repacking: 0,
                agg_small_grads_max_bytes: 8,
                agg_small_grads_max_group: 0,
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("agg_small_grads_max_group"));
    }
}
