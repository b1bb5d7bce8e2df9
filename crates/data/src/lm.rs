//! PTB-style language-model text: one sentence per line, tokens separated by whitespace,
//! `<eos>` appended to every line (an empty line gives a lone `<eos>`).
//!
//! # Batching
//!
//! The whole text is one token stream. With a global batch of `G` rows (the sum of every
//! rank's batch, see [`BatchSizing`]) the stream is cut into `G` contiguous columns of
//! `m = tokens / G` tokens each; the last `tokens % G` tokens are dropped (reported by
//! [`LmBatcher::dropped_tail_tokens`]). Rank `r` reads the columns
//! [`BatchSizing::local_range`]`(r, size)`, so ranks read disjoint text and together read all
//! of it. Each column is walked in windows of `steps` positions; the target of a position
//! is the next token. The last window of an epoch is padded and masked, so every one of the
//! `m - 1` predictable positions of every column is used exactly once per epoch. Every rank
//! has the same number of batches per epoch. The order is sequential (the recurrent state
//! carries from one window to the next), so there is no shuffling; line length limits do
//! not apply to a stream.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::batch::LmBatch;
use crate::error::{Error, Result};
use crate::line_reader::for_each_line;
use crate::position::EpochPosition;
use crate::sharding::BatchSizing;
use crate::vocab::{Vocab, LM_EOS, LM_SPECIALS};

/// A PTB-style text held in memory as one stream of token ids.
#[derive(Clone, Debug)]
pub struct LmCorpus {
    path: PathBuf,
    tokens: Vec<u32>,
    lines: usize,
    unk: usize,
}

impl LmCorpus {
    /// Loads `path` with a given vocabulary, which must contain `<eos>` (load it with
    /// [`Vocab::lm_from_file`]). Tokens not in the vocabulary become `<unk>` and are counted.
    ///
    /// # Errors
    /// A missing or empty file, invalid UTF-8 (naming the line), or a vocabulary without
    /// `<eos>`.
    pub fn load(path: &Path, vocab: &Vocab) -> Result<Self> {
        let eos = vocab.id(LM_EOS).ok_or_else(|| {
            Error::invalid(
                "language-model vocabulary",
                format!("{} tokens without {LM_EOS:?}", vocab.len()),
                format!("it must contain {LM_EOS:?}; load it with Vocab::lm_from_file"),
            )
        })?;
        let mut corpus = LmCorpus {
            path: path.to_path_buf(),
            tokens: Vec::new(),
            lines: 0,
            unk: 0,
        };
        corpus.lines = for_each_line(path, "text, one sentence per line", |_, line| {
            for word in line.split_whitespace() {
                let id = vocab.id(word).unwrap_or_else(|| {
                    corpus.unk += 1;
                    crate::vocab::UNK_ID
                });
                corpus.tokens.push(id);
            }
            corpus.tokens.push(eos);
            Ok(())
        })?;
        if corpus.unk > 0 {
            log::info!(
                "{}: {} of {} tokens are not in the vocabulary and read as <unk>",
                path.display(),
                corpus.unk,
                corpus.tokens.len()
            );
        }
        Ok(corpus)
    }

    /// Loads `path` and builds its vocabulary from the same text with
    /// [`Vocab::build_from_text`] (`<unk>`, `<eos>`, then tokens by count).
    pub fn load_building_vocab(path: &Path) -> Result<(Self, Vocab)> {
        let mut lines = Vec::new();
        for_each_line(path, "text, one sentence per line", |_, line| {
            lines.push(line.to_string());
            Ok(())
        })?;
        let vocab = Vocab::build_from_text(&lines, &LM_SPECIALS, None)?;
        let corpus = Self::load(path, &vocab)?;
        Ok((corpus, vocab))
    }

    /// A corpus from a token stream already given as ids; `name` stands for the file in
    /// messages.
    pub fn from_ids(tokens: Vec<u32>, name: &str) -> Self {
        LmCorpus {
            path: PathBuf::from(name),
            tokens,
            lines: 0,
            unk: 0,
        }
    }

    /// The token stream, `<eos>` after every line.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Lines read (0 for [`LmCorpus::from_ids`]).
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// Tokens that were not in the vocabulary.
    pub fn unk_count(&self) -> usize {
        self.unk
    }

