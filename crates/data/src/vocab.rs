//! Vocabularies: token <-> id maps loaded from one-token-per-line files or built from text.
//!
//! # The special-token rule
//!
//! A vocabulary has a fixed list of special tokens that must own the first ids:
//! `<unk>`, `<s>`, `</s>` (ids 0, 1, 2) for translation, `<unk>`, `<eos>` (ids 0, 1) for
//! the language model. When a vocabulary file is loaded:
//!
//! * if its first lines are exactly the special tokens, in order, they are used as they are
//!   (the TensorFlow NMT layout);
//! * if none of the special tokens appears anywhere in the file, they are added in front and
//!   the file's first token gets the id after them;
//! * anything else (a special token on another line, or only some of them present) is an
//!   error that names the file and line.
//!
//! Other rules: one token per line; a token must not contain whitespace; empty lines are an
//! error except at the very end of the file, where they are ignored; a token listed twice is
//! an error naming both lines; `\r\n` line endings are accepted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::line_reader::for_each_line;

/// Unknown-word token; id [`UNK_ID`] in every vocabulary.
pub const UNK: &str = "<unk>";
/// Beginning-of-sentence token of translation vocabularies; id [`BOS_ID`].
pub const BOS: &str = "<s>";
/// End-of-sentence token of translation vocabularies; id [`EOS_ID`].
pub const EOS: &str = "</s>";
/// End-of-sentence token of language-model (PTB-style) vocabularies; id [`LM_EOS_ID`].
pub const LM_EOS: &str = "<eos>";

/// Id of [`UNK`] in every vocabulary.
pub const UNK_ID: u32 = 0;
/// Id of [`BOS`] in translation vocabularies.
pub const BOS_ID: u32 = 1;
/// Id of [`EOS`] in translation vocabularies (also the padding id of translation batches).
pub const EOS_ID: u32 = 2;
/// Id of [`LM_EOS`] in language-model vocabularies.
pub const LM_EOS_ID: u32 = 1;

/// Special tokens of translation vocabularies, in id order.
pub const NMT_SPECIALS: [&str; 3] = [UNK, BOS, EOS];
/// Special tokens of language-model vocabularies, in id order.
pub const LM_SPECIALS: [&str; 2] = [UNK, LM_EOS];

/// A token <-> id map. Ids are dense, `0..len()`; id 0 is always [`UNK`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    tokens: Vec<String>,
    index: HashMap<String, u32>,
    specials: usize,
}

impl Vocab {
    /// Loads a translation vocabulary (specials `<unk>`, `<s>`, `</s>`; see the module docs).
    pub fn nmt_from_file(path: &Path) -> Result<Vocab> {
        Self::from_file(path, &NMT_SPECIALS)
    }

    /// Loads a language-model vocabulary (specials `<unk>`, `<eos>`; see the module docs).
    pub fn lm_from_file(path: &Path) -> Result<Vocab> {
        Self::from_file(path, &LM_SPECIALS)
    }

    /// Loads a vocabulary file with the given special tokens (the first must be [`UNK`]).
    pub fn from_file(path: &Path, specials: &[&str]) -> Result<Vocab> {
        let mut lines = Vec::new();
        for_each_line(path, "a vocabulary, one token per line", |number, line| {
            lines.push((number, line.to_string()));
            Ok(())
        })?;
        Self::from_numbered_lines(lines, specials, path)
    }

