//! Reductions used by the collectives.

use half::{bf16, f16};
use proptest::prelude::*;
use ringtrain_kernels::{
    scale_bf16, scale_f16, scale_f32, scale_f64, sum_into_bf16, sum_into_f16, sum_into_f32,
    sum_into_f64, Error, ReduceElement,
};

#[test]
fn f32_and_f64_sums_are_exact_on_integers() {
    let mut acc = vec![1.0f32, 2.0, 3.0];
    sum_into_f32(&mut acc, &[10.0, 20.0, 30.0]).unwrap();
    assert_eq!(acc, [11.0, 22.0, 33.0]);
    let mut acc = vec![1.0f64, -2.0];
    sum_into_f64(&mut acc, &[0.5, 0.25]).unwrap();
    assert_eq!(acc, [1.5, -1.75]);
}

#[test]
fn half_sums_round_once_from_f32() {
    // 2048 + 1 is not an f16 (spacing 2 there): the tie rounds to even, 2048.
    // 2048 + 3 = 2051 rounds to 2052 (tie to even).
    let mut acc: Vec<f16> = [2048.0f32, 2048.0, 1.5]
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let src: Vec<f16> = [1.0f32, 3.0, 0.25]
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    sum_into_f16(&mut acc, &src).unwrap();
    let got: Vec<f32> = acc.iter().map(|h| h.to_f32()).collect();
    assert_eq!(got, [2048.0, 2052.0, 1.75]);

    // bf16 spacing at 256 is 2.
    let mut acc = vec![bf16::from_f32(256.0), bf16::from_f32(256.0)];
    sum_into_bf16(&mut acc, &[bf16::from_f32(1.0), bf16::from_f32(3.0)]).unwrap();
    assert_eq!(acc[0].to_f32(), 256.0);
    assert_eq!(acc[1].to_f32(), 260.0);

    // Overflow gives Inf, as the GPU does.
    let mut acc = vec![f16::MAX];
    sum_into_f16(&mut acc, &[f16::MAX]).unwrap();
    assert_eq!(acc[0], f16::INFINITY);
}

#[test]
fn scale_goes_through_f32() {
    let mut a = vec![1.0f32, -2.0];
    scale_f32(&mut a, 0.5);
    assert_eq!(a, [0.5, -1.0]);
    let mut a = vec![3.0f64];
    scale_f64(&mut a, 1.0 / 3.0);
    assert_eq!(a, [1.0]);
    let mut h = vec![f16::from_f32(3.0); 300];
    scale_f16(&mut h, 0.5);
    assert!(h.iter().all(|x| x.to_f32() == 1.5));
    let mut b = vec![bf16::from_f32(3.0); 3];
    scale_bf16(&mut b, 1e30);
    assert!(b.iter().all(|x| *x == bf16::from_f32(3e30)));
}

fn check_min_max<T: ReduceElement>() {
    let v = |x: f64| T::from_f64(x);
    let mut lo = vec![v(1.0), v(-2.0), v(f64::NAN), v(4.0), v(5.0)];
    let mut hi = lo.clone();
    let src = [v(0.5), v(3.0), v(1.0), v(f64::NAN), v(5.0)];
    T::min_into(&mut lo, &src).unwrap();
    T::max_into(&mut hi, &src).unwrap();
    let lo: Vec<f64> = lo.into_iter().map(T::to_f64).collect();
    let hi: Vec<f64> = hi.into_iter().map(T::to_f64).collect();
    assert_eq!(lo[..2], [0.5, -2.0], "{}", T::NAME);
    assert_eq!(hi[..2], [1.0, 3.0], "{}", T::NAME);
    assert!(
        lo[2].is_nan() && lo[3].is_nan(),
        "{}: NaN propagates",
        T::NAME
    );
    assert!(
        hi[2].is_nan() && hi[3].is_nan(),
        "{}: NaN propagates",
        T::NAME
    );
    assert_eq!((lo[4], hi[4]), (5.0, 5.0));

    let mut acc = vec![v(1.0), v(2.0)];
    T::sum_into(&mut acc, &[v(3.0), v(-5.0)]).unwrap();
    assert_eq!(acc, [v(4.0), v(-3.0)], "{}", T::NAME);
    T::scale(&mut acc, 0.5);
    assert_eq!(acc, [v(2.0), v(-1.5)], "{}", T::NAME);

    let err = T::sum_into(&mut acc, &[v(1.0)]).unwrap_err();
    assert_eq!(
        err,
        Error::ShapeMismatch {
            arg: "src",
            expected: 2,
            actual: 1
        }
    );
    assert!(T::min_into(&mut acc, &[]).is_err());
    assert!(T::max_into(&mut acc, &[v(0.0); 3]).is_err());
    assert_eq!(acc, [v(2.0), v(-1.5)], "nothing written on error");
    assert_eq!(std::mem::size_of::<T>(), T::BYTES);
}

