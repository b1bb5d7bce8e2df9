//! Every kind of bad input gives a clear error (or its documented handling), never a panic.

use std::fs;
use std::path::{Path, PathBuf};

use ringtrain_data::{
    BatchSizing, Error, LengthLimits, LmBatcher, LmCorpus, OverLimit, ParallelCorpus, Vocab,
    NMT_SPECIALS, UNK_ID,
};
use std::sync::Arc;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, bytes).expect("write temp file");
    path
}

fn vocab(words: &[&str]) -> Vocab {
    Vocab::from_tokens(words.iter().copied(), &NMT_SPECIALS, "test vocab").expect("valid vocab")
}

fn load(src: &Path, tgt: &Path, limits: &LengthLimits) -> ringtrain_data::Result<ParallelCorpus> {
    let v = vocab(&["a", "b", "c", "d"]);
    ParallelCorpus::load(src, tgt, &v, &v, limits)
}

#[test]
fn missing_file_names_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.en");
    let err = Vocab::nmt_from_file(&missing).expect_err("missing");
    assert!(matches!(err, Error::Io { ref path, .. } if path == &missing));
    assert!(err.to_string().contains("nope.en"), "{err}");
    let tgt = write(dir.path(), "t.xx", b"a\n");
    let err = load(&missing, &tgt, &LengthLimits::default()).expect_err("missing");
    assert!(err.to_string().contains("nope.en"), "{err}");
}

#[test]
fn empty_files_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = write(dir.path(), "empty", b"");
    let full = write(dir.path(), "full", b"a b\n");
    assert!(matches!(
        Vocab::nmt_from_file(&empty),
        Err(Error::EmptyFile { .. })
    ));
    assert!(matches!(
        load(&empty, &full, &LengthLimits::default()),
        Err(Error::EmptyFile { ref path, .. }) if path == &empty
    ));
    assert!(matches!(
        load(&full, &empty, &LengthLimits::default()),
        Err(Error::EmptyFile { ref path, .. }) if path == &empty
    ));
    assert!(matches!(
        LmCorpus::load_building_vocab(&empty),
        Err(Error::EmptyFile { .. })
    ));
    // A vocabulary of blank lines only is empty too.
    let blank = write(dir.path(), "blank", b"\n\n");
    assert!(matches!(
        Vocab::nmt_from_file(&blank),
        Err(Error::EmptyFile { .. })
    ));
}

#[test]
fn over_limit_lines_are_truncated_or_skipped_and_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = write(dir.path(), "s", b"a b c d\na\na b c\na b\n");
    let tgt = write(dir.path(), "t", b"a\na b c d\nb\nc d\n");
    let truncate = LengthLimits {
        src_max_len: Some(2),
        tgt_max_len: Some(3),
        over_limit: OverLimit::Truncate,
    };
    let corpus = load(&src, &tgt, &truncate).expect("loads");
    assert_eq!(corpus.len(), 4);
    assert_eq!(corpus.stats().truncated, 3);
    assert_eq!(corpus.pair(0).map(|(s, _)| s.len()), Some(2));
    assert_eq!(corpus.pair(1).map(|(_, t)| t.len()), Some(3));
    assert_eq!(corpus.stats().source_tokens, 2 + 1 + 2 + 2);
    let skip = LengthLimits {
        over_limit: OverLimit::Skip,
        ..truncate
    };
    let corpus = load(&src, &tgt, &skip).expect("loads");
    assert_eq!(corpus.len(), 1);
    assert_eq!(corpus.stats().skipped_too_long, 3);
    assert_eq!(
        corpus.pair(0).map(|(s, t)| (s.len(), t.len())),
        Some((2, 2))
    );
    // When every pair is over a limit, skipping leaves none: that is an error.
    let none_left = LengthLimits {
        src_max_len: Some(1),
        tgt_max_len: Some(1),
        over_limit: OverLimit::Skip,
    };
    let err = load(&src, &tgt, &none_left).expect_err("nothing left");
    assert!(matches!(err, Error::NoExamples { .. }), "{err}");
    assert!(err.to_string().contains("4 over the length limit"), "{err}");
}

#[test]
fn zero_length_limit_is_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = write(dir.path(), "s", b"a\n");
    let limits = LengthLimits {
        src_max_len: Some(0),
        ..LengthLimits::default()
    };
    let err = load(&src, &src, &limits).expect_err("zero");
    assert!(
        err.to_string()
            .contains("invalid value `0` for source max length"),
        "{err}"
    );
}

#[test]
fn unknown_tokens_become_unk_and_are_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = write(dir.path(), "s", b"a zz b\n");
    let tgt = write(dir.path(), "t", b"yy xx\n");
    let corpus = load(&src, &tgt, &LengthLimits::default()).expect("loads");
    let (s, t) = corpus.pair(0).expect("one pair");
    assert_eq!(s[1], UNK_ID);
    assert_eq!(t, [UNK_ID, UNK_ID]);
    assert_eq!(
        (corpus.stats().source_unk, corpus.stats().target_unk),
        (1, 2)
    );
}

#[test]
fn pairs_with_an_empty_side_are_skipped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = write(dir.path(), "s", b"a\n\nb\n");
    let tgt = write(dir.path(), "t", b"  \nc\nd\n");
    let corpus = load(&src, &tgt, &LengthLimits::default()).expect("loads");
    assert_eq!(corpus.len(), 1);
    assert_eq!(corpus.stats().skipped_empty, 2);
    assert_eq!(corpus.stats().lines, 3);
}

