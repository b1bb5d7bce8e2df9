//! Length buckets: sentences of similar length are batched together to cut padding.

use crate::error::{Error, Result};

/// The bucket of a sentence of `len` tokens: `len / bucket_width`, capped at
/// `num_buckets - 1` (TensorFlow NMT's rule). With `num_buckets == 1` everything is in
/// bucket 0. A `bucket_width` or `num_buckets` of 0 is treated as 1.
pub fn bucket_of(len: usize, bucket_width: usize, num_buckets: usize) -> usize {
    let width = bucket_width.max(1);
    (len / width).min(num_buckets.max(1) - 1)
}

/// Checks bucket parameters given by a user.
pub(crate) fn check_buckets(bucket_width: usize, num_buckets: usize) -> Result<()> {
    if num_buckets == 0 {
        return Err(Error::invalid(
            "number of buckets",
            num_buckets,
            "use at least 1 (1 turns bucketing off)",
        ));
    }
    if bucket_width == 0 {
        return Err(Error::invalid(
            "bucket width",
            bucket_width,
            "use at least 1 token (TensorFlow NMT uses 10)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tf_nmt_rule() {
        assert_eq!(bucket_of(0, 10, 5), 0);
        assert_eq!(bucket_of(9, 10, 5), 0);
        assert_eq!(bucket_of(10, 10, 5), 1);
        assert_eq!(bucket_of(49, 10, 5), 4);
        assert_eq!(bucket_of(100, 10, 5), 4);
        assert_eq!(bucket_of(100, 10, 1), 0);
        assert!(check_buckets(10, 0).is_err());
        assert!(check_buckets(0, 5).is_err());
        assert!(check_buckets(10, 5).is_ok());
    }
}
