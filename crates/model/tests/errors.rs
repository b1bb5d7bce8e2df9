//! Bad configs, bad batches and the CUDA backend give clear errors.

mod toy;

#[cfg(not(feature = "cuda"))]
use ringtrain_model::CudaBackend;
use ringtrain_model::{EncoderKind, Error, LstmImpl, Model, NmtModel};

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_backend_without_feature_is_not_compiled() {
    let err = CudaBackend::new(0).expect_err("no cuda feature");
    assert!(
        matches!(err, Error::NotCompiledWithCuda { device: 0 }),
        "{err}"
    );
    assert!(err.to_string().contains("--features cuda"));
}

#[test]
fn bad_configs_are_rejected() {
    let odd = toy::tiny_nmt(EncoderKind::Bi, 3, LstmImpl::Fused);
    let err = NmtModel::new(toy::cpu(1), odd, 1).expect_err("odd bi layers");
    assert!(
        matches!(err, Error::InvalidValue { name: "layers", .. }),
        "{err}"
    );
    let zero = ringtrain_model::NmtConfig {
        hidden: 0,
        ..toy::tiny_nmt(EncoderKind::Uni, 1, LstmImpl::Fused)
    };
    let err = NmtModel::new(toy::cpu(1), zero, 1).expect_err("hidden 0");
    assert!(
        matches!(err, Error::InvalidValue { name: "hidden", .. }),
        "{err}"
    );
    assert!(ringtrain_model::CpuBackend::new(0).is_err());
}

#[test]
fn bad_batches_are_rejected() {
    let config = toy::tiny_nmt(EncoderKind::Bi, 2, LstmImpl::Fused);
    let mut model = NmtModel::new(toy::cpu(1), config.clone(), 1).expect("model");
    let mut data = toy::NmtData::random(&config, 2, 3, 3, 1);
    data.src[4] = config.src_vocab as u32;
    let err = model
        .forward_loss(&data.view())
        .expect_err("src id out of range");
    assert!(
        matches!(err, Error::InvalidBatch { name: "src", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("position 4"), "{err}");

    let mut data = toy::NmtData::random(&config, 2, 3, 3, 1);
    data.tgt_out[1] = 100;
    let err = model
        .forward_loss(&data.view())
        .expect_err("label out of range");
    assert!(
        matches!(
            err,
            Error::InvalidBatch {
                name: "tgt_out",
                ..
            }
        ),
        "{err}"
    );
    // The same label under a zero mask is padding and allowed.
    data.mask[1] = 0.0;
    assert!(model.forward_loss(&data.view()).is_ok());

    let mut data = toy::NmtData::random(&config, 2, 3, 3, 1);
    data.tgt_in.pop();
    let err = model.forward_loss(&data.view()).expect_err("short tgt_in");
    assert!(
        matches!(err, Error::InvalidBatch { name: "tgt_in", .. }),
        "{err}"
    );
}

#[test]
fn workspaces_grow_with_larger_batches() {
    let config = toy::tiny_nmt(EncoderKind::Bi, 2, LstmImpl::Fused);
    let mut model = NmtModel::new(toy::cpu(1), config.clone(), 1).expect("model");
    let small = toy::NmtData::random(&config, 2, 3, 2, 1);
    let large = toy::NmtData::random(&config, 4, 6, 5, 2);
    let a = model.forward_loss(&small.view()).expect("small").loss_sum;
    let b = model.forward_loss(&large.view()).expect("large").loss_sum;
    let a2 = model
        .forward_loss(&small.view())
        .expect("small again")
        .loss_sum;
    assert!(b > a);
    assert_eq!(a, a2, "reusing larger workspaces changed the result");
}