#[test]
fn duplicate_vocab_entry_names_both_lines() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write(
        dir.path(),
        "vocab.en",
        b"<unk>\n<s>\n</s>\nhouse\ncat\nhouse\n",
    );
    let err = Vocab::nmt_from_file(&path).expect_err("duplicate");
    let text = err.to_string();
    assert!(matches!(
        err,
        Error::DuplicateToken {
            first_line: 4,
            second_line: 6,
            ..
        }
    ));
    assert!(text.contains("\"house\"") && text.contains("line 4") && text.contains("line 6"));
    assert!(text.contains("vocab.en"));
}

#[test]
fn vocab_file_rules() {
    let dir = tempfile::tempdir().expect("tempdir");
    let crlf = write(dir.path(), "crlf", b"<unk>\r\n<s>\r\n</s>\r\nhi\r\n");
    let v = Vocab::nmt_from_file(&crlf).expect("crlf is fine");
    assert_eq!(v.id("hi"), Some(3));
    let bare = write(dir.path(), "bare", b"hi\nyo\n");
    let v = Vocab::nmt_from_file(&bare).expect("specials are added");
    assert_eq!((v.id("<s>"), v.id("hi"), v.len()), (Some(1), Some(3), 5));
    let misplaced = write(dir.path(), "mis", b"hi\n<unk>\n<s>\n</s>\n");
    let err = Vocab::nmt_from_file(&misplaced).expect_err("misplaced");
    assert!(err.to_string().contains("mis:2"), "{err}");
    let spaced = write(dir.path(), "spaced", b"hi there\n");
    let err = Vocab::lm_from_file(&spaced).expect_err("space");
    assert!(err.to_string().contains("spaced:1"), "{err}");
}

#[test]
fn mismatched_line_counts_report_both() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = write(dir.path(), "s.en", b"a\nb\nc\n");
    let tgt = write(dir.path(), "t.xx", b"a\nb\n");
    for (s, t, counts) in [(&src, &tgt, (3, 2)), (&tgt, &src, (2, 3))] {
        let err = load(s, t, &LengthLimits::default()).expect_err("mismatch");
        match &err {
            Error::LineCountMismatch {
                source_lines,
                target_lines,
                ..
            } => assert_eq!((*source_lines, *target_lines), counts),
            other => panic!("wrong error {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains("s.en") && text.contains("t.xx"), "{text}");
    }
}

#[test]
fn invalid_utf8_names_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = write(dir.path(), "bad.en", b"a b\nc \xff d\n");
    let good = write(dir.path(), "good.xx", b"a\nb\n");
    let err = load(&bad, &good, &LengthLimits::default()).expect_err("utf8");
    assert!(matches!(
        err,
        Error::InvalidUtf8 {
            line: 2,
            byte_offset: 2,
            ..
        }
    ));
    assert!(err.to_string().contains("bad.en:2"), "{err}");
    let err = Vocab::nmt_from_file(&bad).expect_err("utf8");
    assert!(matches!(err, Error::InvalidUtf8 { line: 2, .. }));
    let err = LmCorpus::load_building_vocab(&bad).expect_err("utf8");
    assert!(matches!(err, Error::InvalidUtf8 { line: 2, .. }));
}

#[test]
fn lm_input_problems() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = write(dir.path(), "ptb.txt", b" a b \n c \n\n");
    let nmt_vocab = vocab(&["a"]);
    let err = LmCorpus::load(&text, &nmt_vocab).expect_err("no <eos>");
    assert!(err.to_string().contains("<eos>"), "{err}");
    let (corpus, vocab) = LmCorpus::load_building_vocab(&text).expect("loads");
    // a b <eos> c <eos> <eos>
    assert_eq!(corpus.tokens().len(), 6);
    assert_eq!(corpus.lines(), 3);
    assert_eq!(vocab.len(), 5);
    let err = LmBatcher::new(Arc::new(corpus), BatchSizing::PerRank(2), 5, 0, 2)
        .expect_err("6 tokens cannot fill 4 columns of 2");
    assert!(matches!(
        err,
        Error::CorpusTooSmall {
            tokens: 6,
            columns: 4,
            ..
        }
    ));
    let with_oov = write(dir.path(), "valid.txt", b"a zz\n");
    let corpus = LmCorpus::load(&with_oov, &vocab).expect("loads");
    assert_eq!(corpus.unk_count(), 1);
    assert_eq!(corpus.tokens()[1], UNK_ID);
}

#[test]
fn a_byte_order_mark_is_not_part_of_the_first_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bom = b"\xEF\xBB\xBF";
    let with_bom = write(
        dir.path(),
        "v.bom",
        &[&bom[..], b"<unk>\n<s>\n</s>\nhello\n"].concat(),
    );
    let vocab = Vocab::nmt_from_file(&with_bom).expect("a vocab with a BOM loads");
    assert_eq!(vocab.tokens(), &["<unk>", "<s>", "</s>", "hello"]);
    // Without specials, the first word is a word, not "\u{feff}hello".
    let plain = write(dir.path(), "w.bom", &[&bom[..], b"hello\nworld\n"].concat());
    let vocab = Vocab::nmt_from_file(&plain).expect("loads");
    assert_eq!(vocab.id("hello"), Some(3));
    // A corpus with a BOM reads its first word as in the vocabulary.
    let src = write(dir.path(), "s.bom", &[&bom[..], b"a b\n"].concat());
    let tgt = write(dir.path(), "t.bom", &[&bom[..], b"c\n"].concat());
    let corpus = load(&src, &tgt, &LengthLimits::default()).expect("loads");
    assert_eq!(corpus.stats().source_unk + corpus.stats().target_unk, 0);
}