    /// The file this corpus was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Makes this rank's language-model batches (see the module docs).
#[derive(Clone, Debug)]
pub struct LmBatcher {
    corpus: Arc<LmCorpus>,
    first_column: usize,
    local_batch: usize,
    column_len: usize,
    steps: usize,
    dropped: usize,
}

impl LmBatcher {
    /// The batcher of rank `rank` of `size`, `steps` time steps per batch.
    ///
    /// # Errors
    /// Invalid batch sizing or rank, `steps == 0`, or a text too short to give every column
    /// at least two tokens.
    pub fn new(
        corpus: Arc<LmCorpus>,
        batch: BatchSizing,
        steps: usize,
        rank: usize,
        size: usize,
    ) -> Result<Self> {
        let columns = batch.local_range(rank, size)?;
        if steps == 0 {
            return Err(Error::invalid(
                "number of steps",
                steps,
                "it must be at least 1",
            ));
        }
        let global = batch.global_batch_size(size);
        let tokens = corpus.tokens.len();
        let column_len = tokens / global;
        if column_len < 2 {
            return Err(Error::CorpusTooSmall {
                path: corpus.path.clone(),
                tokens,
                columns: global,
            });
        }
        Ok(LmBatcher {
            dropped: tokens - column_len * global,
            corpus,
            first_column: columns.start,
            local_batch: columns.len(),
            column_len,
            steps,
        })
    }

    /// This rank's batch size (examples: text columns).
    pub fn local_batch_size(&self) -> usize {
        self.local_batch
    }

    /// Batches per epoch; the same on every rank.
    pub fn batches_per_epoch(&self) -> usize {
        (self.column_len - 1).div_ceil(self.steps)
    }

    /// Tokens at the end of the text that fit no column.
    pub fn dropped_tail_tokens(&self) -> usize {
        self.dropped
    }

    /// One epoch of this rank's batches.
    pub fn epoch(&self) -> LmEpoch {
        LmEpoch {
            batcher: self.clone(),
            window: 0,
        }
    }

    /// Endless batches: the epoch repeated.
    pub fn stream(&self) -> LmStream {
        LmStream {
            epoch: 0,
            current: self.epoch(),
        }
    }

    /// Endless batches from `position` (from [`LmStream::position`] of a batcher with the
    /// same corpus, batch sizing, steps, rank and size): the window after the last one that
    /// stream handed out. A window past the epoch's end starts the next epoch.
    pub fn stream_at(&self, position: EpochPosition) -> LmStream {
        let window = usize::try_from(position.batch).unwrap_or(usize::MAX);
        LmStream {
            epoch: position.epoch,
            current: LmEpoch {
                batcher: self.clone(),
                window: window.min(self.batches_per_epoch()),
            },
        }
    }

    fn window(&self, window: usize) -> LmBatch {
        let (rows, steps) = (self.local_batch, self.steps);
        let predictable = self.column_len - 1;
        let tokens = &self.corpus.tokens;
        let mut inputs = vec![0; rows * steps];
        let mut targets = vec![0; rows * steps];
        let mut mask = vec![0.0; rows * steps];
        for row in 0..rows {
            let base = (self.first_column + row) * self.column_len;
            for t in 0..steps {
                let pos = window * steps + t;
                if pos >= predictable {
                    break;
                }
                let cell = t * rows + row;
                inputs[cell] = tokens[base + pos];
                targets[cell] = tokens[base + pos + 1];
                mask[cell] = 1.0;
            }
        }
        LmBatch {
            batch_size: rows,
            steps,
            inputs,
            targets,
            mask,
            first_in_epoch: window == 0,
        }
    }
}

/// One epoch of language-model batches (from [`LmBatcher::epoch`]).
#[derive(Clone, Debug)]
pub struct LmEpoch {
    batcher: LmBatcher,
    window: usize,
}

impl Iterator for LmEpoch {
    type Item = LmBatch;

    fn next(&mut self) -> Option<LmBatch> {
        if self.window >= self.batcher.batches_per_epoch() {
            return None;
        }
        let batch = self.batcher.window(self.window);
        self.window += 1;
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.batcher.batches_per_epoch() - self.window;
        (left, Some(left))
    }
}

impl ExactSizeIterator for LmEpoch {}

/// Endless language-model batches (from [`LmBatcher::stream`]).
#[derive(Clone, Debug)]
pub struct LmStream {
    epoch: u64,
    current: LmEpoch,
}

impl LmStream {
    /// Where the stream stands: its epoch and the windows of it handed out.
    pub fn position(&self) -> EpochPosition {
        EpochPosition {
            epoch: self.epoch,
            batch: self.current.window as u64,
        }
    }
}

impl Iterator for LmStream {
    type Item = LmBatch;

    fn next(&mut self) -> Option<LmBatch> {
        if let Some(batch) = self.current.next() {
            return Some(batch);
        }
        self.epoch += 1;
        self.current.window = 0;
        self.current.next()
    }
}
