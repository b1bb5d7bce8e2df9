//! Row kernels compiled twice: for the baseline x86-64 the crate builds for, and for
//! AVX-512, taken at run time where the CPU has it (with `std`, which can ask).
//!
//! The twin runs the same source with wider vectors. The row kernels use no fused
//! multiply-add and no reassociation (Rust never contracts or reorders float arithmetic on
//! its own), and their lane sums keep their fixed lane count, so both twins give the same
//! bits on every input; the tests of each kernel hold for whichever twin the CPU takes.

/// Whether this CPU runs the AVX-512 twins (F, BW, DQ and VL; the answer is cached by
/// the standard library).
#[cfg(all(feature = "std", target_arch = "x86_64"))]
#[inline]
pub(crate) fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// `fn $name(args) -> R` that runs `$body(args)`, compiled for AVX-512 where the CPU has
/// it. `$body` must be `#[inline(always)]` so that it is compiled into each twin.
macro_rules! wide_twin {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:ident;
    ) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(all(feature = "std", target_arch = "x86_64"))]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
                fn wide($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if $crate::wide::has_avx512() {
                    // SAFETY: the CPU has every feature `wide` is compiled for (checked
                    // just above).
                    return unsafe { wide($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

pub(crate) use wide_twin;