    /// Builds a vocabulary from tokens in id order, as if they were the lines of a file
    /// called `source_name` (used in error messages). The special-token rule applies.
    pub fn from_tokens<I, S>(tokens: I, specials: &[&str], source_name: &str) -> Result<Vocab>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let lines = tokens
            .into_iter()
            .enumerate()
            .map(|(i, token)| (i + 1, token.as_ref().to_string()))
            .collect();
        Self::from_numbered_lines(lines, specials, Path::new(source_name))
    }

    fn from_numbered_lines(
        mut lines: Vec<(usize, String)>,
        specials: &[&str],
        path: &Path,
    ) -> Result<Vocab> {
        check_specials_list(specials)?;
        while lines.last().is_some_and(|(_, line)| line.is_empty()) {
            lines.pop();
        }
        if lines.is_empty() {
            return Err(Error::EmptyFile {
                path: path.to_path_buf(),
                what: "a vocabulary, one token per line",
            });
        }
        let mut first_seen: HashMap<&str, usize> = HashMap::with_capacity(lines.len());
        for (number, line) in &lines {
            if line.is_empty() {
                return Err(bad_line(path, *number, line, "empty line"));
            }
            if line.chars().any(char::is_whitespace) {
                return Err(bad_line(path, *number, line, "contains whitespace"));
            }
            if let Some(first) = first_seen.insert(line.as_str(), *number) {
                return Err(Error::DuplicateToken {
                    path: path.to_path_buf(),
                    token: line.clone(),
                    first_line: first,
                    second_line: *number,
                });
            }
        }
        let position = |token: &str| lines.iter().position(|(_, line)| line == token);
        let present: Vec<(usize, &str)> = specials
            .iter()
            .enumerate()
            .filter(|(_, s)| first_seen.contains_key(**s))
            .map(|(j, s)| (j, *s))
            .collect();
        let specials_owned = || specials.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let tokens: Vec<String> = if present.is_empty() {
            specials
                .iter()
                .map(|s| s.to_string())
                .chain(lines.into_iter().map(|(_, line)| line))
                .collect()
        } else if present.len() < specials.len() {
            return Err(Error::IncompleteSpecialTokens {
                path: path.to_path_buf(),
                present: present.iter().map(|(_, s)| s.to_string()).collect(),
                missing: specials
                    .iter()
                    .filter(|s| !first_seen.contains_key(**s))
                    .map(|s| s.to_string())
                    .collect(),
                specials: specials_owned(),
            });
        } else {
            for (j, special) in specials.iter().enumerate() {
                let found = position(special).unwrap_or(j);
                if found != j {
                    return Err(Error::MisplacedSpecialToken {
                        path: path.to_path_buf(),
                        token: special.to_string(),
                        line: lines[found].0,
                        expected_line: j + 1,
                        specials: specials_owned(),
                    });
                }
            }
            lines.into_iter().map(|(_, line)| line).collect()
        };
        Ok(Self::from_checked_tokens(tokens, specials.len()))
    }

    fn from_checked_tokens(tokens: Vec<String>, specials: usize) -> Vocab {
        let index = tokens
            .iter()
            .enumerate()
            .map(|(id, token)| (token.clone(), id as u32))
            .collect();
        Vocab {
            tokens,
            index,
            specials,
        }
    }

    /// Builds a vocabulary from whitespace-separated sentences: the special tokens first,
    /// then every other token by descending count, ties broken by byte order, so the same
    /// text always gives the same ids. `max_size` (specials included) keeps only the most
    /// frequent tokens; the rest become [`UNK`] when the text is encoded.
    ///
    /// # Errors
    /// When `specials` is empty, does not start with [`UNK`], or repeats a token.
    pub fn build_from_text<I, S>(
        sentences: I,
        specials: &[&str],
        max_size: Option<usize>,
    ) -> Result<Vocab>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        check_specials_list(specials)?;
        let mut counts: HashMap<String, u64> = HashMap::new();
        for sentence in sentences {
            for token in sentence.as_ref().split_whitespace() {
                if specials.contains(&token) {
                    continue;
                }
                match counts.get_mut(token) {
                    Some(count) => *count += 1,
                    None => {
                        counts.insert(token.to_string(), 1);
                    }
                }
            }
        }
        let mut by_count: Vec<(String, u64)> = counts.into_iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let room = max_size
            .map(|max| max.saturating_sub(specials.len()))
            .unwrap_or(usize::MAX);
        let tokens = specials
            .iter()
            .map(|s| s.to_string())
            .chain(by_count.into_iter().take(room).map(|(token, _)| token))
            .collect();
        Ok(Self::from_checked_tokens(tokens, specials.len()))
    }

    /// Number of tokens, specials included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the vocabulary has no tokens (never the case for a loaded one).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of special tokens at the front.
    pub fn num_specials(&self) -> usize {
        self.specials
    }

    /// The id of `token`, if it is in the vocabulary.
    pub fn id(&self, token: &str) -> Option<u32> {
        self.index.get(token).copied()
    }

    /// The id of `token`, or [`UNK_ID`] when it is not in the vocabulary.
    pub fn id_or_unk(&self, token: &str) -> u32 {
        self.id(token).unwrap_or(UNK_ID)
    }

    /// The token with id `id`, if there is one.
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// All tokens in id order.
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }

    /// Writes the vocabulary, one token per line in id order (specials included), so that
    /// loading the file again gives the same ids.
    pub fn write_to(&self, path: &Path) -> Result<()> {
        let mut text = String::with_capacity(self.tokens.iter().map(|t| t.len() + 1).sum());
        for token in &self.tokens {
            text.push_str(token);
            text.push('\n');
        }
        std::fs::write(path, text).map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        })
    }
}

