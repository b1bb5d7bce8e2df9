//! Paths of the small corpus kept in the repository's `data/` folder (built and checked by
//! `scripts/prepare-corpus`), for tests, examples and the demo.
//!
//! * `data/nmt/`: English (`.en`) to a deterministic pseudo-language (`.xx`) sentence pairs,
//!   `train`/`dev`/`test` splits, vocabularies `vocab.en` and `vocab.xx` whose first lines are
//!   `<unk>`, `<s>`, `</s>`.
//! * `data/lm/`: PTB-style text `train.txt`, `valid.txt`, `test.txt` and `vocab.txt`
//!   (`<unk>`, `<eos>`, then the training text's tokens by count).

use std::path::{Path, PathBuf};

/// The files of the bundled corpus under one directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundledCorpus {
    /// The directory holding `nmt/` and `lm/`.
    pub dir: PathBuf,
    /// English training sentences.
    pub nmt_train_src: PathBuf,
    /// Their translations.
    pub nmt_train_tgt: PathBuf,
    /// English development sentences.
    pub nmt_dev_src: PathBuf,
    /// Their translations.
    pub nmt_dev_tgt: PathBuf,
    /// English test sentences.
    pub nmt_test_src: PathBuf,
    /// Their translations.
    pub nmt_test_tgt: PathBuf,
    /// Source vocabulary.
    pub nmt_vocab_src: PathBuf,
    /// Target vocabulary.
    pub nmt_vocab_tgt: PathBuf,
    /// Language-model training text.
    pub lm_train: PathBuf,
    /// Language-model validation text.
    pub lm_valid: PathBuf,
    /// Language-model test text.
    pub lm_test: PathBuf,
    /// Language-model vocabulary.
    pub lm_vocab: PathBuf,
}

impl BundledCorpus {
    /// The corpus files under `dir` (which need not exist; loading reports missing files).
    pub fn in_dir(dir: &Path) -> Self {
        let nmt = dir.join("nmt");
        let lm = dir.join("lm");
        BundledCorpus {
            dir: dir.to_path_buf(),
            nmt_train_src: nmt.join("train.en"),
            nmt_train_tgt: nmt.join("train.xx"),
            nmt_dev_src: nmt.join("dev.en"),
            nmt_dev_tgt: nmt.join("dev.xx"),
            nmt_test_src: nmt.join("test.en"),
            nmt_test_tgt: nmt.join("test.xx"),
            nmt_vocab_src: nmt.join("vocab.en"),
            nmt_vocab_tgt: nmt.join("vocab.xx"),
            lm_train: lm.join("train.txt"),
            lm_valid: lm.join("valid.txt"),
            lm_test: lm.join("test.txt"),
            lm_vocab: lm.join("vocab.txt"),
        }
    }

    /// The corpus in the `data/` folder of the source checkout this crate was built from.
    pub fn in_repo() -> Self {
        Self::in_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data"))
    }
}
