//! Described machines: links by their published bandwidth (one direction, what a ring
//! step uses) and a per-message latency. Bandwidths are the specifications' line rates
//! after encoding, not measured all-reduce figures: real collectives reach some 70–90 %
//! of them, so predictions from a preset are an upper bound of what the link allows.

use super::model::Link;

/// A named link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset {
    /// The name `--link` takes.
    pub name: &'static str,
    /// What it is.
    pub description: &'static str,
    /// Bytes per second, one direction.
    pub bytes_per_second: f64,
    /// Seconds per message.
    pub latency: f64,
}

impl Preset {
    /// alpha = latency, beta = 1 / bandwidth.
    pub fn link(&self) -> Link {
        Link {
            alpha: self.latency,
            beta: 1.0 / self.bytes_per_second,
        }
    }
}

/// NVLink 4 between H100 SXM GPUs: 900 GB/s per GPU over both directions, 450 GB/s each
/// way (NVIDIA H100 Tensor Core GPU datasheet, "NVLink: 900GB/s"). Latency: 2 µs per
/// message, the order of NCCL's small-message step on NVLink (nccl-tests' smallest
/// sizes on DGX H100).
pub const NVLINK_H100: Preset = Preset {
    name: "nvlink-h100",
    description: "NVLink 4 (H100 SXM): 450 GB/s each way, 2 us",
    bytes_per_second: 450e9,
    latency: 2e-6,
};

/// PCI Express 4.0 x16: 16 GT/s per lane, 128b/130b encoding, 16 lanes = 31.5 GB/s each
/// way (PCI-SIG, PCI Express Base Specification 4.0). Latency: 5 µs per message, a
/// GPU-to-GPU copy through host memory with a CUDA copy's launch cost.
pub const PCIE4: Preset = Preset {
    name: "pcie4",
    description: "PCIe 4.0 x16: 31.5 GB/s each way, 5 us",
    bytes_per_second: 31.5e9,
    latency: 5e-6,
};

/// PCI Express 5.0 x16: 32 GT/s per lane, 128b/130b encoding = 63 GB/s each way
/// (PCI-SIG, PCI Express Base Specification 5.0). Latency as [`PCIE4`].
pub const PCIE5: Preset = Preset {
    name: "pcie5",
    description: "PCIe 5.0 x16: 63 GB/s each way, 5 us",
    bytes_per_second: 63e9,
    latency: 5e-6,
};

/// InfiniBand HDR: 200 Gb/s per port = 25 GB/s each way, latency 0.6 µs (NVIDIA/Mellanox
/// ConnectX-6 VPI adapter product brief: "HDR 200Gb/s", "sub 600ns latency").
pub const IB_HDR: Preset = Preset {
    name: "ib-hdr",
    description: "InfiniBand HDR: 25 GB/s each way, 0.6 us",
    bytes_per_second: 25e9,
    latency: 0.6e-6,
};

/// InfiniBand NDR: 400 Gb/s per port = 50 GB/s each way, latency 0.6 µs (NVIDIA
/// ConnectX-7 product brief: "NDR 400Gb/s", latency as ConnectX-6).
pub const IB_NDR: Preset = Preset {
    name: "ib-ndr",
    description: "InfiniBand NDR: 50 GB/s each way, 0.6 us",
    bytes_per_second: 50e9,
    latency: 0.6e-6,
};

/// The seeds' box: 8 × P100 PCIe on PCI Express 3.0 x16, 8 GT/s per lane, 128b/130b =
/// 15.75 GB/s each way (PCI-SIG, PCI Express Base Specification 3.0; NVIDIA Tesla P100
/// PCIe datasheet, "PCIe Gen3 x16: 32 GB/s" both ways). Latency: 10 µs per message,
/// NCCL 2's small-message step across PCIe switches and the host bridge.
pub const P100_PCIE: Preset = Preset {
    name: "p100-pcie",
    description: "8 x P100 on PCIe 3.0 x16 (the seeds' box): 15.75 GB/s each way, 10 us",
    bytes_per_second: 15.75e9,
    latency: 10e-6,
};

/// Every preset, in `--help` order.
pub const PRESETS: &[Preset] = &[NVLINK_H100, PCIE4, PCIE5, IB_HDR, IB_NDR, P100_PCIE];

/// The preset `name` names.
///
/// # Errors
/// The reason, with the names there are.
pub fn preset(name: &str) -> Result<Preset, String> {
    PRESETS
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(name.trim()))
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
            format!("no such link; use one of {}", names.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_found_by_name_and_ordered_as_published() {
        assert_eq!(preset("NVLink-H100"), Ok(NVLINK_H100));
        let e = preset("ethernet").unwrap_err();
        assert!(e.contains("pcie4") && e.contains("ib-ndr"), "{e}");
        for p in PRESETS {
            assert!(
                p.bytes_per_second.is_finite() && p.bytes_per_second > 0.0,
                "{p:?}"
            );
            assert!(p.latency > 0.0 && p.latency < 1e-4, "{p:?}");
            assert_eq!(preset(p.name), Ok(*p));
        }
        assert!((P100_PCIE.link().beta * 15.75e9 - 1.0).abs() < 1e-12);
    }
}