fn check_specials_list(specials: &[&str]) -> Result<()> {
    if specials.first() != Some(&UNK) {
        return Err(Error::invalid(
            "special tokens",
            format!("{specials:?}"),
            format!("the list must start with {UNK:?} (id 0 is the unknown-word id)"),
        ));
    }
    for (i, special) in specials.iter().enumerate() {
        if specials[..i].contains(special) || special.chars().any(char::is_whitespace) {
            return Err(Error::invalid(
                "special tokens",
                format!("{specials:?}"),
                "each special token must appear once and contain no whitespace",
            ));
        }
    }
    Ok(())
}

fn bad_line(path: &Path, line: usize, value: &str, problem: &'static str) -> Error {
    Error::BadVocabLine {
        path: PathBuf::from(path),
        line,
        value: value.to_string(),
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_with_specials_first_keeps_its_ids() {
        let vocab = Vocab::from_tokens(["<unk>", "<s>", "</s>", "a", "b"], &NMT_SPECIALS, "v")
            .expect("valid vocab");
        assert_eq!(vocab.len(), 5);
        assert_eq!(vocab.id("a"), Some(3));
        assert_eq!(vocab.id(EOS), Some(EOS_ID));
        assert_eq!(vocab.id_or_unk("zzz"), UNK_ID);
        assert_eq!(vocab.token(4), Some("b"));
    }

    #[test]
    fn file_without_specials_gets_them_prepended() {
        let vocab = Vocab::from_tokens(["a", "b"], &NMT_SPECIALS, "v").expect("valid vocab");
        assert_eq!(vocab.tokens(), &["<unk>", "<s>", "</s>", "a", "b"]);
        assert_eq!(vocab.num_specials(), 3);
    }

    #[test]
    fn misplaced_special_is_an_error_naming_the_line() {
        let err = Vocab::from_tokens(["<s>", "<unk>", "</s>", "a"], &NMT_SPECIALS, "v.txt")
            .expect_err("misplaced");
        match &err {
            Error::MisplacedSpecialToken {
                token,
                line,
                expected_line,
                ..
            } => {
                assert_eq!((token.as_str(), *line, *expected_line), ("<unk>", 2, 1));
            }
            other => panic!("wrong error {other:?}"),
        }
        assert!(err.to_string().contains("v.txt:2"));
    }

    #[test]
    fn partial_specials_are_an_error() {
        let err = Vocab::from_tokens(["<unk>", "a"], &NMT_SPECIALS, "v").expect_err("partial");
        assert!(
            matches!(err, Error::IncompleteSpecialTokens { ref missing, .. } if missing == &["<s>", "</s>"])
        );
    }

    #[test]
    fn duplicate_names_both_lines() {
        let err = Vocab::from_tokens(["a", "b", "a"], &LM_SPECIALS, "v").expect_err("dup");
        assert!(matches!(
            err,
            Error::DuplicateToken {
                first_line: 1,
                second_line: 3,
                ..
            }
        ));
    }

    #[test]
    fn whitespace_and_empty_lines() {
        let err = Vocab::from_tokens(["a", "b c"], &LM_SPECIALS, "v").expect_err("space");
        assert!(matches!(err, Error::BadVocabLine { line: 2, .. }));
        let err = Vocab::from_tokens(["a", "", "b"], &LM_SPECIALS, "v").expect_err("empty");
        assert!(matches!(err, Error::BadVocabLine { line: 2, .. }));
        let vocab = Vocab::from_tokens(["a", "b", "", ""], &LM_SPECIALS, "v").expect("trailing");
        assert_eq!(vocab.len(), 4);
    }

    #[test]
    fn build_from_text_orders_by_count_then_bytes() {
        let vocab =
            Vocab::build_from_text(["b a c <eos>", "a b", "a d"], &LM_SPECIALS, None).expect("ok");
        assert_eq!(vocab.tokens(), &["<unk>", "<eos>", "a", "b", "c", "d"]);
        let small =
            Vocab::build_from_text(["b a c", "a b", "a d"], &LM_SPECIALS, Some(3)).expect("ok");
        assert_eq!(small.tokens(), &["<unk>", "<eos>", "a"]);
    }

    #[test]
    fn bad_specials_list_is_rejected() {
        assert!(Vocab::build_from_text(["a"], &["<s>"], None).is_err());
        assert!(Vocab::from_tokens(["a"], &["<unk>", "<unk>"], "v").is_err());
    }
}