#[test]
fn reduce_element_works_for_every_type() {
    check_min_max::<f32>();
    check_min_max::<f64>();
    check_min_max::<f16>();
    check_min_max::<bf16>();
    assert_eq!(
        [f32::NAME, f64::NAME, f16::NAME, bf16::NAME],
        ["f32", "f64", "f16", "bf16"]
    );
}

#[test]
fn length_mismatch_names_src() {
    for err in [
        sum_into_f32(&mut [0.0; 2], &[0.0; 3]).unwrap_err(),
        sum_into_f64(&mut [0.0; 2], &[0.0; 3]).unwrap_err(),
        sum_into_f16(&mut [f16::ZERO; 2], &[f16::ZERO; 3]).unwrap_err(),
        sum_into_bf16(&mut [bf16::ZERO; 2], &[bf16::ZERO; 3]).unwrap_err(),
    ] {
        assert_eq!(
            err,
            Error::ShapeMismatch {
                arg: "src",
                expected: 2,
                actual: 3
            }
        );
    }
}

/// Cases per property: `PROPTEST_CASES` when set (a long soak), else `quick`, this
/// file's default, sized for CI.
fn cases(quick: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(quick)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(48)))]

    #[test]
    fn half_sums_equal_the_f32_definition(
        pairs in prop::collection::vec((-3000.0f32..3000.0, -3000.0f32..3000.0), 1..700)
    ) {
        let a16: Vec<f16> = pairs.iter().map(|p| f16::from_f32(p.0)).collect();
        let b16: Vec<f16> = pairs.iter().map(|p| f16::from_f32(p.1)).collect();
        let mut acc = a16.clone();
        sum_into_f16(&mut acc, &b16).unwrap();
        for n in 0..pairs.len() {
            let want = f16::from_f32_const(a16[n].to_f32() + b16[n].to_f32());
            prop_assert_eq!(acc[n].to_bits(), want.to_bits());
        }
        let a: Vec<bf16> = pairs.iter().map(|p| bf16::from_f32(p.0)).collect();
        let b: Vec<bf16> = pairs.iter().map(|p| bf16::from_f32(p.1)).collect();
        let mut acc = a.clone();
        sum_into_bf16(&mut acc, &b).unwrap();
        for n in 0..pairs.len() {
            let want = bf16::from_f32_const(a[n].to_f32() + b[n].to_f32());
            prop_assert_eq!(acc[n].to_bits(), want.to_bits());
        }
        let mut acc: Vec<f64> = pairs.iter().map(|p| f64::from(p.0)).collect();
        let src: Vec<f64> = pairs.iter().map(|p| f64::from(p.1)).collect();
        sum_into_f64(&mut acc, &src).unwrap();
        for (n, p) in pairs.iter().enumerate() {
            prop_assert_eq!(acc[n], f64::from(p.0) + f64::from(p.1));
        }
    }
}
